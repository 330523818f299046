"""Downloading from a fake mirror on 127.0.0.1 (never the real network)."""

from __future__ import annotations

import functools
import gzip
import hashlib
import http.server
import socket
import threading
from pathlib import Path

import numpy as np
import pytest

from capsnet.data import DATASETS, load_dataset
from capsnet.data import download as dl
from capsnet.errors import DatasetError


def idx_bytes(arr: np.ndarray) -> bytes:
    return bytes([0, 0, 0x08, arr.ndim]) + b"".join(d.to_bytes(4, "big") for d in arr.shape) + arr.tobytes()


class _Handler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):  # keep pytest output clean
        pass


@pytest.fixture
def mirror(tmp_path):
    """(base URL, served folder, list of requested paths) of a local HTTP server."""
    root = tmp_path / "mirror"
    root.mkdir()
    requests: list[str] = []

    class Counting(_Handler):
        def do_GET(self):
            requests.append(self.path)
            super().do_GET()

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Counting, directory=str(root)))
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/", root, requests
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture(autouse=True)
def fast_retries(monkeypatch, tmp_path):
    monkeypatch.setattr(dl, "RETRY_BACKOFF_S", 0.0)
    monkeypatch.setattr(dl, "TIMEOUT_S", 5.0)
    monkeypatch.setenv("CAPSNET_DATA", str(tmp_path / "cache"))
    monkeypatch.delenv("CAPSNET_MIRRORS", raising=False)


def serve_fake_mnist(root: Path, monkeypatch, *, n_train: int = 10, n_test: int = 4) -> dict[str, str]:
    """Write a tiny gzipped set into `root` and point DATASETS['mnist'] md5s at it."""
    rng = np.random.default_rng(1)
    md5s = {}
    for split, n in (("train", n_train), ("t10k", n_test)):
        for kind, arr in (
            ("images-idx3", rng.integers(0, 256, (n, 28, 28), dtype=np.uint8)),
            ("labels-idx1", (np.arange(n) % 10).astype(np.uint8)),
        ):
            name = f"{split}-{kind}-ubyte.gz"
            data = gzip.compress(idx_bytes(arr), mtime=0)
            (root / name).write_bytes(data)
            md5s[name] = hashlib.md5(data).hexdigest()
    for name, md5 in md5s.items():
        monkeypatch.setitem(DATASETS["mnist"]["files"], name, md5)
    return md5s


def test_good_download_is_cached_and_not_repeated(mirror, monkeypatch, tmp_path):
    url, root, requests = mirror
    serve_fake_mnist(root, monkeypatch)
    ds = load_dataset("mnist", mirrors=[url])
    assert len(ds.train) == 10 and len(ds.test) == 4
    cached = tmp_path / "cache" / "mnist"
    assert sorted(p.name for p in cached.iterdir() if not p.name.endswith(".lock")) == sorted(
        DATASETS["mnist"]["files"]
    )
    assert len(requests) == 4
    load_dataset("mnist", mirrors=[url])
    load_dataset("mnist", download=False)
    assert len(requests) == 4  # served from the cache


def test_bad_md5_is_refused_and_not_cached(mirror, monkeypatch, tmp_path):
    url, root, _ = mirror
    serve_fake_mnist(root, monkeypatch)
    monkeypatch.setitem(DATASETS["mnist"]["files"], "train-images-idx3-ubyte.gz", "0" * 32)
    with pytest.raises(DatasetError, match="MD5") as e:
        load_dataset("mnist", mirrors=[url])
    assert str(tmp_path / "cache" / "mnist") in str(e.value)
    cached = tmp_path / "cache" / "mnist"
    leftovers = [p for p in cached.glob("*") if not p.name.endswith(".lock")] if cached.exists() else []
    assert leftovers == []  # neither the bad file nor a temporary file remains (the download's lock file stays)


def test_next_mirror_and_env_override(mirror, monkeypatch, tmp_path):
    url, root, requests = mirror
    serve_fake_mnist(root, monkeypatch)
    (root / "empty").mkdir()
    # First mirror answers 404 for everything; the second has the files.
    monkeypatch.setenv("CAPSNET_MIRRORS", f"{url}empty,{url}")
    ds = load_dataset("mnist")
    assert len(ds.test) == 4
    assert sum(p.startswith("/empty/") for p in requests) == 4  # one try each: 404 is not retried


def test_offline_gives_one_clear_error(monkeypatch, tmp_path):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(DatasetError) as e:
        load_dataset("kmnist", mirrors=[f"http://127.0.0.1:{port}/"])
    msg = str(e.value)
    assert "could not download kmnist" in msg and "after 3 tries" in msg
    assert str(tmp_path / "cache" / "kmnist") in msg and "train-images-idx3-ubyte.gz" in msg
    assert "--data-dir" in msg


def test_known_md5_table():
    for info in DATASETS.values():
        idx = info.get("format", "idx") == "idx"
        assert (len(info["files"]) == 4 if idx else len(info["files"]) >= 1) and info["mirrors"]
        assert all(len(m) == 32 and int(m, 16) >= 0 for m in info["files"].values())
    assert dl.known_md5s("train-images-idx3-ubyte.gz")["f68b3c2dcbeaaa9fbdd348bbdeb94873"] == "mnist"


# ------------------------------------------------------------------------------------- faults, mirrors, ranks
def _cifar_archive(tmp_path, monkeypatch) -> bytes:
    import tarfile

    from capsnet.data import standins

    folder = standins.write_cifar(tmp_path / "src" / "cifar-10-batches-bin", n_train=10, n_test=5)
    archive = tmp_path / "src" / "cifar-10-binary.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(folder, arcname="cifar-10-batches-bin")
    data = archive.read_bytes()
    monkeypatch.setitem(DATASETS["cifar10"]["files"], "cifar-10-binary.tar.gz", hashlib.md5(data).hexdigest())
    return data


@pytest.mark.parametrize("fault", ["truncate", "drop", "chunked-cut", "wrong", "stall"])
def test_a_set_with_one_mirror_survives_a_fault(monkeypatch, tmp_path, fault):
    """CIFAR, SVHN, smallNORB and KMNIST have one mirror each: a fault there is retried, not fatal."""
    from faulty_server import FaultyServer

    monkeypatch.setattr(dl, "TIMEOUT_S", 0.3)
    data = _cifar_archive(tmp_path, monkeypatch)
    with FaultyServer() as server:
        server.serve("cifar-10-binary.tar.gz", data, fault, "ok")
        ds = load_dataset("cifar10", mirrors=[server.url])
        assert server.counts["/cifar-10-binary.tar.gz"] == 2
    assert len(ds.train) == 10
    cached = tmp_path / "cache" / "cifar10"
    temporary = [p for p in cached.rglob(".*") if not p.name.endswith(".lock")]  # (lock files stay)
    assert not (cached / "cifar-10-binary.tar.gz").exists() and not temporary


def test_each_mirror_gets_its_tries_then_the_next_one_serves(monkeypatch, tmp_path):
    from faulty_server import FaultyServer

    (tmp_path / "files").mkdir()
    md5s = serve_fake_mnist(tmp_path / "files", monkeypatch)
    with FaultyServer() as bad, FaultyServer() as good:
        for name in md5s:
            bad.serve(name, (tmp_path / "files" / name).read_bytes(), "drop")
            good.serve(name, (tmp_path / "files" / name).read_bytes())
        ds = load_dataset("mnist", mirrors=[bad.url, good.url])
        assert len(ds.train) == 10
        assert all(bad.counts["/" + n] == dl.TRIES_PER_MIRROR and good.counts["/" + n] == 1 for n in md5s)


def test_no_mirror_that_works_is_one_line_naming_each(monkeypatch, tmp_path):
    from faulty_server import FaultyServer

    (tmp_path / "files").mkdir()
    md5s = serve_fake_mnist(tmp_path / "files", monkeypatch)
    first = next(iter(md5s))
    with FaultyServer() as a, FaultyServer() as b:
        a.serve(first, (tmp_path / "files" / first).read_bytes(), "chunked-cut")
        b.serve(first, (tmp_path / "files" / first).read_bytes(), "wrong")
        with pytest.raises(DatasetError) as e:
            load_dataset("mnist", mirrors=[a.url, b.url])
    msg = str(e.value)
    assert "\n" not in msg and f"could not download mnist ({first}: {a.url}{first}: the body was cut short" in msg
    assert f"{b.url}{first}: MD5 " in msg and msg.count("(after 3 tries)") == 2
    cached = tmp_path / "cache" / "mnist"
    assert (
        not cached.exists() or [p for p in cached.iterdir() if not p.name.endswith(".lock")] == []
    )  # nothing partial or temporary


def test_concurrent_loads_download_and_unpack_once(monkeypatch, tmp_path):
    """Four callers at once (as torchrun ranks on one machine): one request, one extraction, no error, and the
    archive removed once."""
    from faulty_server import FaultyServer

    from capsnet.data import datasets

    data = _cifar_archive(tmp_path, monkeypatch)
    results, errors = [], []
    with FaultyServer() as server:
        server.serve("cifar-10-binary.tar.gz", data, "slow")

        def rank():
            try:
                results.append(len(load_dataset("cifar10", mirrors=[server.url]).train))
            except BaseException as e:  # (reported below)
                errors.append(e)

        datasets.clear_cache()
        threads = [threading.Thread(target=rank) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert server.counts["/cifar-10-binary.tar.gz"] == 1
    assert not errors and results == [10] * 4
    assert not [p for p in (tmp_path / "cache").rglob(".*") if not p.name.endswith(".lock")]  # no temporary file


def test_svhn_extra_is_fetched_when_asked_for(mirror, monkeypatch, tmp_path):
    pytest.importorskip("scipy")
    import shutil

    from capsnet.data import standins

    url, root, requests = mirror
    standins.write_svhn(root, n_train=6, n_test=4)
    shutil.copy(
        standins.write_svhn(tmp_path / "more", n_train=5, n_test=1) / "train_32x32.mat", root / "extra_32x32.mat"
    )
    for table, name in (("files", "train_32x32.mat"), ("files", "test_32x32.mat"), ("optional", "extra_32x32.mat")):
        monkeypatch.setitem(DATASETS["svhn"][table], name, hashlib.md5((root / name).read_bytes()).hexdigest())
    assert len(load_dataset("svhn", mirrors=[url]).train) == 6
    assert sorted(requests) == ["/test_32x32.mat", "/train_32x32.mat"]  # no extra unless asked for
    ds = load_dataset("svhn", extra=True, mirrors=[url])
    assert len(ds.train) == 6 + 5 and requests.count("/extra_32x32.mat") == 1
    assert len(load_dataset("svhn", extra=True, download=False).train) == 11  # then from the cache
    assert requests.count("/extra_32x32.mat") == 1


RANK_SCRIPT = """
import sys
from capsnet.data import DATASETS, load_dataset
DATASETS["cifar10"]["files"]["cifar-10-binary.tar.gz"] = sys.argv[2]
print(len(load_dataset("cifar10", mirrors=[sys.argv[1]], cache_dir=sys.argv[3]).train))
"""


@pytest.mark.slow
def test_two_processes_download_a_set_once(monkeypatch, tmp_path):
    """Two processes (as two torchrun ranks on one machine) load the same set into one cache at once."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from faulty_server import FaultyServer

    data = _cifar_archive(tmp_path, monkeypatch)
    md5 = DATASETS["cifar10"]["files"]["cifar-10-binary.tar.gz"]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1] / "src"), "OMP_NUM_THREADS": "1"}
    with FaultyServer() as server:
        server.serve("cifar-10-binary.tar.gz", data, "slow")
        cmd = [sys.executable, "-c", RANK_SCRIPT, server.url, md5, str(tmp_path / "shared")]
        procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
                 for _ in range(2)]  # fmt: skip
        outs = [p.communicate(timeout=120) for p in procs]
        assert server.counts["/cifar-10-binary.tar.gz"] == 1
    assert [p.returncode for p in procs] == [0, 0], [err for _, err in outs]
    assert [out for out, _ in outs] == ["10\n", "10\n"]
