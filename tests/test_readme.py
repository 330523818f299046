"""Every command in the ```sh blocks of the README and of the pages in docs/ runs as written, checked without running
it; the README's Python quickstart runs (slow), and the pages it links to exist.

One line is one command. `capsnet ...`, `python -m capsnet ...` and `torchrun ... -m capsnet ...` must parse with
the real command-line parser (and `capsnet train` must resolve its configs: a flag the chosen model does not take
fails); `python benchmarks/X.py ...` must name a script whose own parser accepts those flags; `make X` must be a
Makefile target; `pip install` must name extras pyproject.toml defines and the version constraints.txt pins.
"""

import argparse
import ast
import importlib.util
import json
import re
import shlex
import sys
from pathlib import Path

import pytest

from capsnet.cli import build_parser
from capsnet.cli.train import configs_from_args
from capsnet.errors import ConfigError

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parents[1]


def readme_commands(text: str) -> list[str]:
    """The lines of the ```sh blocks, comments and blank lines dropped."""
    commands, in_sh = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            in_sh = line.strip() == "```sh" if not in_sh else False
        elif in_sh and shlex.split(line, comments=True):
            commands.append(line)
    return commands


class _Parsed(Exception):
    """Raised instead of running a benchmark once its parser has accepted the arguments."""


def _parse_capsnet(argv: list[str], capsys) -> None:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:
        assert e.code == 0, f"capsnet {shlex.join(argv)}: {capsys.readouterr().err.strip()}"
        return
    if args.command == "train":
        configs_from_args(args)  # TrainConfig checks, and model flags the chosen --model does not take


def _parse_benchmark(script: str, argv: list[str], monkeypatch, capsys) -> None:
    path = ROOT / script
    assert path.is_file() and path.parent.name == "benchmarks", f"{script}: no such benchmark script"
    spec = importlib.util.spec_from_file_location(f"readme_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # defines main(); runs nothing (__name__ is not "__main__")
    parse_args = argparse.ArgumentParser.parse_args

    def parse_only(self, args=None, namespace=None):
        raise _Parsed(parse_args(self, args, namespace))

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_only)
    monkeypatch.setattr(sys, "argv", [str(path), *argv])
    try:
        module.main()
    except _Parsed:
        return
    except SystemExit as e:
        assert e.code == 0, f"{script} {shlex.join(argv)}: {capsys.readouterr().err.strip()}"
        return
    finally:
        monkeypatch.undo()
    raise AssertionError(f"{script}: main() returned without parsing its arguments")


def _check_pip(argv: list[str]) -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    extras = set(pyproject["project"]["optional-dependencies"])
    version = pyproject["project"]["version"]
    lines = (ROOT / "constraints.txt").read_text().splitlines()
    pins = dict(line.split("==") for line in lines if "==" in line and not line.startswith("#"))
    assert argv[:1] == ["install"], f"pip {shlex.join(argv)}: only pip install is checked"
    for i, token in enumerate(argv[1:], 1):
        if argv[i - 1] == "-c":
            assert (ROOT / token).is_file(), f"pip -c {token}: no such file"
        elif m := re.fullmatch(r"(\.|capsnet)\[([\w,-]+)\]", token):
            unknown = set(m.group(2).split(",")) - extras
            assert not unknown, f"pip install {token}: no extra {', '.join(sorted(unknown))} in pyproject.toml"
        elif m := re.fullmatch(r"([\w-]+)==(\S+)", token):
            assert pins.get(m.group(1)) == m.group(2), f"{token}: constraints.txt pins {pins.get(m.group(1))}"
        elif token.startswith("dist/"):
            assert token == f"dist/capsnet-{version}-py3-none-any.whl", f"{token}: the wheel is capsnet-{version}"
        elif not token.startswith("-"):
            assert token in pins or token in extras, f"pip install {token}: not a pinned package"


def check_command(line: str, monkeypatch, capsys) -> None:
    """Fail with a message naming the command if `line` would not run as written."""
    argv = shlex.split(line, comments=True)
    assert not [t for t in argv if t.startswith("[") or "|" in t or t in ("&&", ";", "||")], (
        f"{line!r}: write one real command per line (no [optional] parts, alternatives or chains)"
    )
    program, *rest = argv
    if program == "capsnet":
        _parse_capsnet(rest, capsys)
    elif program == "make":
        targets = set(re.findall(r"^([\w.-]+):", (ROOT / "Makefile").read_text(), flags=re.M))
        assert rest and set(rest) <= targets, f"{line!r}: no make target {', '.join(sorted(set(rest) - targets))}"
    elif program == "torchrun":
        assert "-m" in rest and rest[rest.index("-m") + 1] == "capsnet", f"{line!r}: torchrun runs -m capsnet"
        _parse_capsnet(rest[rest.index("-m") + 2 :], capsys)
    elif program in ("python", "python3") and rest[:2] == ["-m", "capsnet"]:
        _parse_capsnet(rest[2:], capsys)
    elif program in ("python", "python3") and rest[:2] == ["-m", "build"]:
        pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
        assert any(d.startswith("build") for d in pyproject["project"]["optional-dependencies"]["dev"])
    elif program in ("python", "python3") and rest and rest[0].endswith(".py"):
        _parse_benchmark(rest[0], rest[1:], monkeypatch, capsys)
    elif program == "pip":
        _check_pip(rest)
    else:
        raise AssertionError(f"{line!r}: {program} is not a command this test knows how to check; add a rule")


README = (ROOT / "README.md").read_text(encoding="utf-8")
# The topic pages (the records of measurements, benchmarks/fidelity/results, quote their commands as they were run).
RECORDS = {"benchmarks.md", "fidelity.md", "results.md"}
PAGES = {p.name: p.read_text(encoding="utf-8") for p in sorted((ROOT / "docs").glob("*.md")) if p.name not in RECORDS}
ALL_COMMANDS = [
    (name, line) for name, text in [("README.md", README), *PAGES.items()] for line in readme_commands(text)
]


COMMAND_IDS = [f"{page}: {line.split('#')[0].strip()[:60]}" for page, line in ALL_COMMANDS]


@pytest.mark.parametrize(("page", "line"), ALL_COMMANDS, ids=COMMAND_IDS)
def test_readme_command_runs_as_written(page, line, monkeypatch, capsys):
    check_command(line, monkeypatch, capsys)


def test_the_readme_is_a_front_page_and_its_links_resolve():
    assert len(README.splitlines()) <= 200
    assert README.index("pip install") < README.index("```python") < README.index("## The models")
    for target in re.findall(r"\]\((docs/[\w.-]+\.md)", README):
        assert (ROOT / target).is_file(), f"README links to {target}, which does not exist"
    assert {"training.md", "data.md", "models.md", "export.md", "cli.md"} <= set(PAGES)
    import capsnet

    for name in re.findall(r"capsnet\.(\w+)\(", README):  # every capsnet.X( the README calls exists
        assert name in capsnet.__all__, name


@pytest.mark.slow
def test_the_python_quickstart_runs(tmp_path):
    import os
    import subprocess

    code = re.search(r"```python\n(.*?)```", README, flags=re.S).group(1)
    env = {**os.environ, "CAPSNET_NO_EXT": "1"}  # (the kernel build is not what this checks)
    for _ in range(2):  # twice in a row: the second run starts afresh in the same folders
        done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                              timeout=600, env=env)  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "runs" / "mine" / "best" / "model.safetensors").is_file()
    lines = done.stdout.splitlines()
    # the bundled digits: the printed classes are their labels, as the README's comment shows
    shown = re.search(r"^# (predicted .*)$", code, flags=re.M).group(1)
    (printed,) = [line for line in lines if line.startswith("predicted ")]
    assert printed == shown
    names, truth = re.fullmatch(r"predicted (\[.*\]) true (\[.*\])", printed).groups()
    assert names == truth and len(ast.literal_eval(names)) == 5
    # after fit: three class indices of the model's five classes
    (after,) = [line for line in lines if line.startswith("after fit ")]
    classes = json.loads(after.removeprefix("after fit "))
    assert len(classes) == 3 and all(0 <= k < 5 for k in classes)


def test_readme_has_the_commands_it_documents():
    lines = [line for _, line in ALL_COMMANDS]
    assert any(line.startswith("capsnet train") for line in lines)
    assert any(line.startswith("make check") for line in lines)
    assert any(line.startswith("python benchmarks/accuracy.py") for line in lines)
    assert any(line.startswith("pip install -e") for line in lines)


@pytest.mark.parametrize(
    "line, needle",
    [
        ("capsnet train --no-such-flag", "unrecognized arguments"),
        ("capsnet train --model baseline --conv-channels 8", "not an option of --model baseline"),
        ("capsnet reproduce mnist|affnist", "one real command per line"),
        ("capsnet evaluate --checkpoint runs/x [--json]", "one real command per line"),
        ("python -m capsnet data frobnicate x", "invalid choice"),
        ("python benchmarks/accuracy.py --epochz 3", "unrecognized arguments"),
        ("python benchmarks/no_such_bench.py", "no such benchmark script"),
        ("make no-such-target", "no make target"),
        ("pip install -e '.[no-such-extra]'", "no extra"),
        ("pip install torch==1.0.0", "constraints.txt pins"),
        ("curl https://example.com", "add a rule"),
    ],
)
def test_a_command_that_would_not_run_fails_the_check(line, needle, monkeypatch, capsys):
    with pytest.raises((AssertionError, ConfigError)) as e:
        check_command(line, monkeypatch, capsys)
    assert needle in str(e.value)
