"""capsnet's log lines: library modules log to the "capsnet" logger, shown as the command line has always shown them.

    log = logging.getLogger(__name__)      # in a module of capsnet: a child of "capsnet"
    log.info("epoch 1/10 ...")             # information: stdout, the message alone
    log.warning("capsnet: ...")            # warnings: stderr, the message alone

The "capsnet" logger gets one handler when this module is first imported (unless it has one already): INFO goes to
stdout and WARNING and above to stderr, the streams looked up at each line (so `contextlib.redirect_stdout` and
pytest's capture see them), without a prefix. It does not propagate to the root logger. A library user silences or
redirects the lines the usual way: `logging.getLogger("capsnet").setLevel(logging.WARNING)`, or replace its
handlers (and set `propagate = True` to let the application's own logging configuration take them);
`capsnet.fit(..., progress=False)` shows warnings only (`warnings_only`).

May import: nothing in capsnet (a foundation module).
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator

NAME = "capsnet"


class StreamsHandler(logging.Handler):
    """INFO and below to stdout, WARNING and above to stderr: the message alone, flushed."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            stream = sys.stderr if record.levelno >= logging.WARNING else sys.stdout
            stream.write(self.format(record) + "\n")
            stream.flush()
        except Exception:  # (logging's convention: a failing handler reports, never raises)
            self.handleError(record)


def _install() -> logging.Logger:
    logger = logging.getLogger(NAME)
    if not logger.handlers:
        logger.addHandler(StreamsHandler())
        logger.setLevel(logging.INFO)
        logger.propagate = False
    return logger


LOGGER = _install()


@contextlib.contextmanager
def warnings_only(quiet: bool = True) -> Iterator[None]:
    """While the block runs, with `quiet`, the "capsnet" logger shows warnings only (`capsnet.fit(...,
    progress=False)`: no information lines); its level is restored after."""
    level = LOGGER.level
    if quiet:
        LOGGER.setLevel(max(level, logging.WARNING))
    try:
        yield
    finally:
        LOGGER.setLevel(level)
