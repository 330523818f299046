"""The `capsnet` command line: one module per subcommand in this package, each registering its own parser.

The error boundary (`main`): every failure that comes from the input ends as one line on stderr and exit
status 2 (`input_error_line`): an error capsnet raises on purpose (`CapsNetError`), a file that cannot be read
or written (`OSError`, with its path and the system's words: "Permission denied", "No space left on device"),
running out of memory (host or GPU), text that does not decode, and an image past Pillow's decompression-bomb guard.
Any other exception is a bug and keeps its traceback. With `CAPSNET_DEBUG=1` in the environment every error prints
its whole traceback too. Ctrl-C ends with status 130, and a reader of stdout that goes (`capsnet models | head -1`)
ends the command quietly with status 141, as a shell's SIGPIPE would.

May import: anything in capsnet (it is the top layer); nothing in capsnet imports cli.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import traceback
from collections.abc import Sequence
from typing import Any, NoReturn

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
    ("compare", "capsnet.cli.compare"),
    ("push", "capsnet.cli.push"),
    ("build-kernels", "capsnet.cli.build_kernels"),
]
# Each subcommand's line in `capsnet --help`, here so that the list needs none of the modules.
HELP: dict[str, str] = {
    "train": "train a model (CapsNet with the paper's MNIST recipe by default)",
    "evaluate": "accuracy, per-class accuracy and confusion matrix of a checkpoint",
    "predict": "classify PNG or JPEG images with a trained model",
    "demo": "train on the bundled MNIST digits for a few epochs, then evaluate",
    "data": "inspect and verify data sets",
    "visualize": "figures of a trained CapsNet: reconstructions, perturbations, routing, curves, confusion",
    "reproduce": "run one of the paper's experiments (CapsNet vs the baseline CNN)",
    "models": "list the models: parameters, paper, data they were designed for, shipped weights",
    "export": "export a model to ONNX (.onnx) or torch.export (.pt2), with a dynamic batch axis",
    "convert": "convert published weights into a save_pretrained folder",
    "explore": "a local web page: capsule lengths, poses, reconstructions, routing",
    "compare": "train routings and models (built-in or plugins) on the same data and budget; compare them",
    "push": "publish a checkpoint on the Hugging Face Hub, with its model card",
    "build-kernels": "compile the C++ CPU routing kernels once (4-7x faster routing on CPUs; else PyTorch routes)",
}


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (and exit status 2) naming the help of the (sub)command that failed
    (`capsnet train --help`), rather than the usage block."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")

    # Called with the parser and its arguments before they are parsed: a subcommand may add flags that depend on
    # them (`capsnet train --model PLUGIN` adds the plugin model's options). It reports a problem with `error`.
    prepare: Any = None

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        if self.prepare is not None and args is not None:
            self.prepare(self, list(args))
        return super().parse_known_args(args, namespace)

    def parse_args(self, args: Any = None, namespace: Any = None) -> Any:
        """As argparse's; an unknown flag is reported by the subcommand it was given to."""
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            self._innermost(parsed).error(f"unrecognized arguments: {' '.join(extras)}")
        return parsed

    def _innermost(self, parsed: argparse.Namespace) -> argparse.ArgumentParser:
        """The parser of the (sub)subcommand `parsed` chose: `capsnet data info`'s for `capsnet data info ...`."""
        parser: argparse.ArgumentParser = self
        while True:
            commands = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
            chosen = getattr(parsed, commands[0].dest, None) if commands else None
            if chosen not in (commands[0].choices if commands else {}):
                return parser
            parser = commands[0].choices[chosen]


class _Commands(argparse._SubParsersAction):
    """The subcommands: each parser is a `_Parser` with its line from HELP."""

    def add_parser(self, name: str, **kwargs: Any) -> argparse.ArgumentParser:
        kwargs.setdefault("help", HELP.get(name))
        return super().add_parser(name, **kwargs)


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The `capsnet` parser. With `argv`, only the subcommand it names gets its full parser (its module imported);
    the others are one line each in `capsnet --help`. Without, every subcommand is built."""
    parser = _Parser(
        prog="capsnet",
        description="Capsule networks for PyTorch: the papers' models and routing algorithms, each checked against its "
        "authors' code.",
    )
    parser.add_argument("--version", action="version", version=f"capsnet {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", action=_Commands)
    sub.required = True
    chosen = None if argv is None else next((a for a in argv if not a.startswith("-")), "")
    for name, module in COMMANDS:
        if chosen is None or chosen == name:
            importlib.import_module(module).register(sub)
        else:
            sub.add_parser(name)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser(argv).parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print(f"capsnet {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError as e:
        if not _stdout_closed():  # (a pipe of the command's own, such as an upload's socket: an input error)
            return _error(args.command, os_error_line(e))
        return 141  # the reader of stdout has gone (`capsnet models | head -1`): stop without a word, as 128 + SIGPIPE
    except Exception as e:
        line = input_error_line(e)
        if line is None:  # a bug: its traceback
            raise
        if debugging():
            traceback.print_exc()
        return _error(args.command, line)


def _stdout_closed() -> bool:
    """Whether the reader of stdout has gone (a closed pipe); if so, stdout is pointed at os.devnull, so that the
    interpreter's last flush at exit writes nowhere rather than reporting the closed pipe again."""
    try:
        fd = sys.stdout.fileno()
    except (OSError, ValueError, AttributeError):  # (no file behind it: pytest's capture, a StringIO)
        return False
    try:
        sys.stdout.flush()
        closed = _reader_gone(fd)
    except BrokenPipeError:
        closed = True
    if closed:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, fd)
        os.close(devnull)
    return closed


def _reader_gone(fd: int) -> bool:
    """Whether the pipe `fd` writes to has no reader left (poll's POLLERR on its write end); True where there is no
    poll (Windows), since the broken pipe is then most likely stdout's."""
    import select

    if not hasattr(select, "poll"):
        return True
    poller = select.poll()
    poller.register(fd, select.POLLOUT)
    return any(events & select.POLLERR for _, events in poller.poll(0))


DEBUG_ENV = "CAPSNET_DEBUG"


def debugging() -> bool:
    """Whether $CAPSNET_DEBUG asks for the whole traceback of every error (any value but "", "0")."""
    return os.environ.get(DEBUG_ENV, "") not in ("", "0")


def input_error_line(e: BaseException) -> str | None:
    """The one line that reports `e` when it comes from the input (see the module docstring); None for a bug."""
    if isinstance(e, CapsNetError):
        return str(e) or type(e).__name__
    if isinstance(e, OSError):  # a path that cannot be read or written (missing, no permission, a full disk, ...)
        return os_error_line(e)
    torch = sys.modules.get("torch")  # (an out-of-memory error from torch means torch is loaded)
    if torch is not None and isinstance(e, torch.cuda.OutOfMemoryError):
        return "out of GPU memory; try a smaller --batch-size (or --eval-batch-size)"
    if isinstance(e, MemoryError):
        return "out of memory: the input needs more memory than this machine has (docs/security.md lists the limits)"
    if isinstance(e, UnicodeError):  # text (a file's, a name's) that is not in the expected encoding
        return f"text in the wrong encoding ({e})"
    if type(e).__name__ == "DecompressionBombError" and type(e).__module__.startswith("PIL"):
        return f"an image too large to decode ({e})"
    return None


def _error(command: str, message: str) -> int:
    """One line on stderr (a message of several lines is joined into one) and exit status 2. Characters the terminal
    cannot show (a file name that is not valid UTF-8) are written as escapes."""
    line = " ".join(part.strip() for part in message.splitlines() if part.strip())
    text = f"capsnet {command}: error: {line}\n"
    encoding = getattr(sys.stderr, "encoding", None) or "utf-8"
    sys.stderr.write(text.encode(encoding, "backslashreplace").decode(encoding, "replace"))
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
