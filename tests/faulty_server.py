"""An HTTP server on 127.0.0.1 that misbehaves on purpose, for the download tests (never the real network).

Each path has a body and a plan: one behaviour per request, the last repeated. Behaviours:

    ok              200 with Content-Length and the whole body
    truncate        Content-Length of the whole body, half of it sent, then the connection closed
    drop            a third of the body, then the connection reset (RST)
    chunked-cut     Transfer-Encoding: chunked, one chunk of half the body, then closed without the last chunk
    wrong           the right length of wrong bytes
    stall           headers and a few bytes, then silence longer than the client's timeout
    stall-headers   silence before the status line
    no-length       no Content-Length (the body ends when the connection closes), whole body
    short-no-length no Content-Length, half the body
    slow            the whole body after a short wait (to make concurrent clients overlap)
    trickle         the right Content-Length, then the body a byte every TRICKLE_S seconds
    endless         no Content-Length, and a body that never ends (zeros until the client hangs up)
    404, 500        that status, no body
"""

from __future__ import annotations

import http.server
import socket
import struct
import threading
import time
from collections import Counter

STALL_S = 1.5  # longer than the tests' client timeout
TRICKLE_S = 0.2  # shorter than the tests' client timeout: every read gets a byte in time


class FaultyServer:
    def __init__(self) -> None:
        self.plans: dict[str, tuple[bytes, list[str]]] = {}
        self.requests: list[str] = []
        self.counts: Counter[str] = Counter()
        self._lock = threading.Lock()
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # keep pytest output clean
                pass

            def do_GET(self):
                with server._lock:
                    n = server.counts[self.path]
                    server.counts[self.path] += 1
                    server.requests.append(self.path)
                if self.path not in server.plans:
                    return self._status(404)
                body, plan = server.plans[self.path]
                behave(self, plan[min(n, len(plan) - 1)], body)

            def _status(self, code: int) -> None:
                self.send_response(code)
                self.send_header("Content-Length", "0")
                self.end_headers()

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.httpd.handle_error = lambda *args: None  # the faults make the handler fail on purpose
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/"
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    def serve(self, path: str, body: bytes, *plan: str) -> str:
        """Serve `body` at /path with the behaviours `plan` (default: ok); returns its URL."""
        self.plans["/" + path.lstrip("/")] = (body, list(plan) or ["ok"])
        return self.url + path.lstrip("/")

    def __enter__(self) -> FaultyServer:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def behave(handler: http.server.BaseHTTPRequestHandler, what: str, body: bytes) -> None:
    out = handler.wfile
    if what in ("404", "500"):
        handler.send_response(int(what))
        handler.send_header("Content-Length", "0")
        handler.end_headers()
        return
    if what == "stall-headers":
        time.sleep(STALL_S)
        handler.close_connection = True
        return
    if what == "slow":
        time.sleep(0.3)
    handler.send_response(200)
    chunked, length = what == "chunked-cut", what not in ("no-length", "short-no-length", "chunked-cut", "endless")
    if length:
        handler.send_header("Content-Length", str(len(body)))
    if chunked:
        handler.send_header("Transfer-Encoding", "chunked")
    if not length:
        handler.send_header("Connection", "close")
    handler.end_headers()
    handler.close_connection = True
    if what in ("ok", "slow", "no-length"):
        out.write(body)
    elif what == "wrong":
        out.write(bytes(b ^ 0xFF for b in body))
    elif what in ("truncate", "short-no-length"):
        out.write(body[: len(body) // 2])
    elif what == "chunked-cut":
        half = body[: len(body) // 2]
        out.write(f"{len(half):x}\r\n".encode() + half + b"\r\n")
    elif what == "drop":
        out.write(body[: len(body) // 3])
        out.flush()
        handler.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        handler.connection.close()  # a reset, not an orderly close
        return
    elif what == "trickle":
        for i in range(len(body)):
            out.write(body[i : i + 1])
            out.flush()
            time.sleep(TRICKLE_S)
    elif what == "endless":
        block = bytes(1 << 16)
        while True:  # until the client closes: the write fails
            out.write(block)
    elif what == "stall":
        out.write(body[:10])
        out.flush()
        time.sleep(STALL_S)
    else:
        raise ValueError(what)
    out.flush()


BEHAVIOURS = ["truncate", "drop", "chunked-cut", "wrong", "stall", "stall-headers", "500", "short-no-length"]
__all__ = ["BEHAVIOURS", "STALL_S", "TRICKLE_S", "FaultyServer"]
