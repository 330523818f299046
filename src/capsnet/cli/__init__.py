"""The `capsnet` command line: one module per subcommand in this package, each registering its own parser.

Every error capsnet raises on purpose (`CapsNetError`), a file that cannot be read or written (`OSError`, with its
path) and running out of GPU memory end as one line on stderr and exit status 2; Ctrl-C ends with status 130.

May import: anything in capsnet (it is the top layer); nothing in capsnet imports cli.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from typing import NoReturn

import torch

from .._version import __version__
from ..errors import CapsNetError

# (subcommand, module). Each module defines `register(subparsers)`, which adds its parser and
# sets `func=<callable taking the parsed args and returning an exit status>`.
COMMANDS: list[tuple[str, str]] = [
    ("train", "capsnet.cli.train"),
    ("evaluate", "capsnet.cli.evaluate"),
    ("predict", "capsnet.cli.predict"),
    ("demo", "capsnet.cli.demo"),
    ("data", "capsnet.cli.data"),
    ("visualize", "capsnet.cli.visualize"),
    ("reproduce", "capsnet.cli.reproduce"),
    ("models", "capsnet.cli.models"),
    ("export", "capsnet.cli.export"),
    ("convert", "capsnet.cli.convert"),
    ("explore", "capsnet.cli.explore"),
]


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (and exit status 2) rather than the usage block."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="capsnet", description="Capsule Networks with dynamic routing (Sabour, Frosst & Hinton 2017)."
    )
    parser.add_argument("--version", action="version", version=f"capsnet {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for _, module in COMMANDS:
        importlib.import_module(module).register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except CapsNetError as e:
        return _error(args.command, str(e))
    except OSError as e:  # a path that cannot be read or written (missing, a file for a folder, no permission, ...)
        return _error(args.command, os_error_line(e))
    except torch.cuda.OutOfMemoryError:
        return _error(args.command, "out of GPU memory; try a smaller --batch-size (or --eval-batch-size)")
    except KeyboardInterrupt:
        print(f"capsnet {args.command}: interrupted", file=sys.stderr)
        return 130


def _error(command: str, message: str) -> int:
    """One line on stderr (a message of several lines is joined into one) and exit status 2."""
    line = " ".join(part.strip() for part in message.splitlines() if part.strip())
    print(f"capsnet {command}: error: {line}", file=sys.stderr)
    return 2


def os_error_line(e: OSError) -> str:
    """`PATH: Permission denied` (both paths of a rename or link), or the error's own text when it names none."""
    if e.filename is None or not e.strerror:
        return str(e) or type(e).__name__
    paths = " -> ".join(str(p) for p in (e.filename, e.filename2) if p is not None)
    if isinstance(e, (FileExistsError, NotADirectoryError)):  # mkdir: a file stands where a folder should be
        return f"{paths}: {e.strerror} (a file is in the way of a folder)"
    return f"{paths}: {e.strerror}"


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
