"""Memory: the free-memory budget of the pre-training check (MemAvailable), what the check covers, and the bounded
cache of loaded data sets."""

import os

import numpy as np
import pytest
import torch

from capsnet import CapsNetConfig
from capsnet.data import datasets, load_dataset
from capsnet.errors import ConfigError
from capsnet.models import memory

# A machine with a warm page cache: little free, much available.
MEMINFO = """MemTotal:       24000000 kB
MemFree:          500000 kB
MemAvailable:   20000000 kB
Buffers:          100000 kB
Cached:         18000000 kB
"""


def test_the_cpu_budget_is_memavailable_not_the_free_pages(tmp_path, monkeypatch):
    path = tmp_path / "meminfo"
    path.write_text(MEMINFO)
    monkeypatch.setattr(os, "sysconf", lambda name: {"SC_AVPHYS_PAGES": 125_000, "SC_PAGE_SIZE": 4096}[name])
    assert memory.available_host_bytes(str(path)) == 20_000_000 * 1024
    monkeypatch.setattr(memory, "MEMINFO", str(path))
    assert memory.budget_bytes(torch.device("cpu")) == 20_000_000 * 1024
    # A step of 4 GB fits in the 19 GiB available, though only 0.5 GB are free pages.
    memory.check_memory(CapsNetConfig(), 16, torch.device("cpu"), budget=memory.budget_bytes(torch.device("cpu")))


def test_without_memavailable_the_free_pages_are_the_fallback(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "sysconf", lambda name: {"SC_AVPHYS_PAGES": 1000, "SC_PAGE_SIZE": 4096}[name])
    old_kernel = tmp_path / "meminfo"
    old_kernel.write_text("MemTotal: 1000 kB\nMemFree: 500 kB\n")
    assert memory.available_host_bytes(str(old_kernel)) == 1000 * 4096
    assert memory.available_host_bytes(str(tmp_path / "absent")) == 1000 * 4096  # no /proc (macOS)

    def no_sysconf(name):
        raise ValueError(name)

    monkeypatch.setattr(os, "sysconf", no_sysconf)
    assert memory.available_host_bytes(str(tmp_path / "absent")) is None


@pytest.mark.skipif(not os.path.isfile("/proc/meminfo"), reason="Linux only")
def test_this_machines_budget_is_read_from_proc_meminfo():
    with open("/proc/meminfo") as f:
        fields = dict(line.split(":", 1) for line in f)
    if "MemAvailable" not in fields:
        pytest.skip("a kernel without MemAvailable")
    expected = int(fields["MemAvailable"].split()[0]) * 1024
    assert abs(memory.budget_bytes(torch.device("cpu")) - expected) < 256 << 20  # (it moves between the reads)


def test_the_checks_line_says_which_model_it_estimates():
    big = CapsNetConfig(in_channels=3, image_size=224)
    with pytest.raises(ConfigError) as e:
        memory.check_memory(big, 32, torch.device("cpu"), budget=1 << 30)
    assert "CapsNet with dynamic routing" in str(e.value) and "\n" not in str(e.value)
    assert memory.COVERS == "CapsNet with dynamic routing"
    for routing in ("self-attention", "inverted-attention", "self-routing"):  # not modelled: not refused
        assert memory.check_memory(CapsNetConfig(routing=routing), 32, torch.device("cpu"), budget=1) is None


# ---------------------------------------------------------------------------------------------- data-set cache
def _write_npz(path, n, value):
    np.savez(path, x_train=np.full((n, 8, 8), value, np.uint8), y_train=np.arange(n) % 2,
             x_test=np.full((2, 8, 8), value, np.uint8), y_test=np.array([0, 1]))  # fmt: skip
    return path


def test_the_data_set_cache_keeps_only_the_last_few_sets(tmp_path, monkeypatch):
    monkeypatch.setattr(datasets, "_CACHE", type(datasets._CACHE)())
    monkeypatch.setattr(datasets, "CACHE_SETS", 2)
    paths = [_write_npz(tmp_path / f"d{k}.npz", 4, k) for k in range(3)]
    first = load_dataset(str(paths[0]))
    assert load_dataset(str(paths[0])) is first  # a second load is served from memory
    load_dataset(str(paths[1]))
    load_dataset(str(paths[0]))  # (used again: the most recent)
    load_dataset(str(paths[2]))  # evicts d1, the least recently used
    assert len(datasets._CACHE) == 2
    assert load_dataset(str(paths[0])) is first
    assert [key[1] for key in datasets._CACHE] == ["d2", "d0"]
    datasets.clear_cache()
    assert not datasets._CACHE and load_dataset(str(paths[0])) is not first


def test_the_data_set_cache_is_bounded_in_bytes(tmp_path, monkeypatch):
    monkeypatch.setattr(datasets, "_CACHE", type(datasets._CACHE)())
    monkeypatch.setattr(datasets, "CACHE_BYTES", 64 * 12)  # bytes of images and labels
    small = _write_npz(tmp_path / "small.npz", 2, 1)  # 4 images of 64 bytes + 4 labels of 8: 288 bytes
    big = _write_npz(tmp_path / "big.npz", 20, 2)  # more than the bound alone
    kept = load_dataset(str(small))
    loaded = load_dataset(str(big))
    assert len(loaded.train) == 20 and load_dataset(str(big)) is not loaded  # never kept
    assert load_dataset(str(small)) is not kept  # pushed out by the big one
    assert sum(map(datasets._nbytes, datasets._CACHE.values())) <= datasets.CACHE_BYTES
