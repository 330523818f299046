"""Fetching one URL into a file, carefully: what data sets and pretrained weights are downloaded with.

    fetch_url(url, dest, md5=..., sha256=...) -> dest

- Each try streams the body into a temporary file beside `dest` (`capsnet.fileio.atomic_open`), which
  replaces `dest` only once the whole body is in and checked: a failed, cut or interrupted (Ctrl-C, a kill) download
  never leaves a partial file at `dest`.
- Checked: the bytes received against the Content-Length the server announced, then the MD5 / SHA-256 if given.
- A try that fails in a way the next one may not (a connection dropped mid-body, a body cut short, a chunked
  response cut off, a timeout, HTTP 5xx, 408 or 429, wrong bytes) is repeated, up to `retries` tries in all, the
  wait doubling from `backoff` seconds. HTTP 4xx, an unknown host and a malformed URL fail at once.
- `timeout` bounds each connect and each read; `deadline` (seconds) the whole call, every try included: a server
  that trickles a byte at a time ends with a DownloadError when it passes. Sooner, curl's low-speed limit: a try
  whose body arrives slower than `speed_limit` bytes/s for `speed_time` seconds running ends there (and is tried
  again, as curl --retry does). `max_bytes` bounds the body: a
  Content-Length above it is refused before reading, and the bytes are counted as they arrive (a body that never
  ends stops at the limit). Neither is retried. Defaults: capsnet.limits.
- Several processes that fetch the same `dest` at once (torchrun ranks on one machine, parallel jobs sharing a
  cache) take turns on a lock file beside it (filelock.FileLock, `.NAME.lock`); the first downloads, the others find
  `dest` there.

Failing every try raises `capsnet.errors.DownloadError`, one line naming the URL and why each try failed.
An error of the local file system (a read-only folder, a full disk) is not retried: it propagates as the OSError.

May import: the other foundation modules (errors, fileio, _version); nothing above them.
"""

from __future__ import annotations

import contextlib
import hashlib
import http.client
import os
import socket
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from filelock import FileLock

from ._version import __version__
from .errors import DownloadError
from .fileio import atomic_open
from .limits import DOWNLOAD_DEADLINE_S, DOWNLOAD_LOW_SPEED_BYTES_S, DOWNLOAD_LOW_SPEED_S, MAX_DOWNLOAD_BYTES

RETRIES = 3  # tries per URL
BACKOFF_S = 1.0  # wait after the first failed try; doubled after each further one
TIMEOUT_S = 20.0  # per connect and per read
CHUNK = 1 << 16


class _Retry(Exception):
    """A failed try that another try may get past."""


class _GiveUp(Exception):
    """A failed try that no other try at this URL can get past."""


def fetch_url(
    url: str,
    dest: str | os.PathLike,
    *,
    md5: str | None = None,
    sha256: str | None = None,
    retries: int = RETRIES,
    timeout: float = TIMEOUT_S,
    backoff: float = BACKOFF_S,
    max_bytes: int = MAX_DOWNLOAD_BYTES,
    deadline: float = DOWNLOAD_DEADLINE_S,
    speed_limit: float = DOWNLOAD_LOW_SPEED_BYTES_S,
    speed_time: float = DOWNLOAD_LOW_SPEED_S,
) -> Path:
    """Download `url` into `dest` (see the module docstring) and return `dest`. A `dest` already there with the
    given checksums (or any `dest`, when none is given) is kept and not fetched again."""
    dest = Path(dest)
    if retries < 1:
        raise ValueError(f"retries must be >= 1, got {retries}")
    if dest.is_file() and _matches(dest, md5, sha256):
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(dest.parent / f".{dest.name}.lock"):  # (the lock file stays: removing it could split waiters)
        if dest.is_file() and _matches(dest, md5, sha256):  # (fetched meanwhile by another process)
            return dest
        reasons: list[str] = []
        ends = time.monotonic() + deadline
        for attempt in range(retries):
            try:
                _fetch_once(
                    url,
                    dest,
                    md5=md5,
                    sha256=sha256,
                    timeout=timeout,
                    max_bytes=max_bytes,
                    ends=ends,
                    low_speed=_LowSpeed(speed_limit, speed_time),
                )
                return dest
            except _GiveUp as e:
                raise DownloadError(f"{url}: {e}", url=url, permanent=True) from None
            except _Retry as e:
                reasons.append(str(e))
            if attempt + 1 < retries:
                wait = backoff * 2**attempt
                if time.monotonic() + wait >= ends:
                    raise DownloadError(
                        f"{url}: {reasons[-1]}; not done within its deadline of {deadline:g} s", url=url
                    )
                time.sleep(wait)
        tried = f"after {retries} tries" if retries > 1 else "after 1 try"
        why = reasons[-1] if len(set(reasons)) == 1 else "; ".join(reasons)
        raise DownloadError(f"{url}: {why} ({tried})", url=url, permanent=False)


class _LowSpeed:
    """curl's --speed-limit / --speed-time: `check` raises _Retry once the bytes received have come slower than
    `limit` bytes/s over a stretch of `seconds` (each stretch starts where the last one that kept up ended)."""

    def __init__(self, limit: float, seconds: float) -> None:
        self.limit, self.seconds = limit, seconds
        self.start, self.received = time.monotonic(), 0

    def check(self, n: int) -> None:
        self.received += n
        elapsed = time.monotonic() - self.start
        if elapsed < self.seconds:
            return
        if self.received < self.limit * elapsed:
            raise _Retry(
                f"slower than {self.limit:,g} bytes/s for {self.seconds:g} s ({self.received:,} bytes in "
                f"{elapsed:.1f} s: DOWNLOAD_LOW_SPEED_BYTES_S, DOWNLOAD_LOW_SPEED_S)"
            )
        self.start, self.received = time.monotonic(), 0


def _fetch_once(
    url: str,
    dest: Path,
    *,
    md5: str | None,
    sha256: str | None,
    timeout: float,
    max_bytes: int,
    ends: float,
    low_speed: _LowSpeed,
) -> None:
    """One try: the body streamed into a temporary file that replaces `dest` only when it is complete and checked.
    Past `ends` (a time.monotonic() value) or `max_bytes`, it gives up (_GiveUp); below the low-speed limit, the try
    ends (_Retry)."""
    headers = {"User-Agent": f"capsnet/{__version__}", "Accept-Encoding": "identity"}
    request = urllib.request.Request(url, headers=headers)
    digests = [h for h, want in ((hashlib.md5(), md5), (hashlib.sha256(), sha256)) if want]
    with _network():
        response = urllib.request.urlopen(request, timeout=_left(ends, timeout, url))
    with response, atomic_open(dest, "wb") as out:  # (a failure to write here is the OSError it is, not retried)
        expected = _content_length(response)
        if expected is not None and expected > max_bytes:
            raise _GiveUp(f"the server announces {expected:,} bytes, more than the limit of {max_bytes:,}")
        received = 0
        while True:
            if response.fp is not None and response.fp.raw is not None:  # (each read waits at most what is left)
                with contextlib.suppress(AttributeError, OSError):
                    response.fp.raw._sock.settimeout(_left(ends, timeout, url))
            with _network():
                chunk = response.read1(CHUNK)  # (what has arrived: a trickle cannot hold one call for long)
            if not chunk:
                break
            low_speed.check(len(chunk))
            received += len(chunk)
            if received > max_bytes:
                raise _GiveUp(f"the body goes on past the limit of {max_bytes:,} bytes")
            _left(ends, timeout, url)
            out.write(chunk)
            for h in digests:
                h.update(chunk)
        # Raising inside atomic_open deletes the temporary file: a bad body never lands.
        if expected is not None and received != expected:
            raise _Retry(f"the connection closed after {received:,} of {expected:,} bytes")
        for h, want in zip(digests, [w for w in (md5, sha256) if w]):
            if h.hexdigest() != want.lower():
                raise _Retry(f"{h.name.upper()} {h.hexdigest()} != expected {want}")


def url_problem(url: str) -> str | None:
    """Why `url` is not an http(s) URL that can be asked (no scheme or host, a malformed IPv6 host or port), in
    words; None when it is one."""
    try:
        parts = urllib.parse.urlsplit(url)
        _ = parts.port  # (a port that is not a number raises here)
    except ValueError as e:  # "Invalid IPv6 URL", "Port could not be cast to integer value", ...
        return str(e)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return "no http(s) scheme or no host"
    return None


def _left(ends: float, timeout: float, url: str) -> float:
    """The seconds a network wait may take: `timeout`, or what is left before `ends`; _GiveUp once it has passed."""
    left = ends - time.monotonic()
    if left <= 0:
        raise _GiveUp("not done within its deadline")
    return min(timeout, left)


def _content_length(response) -> int | None:
    value = response.headers.get("Content-Length")
    try:
        return int(value) if value is not None and response.headers.get("Transfer-Encoding") is None else None
    except ValueError:
        return None


@contextlib.contextmanager
def _network() -> Iterator[None]:
    """Network failures as _Retry (worth another try) or _GiveUp."""
    try:
        yield
    except urllib.error.HTTPError as e:
        what = f"HTTP {e.code} {e.reason}"
        raise (_Retry(what) if e.code >= 500 or e.code in (408, 429) else _GiveUp(what)) from None
    except urllib.error.URLError as e:
        reason = e.reason
        if isinstance(reason, socket.gaierror):  # an unknown host (typically: offline)
            raise _GiveUp(f"cannot resolve the host ({reason})") from None
        if not isinstance(reason, OSError):  # urllib's own words: an unknown URL type, no host given, ...
            raise _GiveUp(str(reason)) from None
        raise _Retry(_describe(reason)) from None
    except http.client.IncompleteRead as e:  # a chunked (or length-known) body cut short
        raise _Retry(f"the body was cut short ({len(e.partial):,} bytes of a chunk read)") from None
    except http.client.HTTPException as e:  # RemoteDisconnected, BadStatusLine, ...
        raise _Retry(f"{type(e).__name__}: {e}" if str(e) else type(e).__name__) from None
    except TimeoutError:
        raise _Retry("timed out") from None
    except ValueError as e:  # a malformed URL or an unknown scheme
        raise _GiveUp(str(e)) from None
    except OSError as e:  # connection refused, reset, ...
        raise _Retry(_describe(e)) from None


def _describe(reason: object) -> str:
    if isinstance(reason, TimeoutError):
        return "timed out"
    if isinstance(reason, OSError) and reason.strerror:
        return reason.strerror
    return str(reason) or type(reason).__name__


def _matches(path: Path, md5: str | None, sha256: str | None) -> bool:
    checks = [(hashlib.md5, md5), (hashlib.sha256, sha256)]
    return all(file_digest(path, algo) == want.lower() for algo, want in checks if want)


def file_digest(path: str | os.PathLike, algorithm=hashlib.md5) -> str:
    """The hex digest of a file (MD5 by default), read in 1 MiB blocks."""
    h = algorithm()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """capsnet's cache folder, where downloaded data sets and pretrained weights live: `cache_dir`, else
    `$CAPSNET_DATA`, else `~/.cache/capsnet`."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    env = os.environ.get("CAPSNET_DATA")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "capsnet"


__all__ = [
    "BACKOFF_S",
    "RETRIES",
    "TIMEOUT_S",
    "cache_root",
    "fetch_url",
    "file_digest",
    "url_problem",
]
