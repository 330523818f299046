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
    assert sorted(p.name for p in cached.iterdir()) == sorted(DATASETS["mnist"]["files"])
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
    leftovers = list((tmp_path / "cache" / "mnist").glob("*")) if (tmp_path / "cache" / "mnist").exists() else []
    assert leftovers == []  # neither the bad file nor a temporary file remains


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
