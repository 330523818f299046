"""The `capsnet` command line: one module per subcommand in this package, each registering its own parser.

Every error capsnet raises on purpose (`CapsNetError`) ends as one line on stderr and exit status 2;
Ctrl-C ends with status 130.

May import: anything in capsnet (it is the top layer); nothing in capsnet imports cli.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from typing import NoReturn

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
        print(f"capsnet {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"capsnet {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
