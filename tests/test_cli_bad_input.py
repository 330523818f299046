"""Every bad value of every option of every subcommand: one line on stderr, exit status 2, no traceback.

The cases are generated from the real parser (`capsnet.cli.build_parser()`): each option's bad values follow from
its type (int: 0, -1, not a number; float: -1, nan, not a number; choices: an unknown one) or, for paths, devices
and other strings, from its name (KINDS). A subcommand added later is covered as long as its options are of those
kinds; an option of no known kind fails `test_every_option_has_bad_values_or_a_reason`, naming it.

Each case runs in-process through `capsnet.cli.main`. The rest of the command line holds safe, quick values
(SAFE), and training is stopped before its first step (`train_epoch` raises), so a bad value that is not refused
ends at once as a test failure rather than as a training run.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.util
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import small_config

from capsnet import CapsNet
from capsnet.cli import build_parser, main
from capsnet.cli.train import model_options
from capsnet.experiments import compare
from capsnet.models.baseline import BaselineCNN
from capsnet.training import loop

ROOT = os.geteuid() == 0 if hasattr(os, "geteuid") else False  # root reads and writes through any permission bits

# Options that take no value to get wrong, or whose every value is valid.
NO_BAD_VALUE = {
    "help": "prints the help",
    "seed": "any integer is a seed",
    "val_seed": "any integer is a seed",
    "message": "any text is a commit message",
}
# Counts for which 0 is a valid value (only the negative ones are bad).
ZERO_OK = {"shift", "conv_padding"}
# dest -> kind, for the options whose type does not say what they hold.
KINDS = {
    "checkpoint": "checkpoint",
    "data_dir": "folder",
    "dataset": "data",
    "name_or_dir": "data",
    "affnist": "data",
    "config_file": "file",
    "images": "image",
    "out": "out",
    "device": "device",
    "model": "name",
    "routing": "name",
    "routings": "name",
    "models": "name",
    "option": "name",
    "experiment": "name",
    "monitor": "name",
    "host": "name",
    "augment": "augment",
    "image_size": "size",
    "pretrained": "pretrained",
    "weights": "file",
    "results": "out",
    "repo": "hub repo",
    "revision": "hub revision",
}
# Safe values for the rest of each command line: quick, on the CPU, inside the test's folder (by dest).
SAFE = {
    "device": ["cpu"],
    "epochs": ["1"],
    "train_subset": ["16"],
    "test_subset": ["16"],
    "batch_size": ["64"],
    "limit": ["8"],
    "n": ["2"],
    "progress": ["--no-progress"],
    "tensorboard": ["--no-tensorboard"],
    "quick": ["--quick"],
    "figures": ["--no-figures"],
    "routings": ["dynamic"],
    "repo": ["org/name"],
}


@dataclass(frozen=True)
class Case:
    command: tuple[str, ...]  # ("train",) or ("data", "info")
    dest: str
    flag: str | None  # the option string, None for a positional
    value: str  # what goes wrong: a label, made into argv by `_argv`
    context: tuple[str, ...] = ()  # extra argv the value needs to matter (e.g. the model that takes the flag)

    @property
    def id(self) -> str:
        model = f" ({self.context[1]})" if self.context[:1] == ("--model",) else ""
        return f"{' '.join(self.command)} {self.flag or self.dest}={self.value}{model}"


def _subcommands(parser: argparse.ArgumentParser, prefix: tuple[str, ...] = ()):
    """(command path, its parser) for every leaf subcommand, e.g. (("data", "info"), parser)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _subcommands(sub, (*prefix, name)) if _has_subcommands(sub) else [((*prefix, name), sub)]


def _has_subcommands(parser: argparse.ArgumentParser) -> bool:
    return any(isinstance(a, argparse._SubParsersAction) for a in parser._actions)


def _kind(action: argparse.Action) -> str | None:
    if action.dest in NO_BAD_VALUE:
        return None
    if action.dest in KINDS:
        return KINDS[action.dest]
    if action.choices is not None:
        return "choice"
    if action.type is float or getattr(action.type, "__name__", "") == "finite_float":
        return "float"
    if action.type is int or getattr(action.type, "__name__", "") in ("_positive", "positive"):
        return "count"
    return None


BAD_VALUES = {
    "count": ["0", "-1", "x"],
    "float": ["-1", "nan", "x"],
    "choice": ["no-such-choice"],
    "device": ["quantum", "cuda:99" if torch.cuda.is_available() else "cuda"],
    "name": ["no-such-name"],
    "pretrained": ["no-such-model:tag", "capsnet:no-such-tag", "capsnet", "http://127.0.0.1:9/no-sha256",
                   "hf-hub:org/../x", "hf-hub:org/x@../../y"],
    "augment": ["warp=3"],
    "hub repo": ["no-org", "org/../x", "org/a--b"],
    "hub revision": ["../../refs", "main/../x"],
    "size": ["0", "big"],
    "folder": ["missing", "a file", "unreadable"],
    "data": ["missing", "a file", "unreadable", "not a data set"],
    "file": ["missing", "a folder", "unreadable", "corrupt"],
    "image": ["missing", "a folder", "unreadable", "corrupt"],
    "checkpoint": ["missing", "a file", "unreadable", "empty folder", "corrupt weights", "corrupt config",
                   "another model's weights"],
    "out": ["a file", "unwritable"],
    "resume": ["corrupt state", "another model's run"],
}  # fmt: skip
# "unreadable" is a symlink to itself (an OSError on any open, for root too) and "unwritable" a folder under a file
# (no one can create it). Permission bits stop other users only (root reads and writes through any mode): for them
# also a path inside a folder of mode 0, and an --out inside a read-only folder.
if not ROOT:
    for kind in ("folder", "data", "file", "image", "checkpoint"):
        BAD_VALUES[kind].append("no permission")
    BAD_VALUES["out"].append("read-only parent")
# Values that only the training of some models reads: the flag goes with a model that takes it.
MODEL_OPTIONS = model_options()


def _argparse_validator(action: argparse.Action, kind: str, value: str) -> str | None:
    """The name of argparse's check that refuses `value` for `action` (its `choices`, or its `type` function),
    None if the value passes argparse and meets the command's own checks."""
    if kind not in ("count", "float", "choice"):
        return None
    if action.choices is not None:
        return "choices" if value not in [str(c) for c in action.choices] else None
    try:
        action.type(value)  # type: ignore[misc]
    except (ValueError, TypeError, argparse.ArgumentTypeError):
        return getattr(action.type, "__name__", repr(action.type))
    return None


def _cases() -> list[Case]:
    """One case per bad value and validator: a value that argparse refuses (a type function, choices) once per
    subcommand and validator, as every option checked by it is refused alike; any other value for each option that
    takes it, and for a model option with each model that takes the flag (each model's config checks its own); a
    count that argparse passes gets 0 (the boundary its check refuses), not -1 too."""
    cases, refused = [], set()
    for command, parser in _subcommands(build_parser()):
        for action in parser._actions:
            kind = _kind(action)
            if kind is None:
                continue
            flag = action.option_strings[-1] if action.option_strings else None
            contexts: list[tuple[str, ...]] = [()]
            if command == ("train",) and action.dest in MODEL_OPTIONS:  # with each model that takes the flag
                contexts = [("--model", model) for model in MODEL_OPTIONS[action.dest].models]
            if command == ("reproduce",) and action.dest == "affnist":
                contexts = [("affnist",)]  # the experiment that reads it
            if command == ("reproduce",) and action.dest in ("benchmark", "precision", "results"):
                contexts = [("zoo",)]
            values = [v for v in BAD_VALUES[kind] if not (v == "0" and action.dest in ZERO_OK)]
            if kind == "count" and "0" in values and _argparse_validator(action, kind, "0") is None:
                values.remove("-1")  # the command's own check of a count refuses 0, and -1 with it
            for value in values:
                validator = _argparse_validator(action, kind, value)
                if validator is None:
                    cases += [Case(command, action.dest, flag, value, context) for context in contexts]
                elif (command, validator, value) not in refused:
                    refused.add((command, validator, value))
                    cases.append(Case(command, action.dest, flag, value, contexts[0]))
            if kind == "out" and any(a.dest == "resume" for a in parser._actions) and command == ("train",):
                cases += [Case(command, "out", flag, value, ("--resume",)) for value in BAD_VALUES["resume"]]
    return cases


CASES = _cases()


# ------------------------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    """Good and bad paths, made once."""
    tmp = tmp_path_factory.mktemp("paths")
    good = BaselineCNN(channels=(4, 4), hidden=(8, 8))
    good.save_pretrained(tmp / "model")
    (tmp / "a-file.txt").write_text("not a folder\n")
    (tmp / "a-folder").mkdir()
    (tmp / "empty").mkdir()
    os.symlink(tmp / "loop", tmp / "loop")  # a symlink to itself: every open fails (ELOOP)
    (tmp / "corrupt-weights").mkdir()
    shutil.copy(tmp / "model" / "config.json", tmp / "corrupt-weights" / "config.json")
    (tmp / "corrupt-weights" / "model.safetensors").write_bytes(b"\x00not safetensors" * 8)
    shutil.copytree(tmp / "model", tmp / "corrupt-config")
    (tmp / "corrupt-config" / "config.json").write_text("{not json")
    shutil.copytree(tmp / "model", tmp / "other-model")  # a baseline's config with a CapsNet's weights
    CapsNet(config=small_config()).save_pretrained(tmp / "capsnet")
    shutil.copy(tmp / "capsnet" / "model.safetensors", tmp / "other-model" / "model.safetensors")
    from PIL import Image

    Image.fromarray(np.full((28, 28), 200, np.uint8)).save(tmp / "digit.png")
    (tmp / "corrupt.png").write_bytes(b"\x89PNG not really")
    (tmp / "corrupt.yaml").write_text("epochs: [1, 2\n")
    from keras_reference import random_weights, write_h5

    write_h5(tmp / "keras.h5", random_weights("mnist"), "mnist")  # the Efficient-CapsNet authors' layout
    from test_converters import apple_state, gram_state, heinsen_state, xifengguo_state

    for fmt, state in (("xifengguo-capsnet", xifengguo_state()), ("gram-ai-capsnet", gram_state()),
                       ("inverted-attention", {"net": apple_state()}),
                       ("heinsen-capsnet", heinsen_state())):  # fmt: skip
        torch.save(state, tmp / f"{fmt}.pt")  # each PyTorch format's own layout
    # Runs to resume: one with a corrupt state.pt, one of another model (a baseline run resumed as capsnet).
    run = tmp / "baseline-run"
    argv = ["train", "--model", "baseline", "--channels", "4", "4", "--hidden", "8", "8", "--out", str(run),
            "--epochs", "1", "--train-subset", "16", "--test-subset", "16", "--batch-size", "8", "--device", "cpu",
            "--no-progress", "--no-tensorboard"]  # fmt: skip
    assert main(argv) == 0
    shutil.copytree(run, tmp / "corrupt-run")
    (tmp / "corrupt-run" / "state.pt").write_bytes(b"PK\x03\x04 truncated")
    rng = np.random.default_rng(0)
    np.savez(tmp / "digits.npz", x_train=rng.integers(0, 255, (32, 28, 28), dtype=np.uint8), y_train=np.arange(32) % 10,
             x_test=rng.integers(0, 255, (20, 28, 28), dtype=np.uint8), y_test=np.arange(20) % 10)  # fmt: skip
    return {"tmp": tmp, "good": tmp / "model", "png": tmp / "digit.png", "data": tmp / "digits.npz",
            "h5": tmp / "keras.h5"}  # fmt: skip


def _bad_path(case: Case, files: dict[str, Path], tmp: Path) -> str:
    base = files["tmp"]
    kind = case.value
    if kind == "missing":
        return str(tmp / "no" / "such" / "path")
    if kind in ("a file", "not a data set"):
        return str(base / "a-file.txt")
    if kind == "a folder":
        return str(base / "a-folder")
    if kind == "unreadable":
        return str(base / "loop")
    if kind == "no permission":
        locked = tmp / "locked"
        locked.mkdir()
        (locked / "thing").mkdir()
        locked.chmod(0)
        return str(locked / "thing")
    if kind == "empty folder":
        return str(base / "empty")
    if kind == "corrupt":
        return str(base / ("corrupt.png" if case.dest in ("images", "weights") else "corrupt.yaml"))
    if kind in ("corrupt weights", "corrupt config"):
        return str(base / kind.replace(" ", "-"))
    if kind == "another model's weights":
        return str(base / "other-model")
    if kind == "unwritable":  # a folder under a file: no one, root included, can create it
        return str(base / "a-file.txt" / "run")
    if kind == "read-only parent":
        (tmp / "locked").mkdir()
        (tmp / "locked").chmod(0o555)
        return str(tmp / "locked" / "run")
    if kind == "corrupt state":
        return str(shutil.copytree(base / "corrupt-run", tmp / "corrupt-run"))
    if kind == "another model's run":
        return str(shutil.copytree(base / "baseline-run", tmp / "baseline-run"))
    raise AssertionError(kind)


PATH_VALUES = {"missing", "a file", "a folder", "unreadable", "no permission", "empty folder", "corrupt",
               "corrupt weights", "corrupt config", "another model's weights", "unwritable", "read-only parent",
               "corrupt state", "another model's run", "not a data set"}  # fmt: skip


def _argv(case: Case, parser: argparse.ArgumentParser, files: dict[str, Path], tmp: Path) -> list[str]:
    """The subcommand with safe values everywhere but `case`'s option, which gets the bad value."""
    bad = _bad_path(case, files, tmp) if case.value in PATH_VALUES else case.value
    out = str(tmp / ("model.onnx" if case.command == ("export",) else "out"))
    keras = case.command[1:] in ((), ("efficient-capsnet",))
    weights = files["h5"] if keras else files["tmp"] / f"{case.command[1]}.pt"
    good = {"checkpoint": str(files["good"]), "images": str(files["png"]), "name_or_dir": "mnist-sample",
            "experiment": "mnist", "out": out, "weights": str(weights), "results": str(tmp / "results")}  # fmt: skip
    argv: list[str] = [*case.command]
    positionals: list[str] = []
    groups = [{a.dest for a in g._group_actions} for g in parser._mutually_exclusive_groups]
    exclusive = set().union(*(g for g in groups if case.dest in g)) - {case.dest}  # may not come with the bad one
    for action in parser._actions:
        if action.dest in exclusive:
            continue
        if action.dest == case.dest:
            value = [bad]
        elif case.context == ("zoo",) and action.dest in ("quick", "epochs", "batch_size", "dataset"):
            # the zoo's budgets and data are its benchmark's own
            continue
        elif action.dest in SAFE:
            value = SAFE[action.dest]
        elif action.dest == "dataset":  # a small set: quick to evaluate
            value = [str(files["data"])]
        elif action.dest in good and (
            action.required
            or not action.option_strings
            or action.dest in ("out", "checkpoint")
            or (action.dest == "results" and case.context == ("zoo",))
        ):
            value = [good[action.dest]]
        else:
            continue
        if not action.option_strings:
            positionals += value
        elif value[0].startswith("--"):
            argv += value
        else:
            argv += [action.option_strings[-1], *value]
    if case.command == ("reproduce",) and case.context in (("affnist",), ("zoo",)):
        positionals = list(case.context)
        return [*argv, *positionals]
    return [*argv, *case.context, *positionals]


@functools.cache
def _parser_of(command: tuple[str, ...]) -> argparse.ArgumentParser:
    """The parser of `command`, built once (60 ms a build): read for its options, never parsed with."""
    return dict(_subcommands(build_parser()))[command]


class _Trained(BaseException):
    """Raised where training would start: the bad value was not refused."""


@pytest.fixture
def no_training(monkeypatch):
    def refuse(*args, **kwargs):
        raise _Trained("training started: the bad value was accepted")

    monkeypatch.setattr(loop, "train_epoch", refuse)
    monkeypatch.setattr(compare, "run_entry", refuse)  # capsnet compare trains each entry in a process of its own
    from capsnet.models import hf_hub  # capsnet push: stopped before it reaches the Hub

    monkeypatch.setattr(hf_hub, "push_folder", refuse)
    if importlib.util.find_spec("gradio") is not None:  # capsnet explore: stopped before it serves
        from capsnet.viz import explore

        monkeypatch.setattr(explore.Explorer, "launch", refuse)


# ------------------------------------------------------------------------------------------------ the tests
def test_the_cases_cover_every_subcommand():
    commands = {c.command for c in CASES}
    assert {("train",), ("evaluate",), ("predict",), ("demo",), ("data", "info"), ("data", "check"),
            ("visualize",), ("reproduce",)} <= commands  # fmt: skip
    assert len(CASES) > 200


def test_every_option_has_bad_values_or_a_reason():
    unknown = []
    for command, parser in _subcommands(build_parser()):
        for action in parser._actions:
            flag_only = action.nargs == 0  # --json, --quick, --no-progress, booleans: nothing to get wrong
            if _kind(action) is None and not flag_only and action.dest not in NO_BAD_VALUE:
                unknown.append(f"{' '.join(command)} {action.option_strings or action.dest}")
    assert not unknown, f"say what a bad value of these is (KINDS) or why none is (NO_BAD_VALUE): {unknown}"


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_a_bad_value_is_one_line_and_exit_2(case, files, tmp_path, capsys, no_training):
    argv = _argv(case, _parser_of(case.command), files, tmp_path)
    try:
        try:
            code = main(argv)
        except SystemExit as e:  # argparse's own errors
            code = e.code
    finally:
        if (tmp_path / "locked").exists():
            (tmp_path / "locked").chmod(0o755)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, f"{argv}: exit {code}\n{err}"
    assert len(lines) == 1 and "Traceback" not in err, f"{argv}:\n{err}"
    assert lines[0].startswith(f"capsnet {case.command[0]}"), lines[0]
    if case.value in PATH_VALUES:  # the line names the path (or the file in it that failed)
        bad = argv[argv.index(case.flag) + 1] if case.flag else argv[-1]  # (positionals come last)
        assert bad in lines[0] or str(Path(bad).parent) in lines[0], lines[0]


@pytest.mark.parametrize("context", sorted({(c.command, c.context) for c in CASES if c.context != ("--resume",)}),
                         ids=lambda c: " ".join((*c[0], *c[1])))  # fmt: skip
def test_the_safe_command_lines_are_accepted(context, files, tmp_path, capsys, no_training):
    """The control: with no bad value the same command lines run (or reach training), so that each case above
    fails for its own value."""
    command, extra = context
    case = Case(command, dest="", flag=None, value="", context=extra)
    argv = _argv(case, _parser_of(command), files, tmp_path)
    with contextlib.suppress(_Trained):
        assert main(argv) == 0, capsys.readouterr().err


def test_os_errors_and_running_out_of_gpu_memory_are_one_line(monkeypatch, capsys, files):
    """What no file set-up here can provoke as root: a permission error deep inside a command, and CUDA's
    out-of-memory error."""
    from capsnet import inference as evaluate_module

    def denied(*args, **kwargs):
        raise PermissionError(13, "Permission denied", "/data/locked/images.npy")

    monkeypatch.setattr(evaluate_module, "evaluate_checkpoint", denied)
    assert main(["evaluate", "--checkpoint", str(files["good"])]) == 2
    assert capsys.readouterr().err == "capsnet evaluate: error: /data/locked/images.npy: Permission denied\n"

    def oom(*args, **kwargs):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore lines")

    monkeypatch.setattr(evaluate_module, "evaluate_checkpoint", oom)
    assert main(["evaluate", "--checkpoint", str(files["good"])]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("capsnet evaluate: error: out of GPU memory")

    def several_lines(*args, **kwargs):
        from capsnet.errors import DatasetError

        raise DatasetError("first line\n  second line")

    monkeypatch.setattr(evaluate_module, "evaluate_checkpoint", several_lines)
    assert main(["evaluate", "--checkpoint", str(files["good"])]) == 2
    assert capsys.readouterr().err == "capsnet evaluate: error: first line second line\n"


def test_a_reader_that_goes_ends_the_command_quietly_and_another_broken_pipe_is_one_line(monkeypatch, capsys, files):
    """`capsnet models | head -1`: stdout's reader gone is status 141 (128 + SIGPIPE) and nothing on stderr; a
    broken pipe of the command's own (an upload's socket) while stdout is fine is an error line."""
    reader, writer = os.pipe()
    os.close(reader)  # the reader has gone before the first line
    code = "import sys; from capsnet.cli import main; sys.exit(main(['models', '--json']))"
    done = subprocess.run([sys.executable, "-c", code], stdout=writer, stderr=subprocess.PIPE, text=True, timeout=300)
    os.close(writer)
    assert (done.returncode, done.stderr) == (141, "")

    from capsnet import inference as evaluate_module

    def socket_gone(*args, **kwargs):
        raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(evaluate_module, "evaluate_checkpoint", socket_gone)
    assert main(["evaluate", "--checkpoint", str(files["good"])]) == 2
    assert capsys.readouterr().err == "capsnet evaluate: error: [Errno 32] Broken pipe\n"


def test_evaluate_on_auto_device_runs_where_there_is_no_gpu(files, capsys):
    """--device auto is the CPU here (the raw string used to reach .to())."""
    argv = ["evaluate", "--checkpoint", str(files["good"]), "--dataset", str(files["data"]), "--device", "auto"]
    assert main([*argv, "--json"]) == 0
    assert '"accuracy"' in capsys.readouterr().out
