"""capsnet.fetch.fetch_url against a loopback server that truncates, drops, cuts chunked bodies, serves wrong bytes
and stalls (tests/faulty_server.py): it succeeds where another try can, fails in one line where none can, and never
leaves a partial file."""

from __future__ import annotations

import hashlib
import threading
import time

import pytest
from faulty_server import BEHAVIOURS, FaultyServer

from capsnet import fetch
from capsnet.errors import CapsNetError, DownloadError

BODY = bytes(range(256)) * 600  # 153,600 bytes: several read chunks
MD5 = hashlib.md5(BODY).hexdigest()
SHA256 = hashlib.sha256(BODY).hexdigest()
FAST = {"timeout": 0.3, "backoff": 0.0}  # a stall (faulty_server.STALL_S) fails after 0.3 s; no wait between tries


@pytest.fixture
def server():
    with FaultyServer() as s:
        yield s


def _leftovers(folder) -> list[str]:
    """The files in `folder` but the download's lock file (it stays: removing it could split two waiters)."""
    return sorted(p.name for p in folder.iterdir() if not p.name.endswith(".lock")) if folder.exists() else []


@pytest.mark.parametrize("fault", BEHAVIOURS)
def test_a_fault_then_the_right_file_succeeds(server, tmp_path, fault):
    url = server.serve("f.bin", BODY, fault, "ok")
    dest = fetch.fetch_url(url, tmp_path / "f.bin", md5=MD5, **FAST)
    assert dest.read_bytes() == BODY and server.counts["/f.bin"] == 2
    assert _leftovers(tmp_path) == ["f.bin"]  # no temporary file


@pytest.mark.parametrize("fault", BEHAVIOURS)
def test_a_fault_on_every_try_fails_in_one_line_and_leaves_nothing(server, tmp_path, fault):
    url = server.serve("f.bin", BODY, fault)
    with pytest.raises(DownloadError) as e:
        fetch.fetch_url(url, tmp_path / "f.bin", md5=MD5, retries=3, **FAST)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(url) and msg.endswith("(after 3 tries)"), msg
    assert isinstance(e.value, CapsNetError) and not e.value.permanent and e.value.url == url
    assert server.counts["/f.bin"] == 3 and _leftovers(tmp_path) == []


def test_what_each_fault_is_called(server, tmp_path):
    expected = {
        "truncate": "the connection closed after 76,800 of 153,600 bytes",
        "chunked-cut": "the body was cut short",
        "wrong": f"MD5 {hashlib.md5(bytes(b ^ 0xFF for b in BODY)).hexdigest()} != expected {MD5}",
        "stall": "timed out",
        "stall-headers": "timed out",
        "500": "HTTP 500",
        "short-no-length": "MD5 ",
    }
    for fault, words in expected.items():
        url = server.serve(fault, BODY, fault)
        with pytest.raises(DownloadError, match=words):
            fetch.fetch_url(url, tmp_path / fault, md5=MD5, retries=1, **FAST)


def test_http_404_and_an_unknown_scheme_are_not_retried(server, tmp_path):
    url = server.url + "absent.bin"
    with pytest.raises(DownloadError, match="HTTP 404") as e:
        fetch.fetch_url(url, tmp_path / "a.bin", retries=3, **FAST)
    assert e.value.permanent and server.counts["/absent.bin"] == 1 and "tries" not in str(e.value)
    with pytest.raises(DownloadError, match="unknown url type") as e:
        fetch.fetch_url("nope://x/y", tmp_path / "a.bin", retries=3, **FAST)
    assert e.value.permanent and _leftovers(tmp_path) == []


def test_a_body_without_content_length_and_both_checksums(server, tmp_path):
    url = server.serve("n.bin", BODY, "no-length")
    assert fetch.fetch_url(url, tmp_path / "n.bin", md5=MD5, sha256=SHA256, **FAST).read_bytes() == BODY
    with pytest.raises(DownloadError, match="SHA256"):
        fetch.fetch_url(url, tmp_path / "m.bin", sha256="0" * 64, retries=2, **FAST)
    assert not (tmp_path / "m.bin").exists()


def test_a_file_already_there_is_kept_unless_its_checksum_is_wrong(server, tmp_path):
    url = server.serve("k.bin", BODY)
    (tmp_path / "k.bin").write_bytes(BODY)
    fetch.fetch_url(url, tmp_path / "k.bin", md5=MD5, **FAST)
    assert server.counts["/k.bin"] == 0
    (tmp_path / "k.bin").write_bytes(b"stale")
    fetch.fetch_url(url, tmp_path / "k.bin", md5=MD5, **FAST)
    assert server.counts["/k.bin"] == 1 and (tmp_path / "k.bin").read_bytes() == BODY


def test_ctrl_c_mid_body_leaves_no_partial_file(server, tmp_path, monkeypatch):
    url = server.serve("c.bin", BODY)
    reads = []
    real = fetch.http.client.HTTPResponse.read1

    def read(self, *args):
        reads.append(1)
        if len(reads) == 2:
            raise KeyboardInterrupt
        return real(self, *args)

    monkeypatch.setattr(fetch.http.client.HTTPResponse, "read1", read)
    with pytest.raises(KeyboardInterrupt):
        fetch.fetch_url(url, tmp_path / "c.bin", md5=MD5, **FAST)
    assert _leftovers(tmp_path) == []


def test_a_local_write_error_is_not_taken_for_a_network_fault(server, tmp_path):
    url = server.serve("w.bin", BODY)
    (tmp_path / "file").write_text("x")
    with pytest.raises(OSError) as e:  # the folder cannot be made: the OSError itself, not three tries
        fetch.fetch_url(url, tmp_path / "file" / "w.bin", **FAST)
    assert not isinstance(e.value, DownloadError) and server.counts["/w.bin"] == 0


def test_concurrent_fetches_of_one_file_download_it_once(server, tmp_path):
    """As torchrun ranks on one machine do: every caller waits on the lock, the first downloads, the rest find it."""
    url = server.serve("s.bin", BODY, "slow")
    results, errors = [], []

    def worker():
        try:
            results.append(fetch.fetch_url(url, tmp_path / "s.bin", md5=MD5, timeout=5.0, backoff=0.0).read_bytes())
        except BaseException as e:  # (reported below)
            errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and results == [BODY] * 4 and server.counts["/s.bin"] == 1
    assert _leftovers(tmp_path) == ["s.bin"]


def test_a_transfer_slower_than_the_speed_limit_ends_in_one_line(server, tmp_path):
    """curl's --speed-limit / --speed-time: a body that arrives at 5 bytes/s (a byte every TRICKLE_S, each read in
    time) ends once it has run below `speed_limit` bytes/s for `speed_time` seconds, not at the deadline."""
    url = server.serve("t.bin", BODY, "trickle")
    started = time.monotonic()
    with pytest.raises(DownloadError, match=r"slower than 1,000 bytes/s for 0.6 s") as e:
        fetch.fetch_url(url, tmp_path / "t.bin", retries=1, timeout=5.0, speed_limit=1000, speed_time=0.6)
    assert time.monotonic() - started < 3.0 and "\n" not in str(e.value) and _leftovers(tmp_path) == []
    quick = server.serve("q.bin", BODY)  # a fast body is not held to anything by the limit
    assert fetch.fetch_url(quick, tmp_path / "q.bin", speed_limit=1000, speed_time=0.01).read_bytes() == BODY


def test_every_download_has_the_low_speed_limit_of_capsnet_limits():
    import inspect

    from capsnet import limits

    defaults = {k: p.default for k, p in inspect.signature(fetch.fetch_url).parameters.items()}
    assert defaults["speed_limit"] == limits.DOWNLOAD_LOW_SPEED_BYTES_S > 0
    assert defaults["speed_time"] == limits.DOWNLOAD_LOW_SPEED_S > 0
