"""Small things a new user meets first: the unknown-flag hint names the subcommand's help, no help text states its
default twice, and the progress bar stays out of a captured (non-terminal) stderr."""

import argparse
import io
import sys

import pytest

from capsnet.cli import build_parser, main


@pytest.mark.parametrize(
    ("argv", "hint"),
    [
        (["train", "--no-such-flag"], "(see capsnet train --help)"),
        (["data", "info", "mnist-sample", "--no-such-flag"], "(see capsnet data info --help)"),
        (["models", "--no-such-flag", "1"], "(see capsnet models --help)"),
        (["--no-such-flag"], "(see capsnet --help)"),
    ],
)
def test_an_unknown_flag_points_to_the_help_of_its_subcommand(argv, hint, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1
    assert "unrecognized arguments: --no-such-flag" in err or "required" in err
    assert err.rstrip().endswith(hint)


def _helps(parser: argparse.ArgumentParser):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _helps(sub)
        elif action.help:
            yield parser.prog, action.option_strings, action.help


def test_no_help_text_gives_its_default_twice():
    helps = list(_helps(build_parser()))
    assert len(helps) > 100  # every subcommand's flags were read
    for prog, flags, text in helps:
        for part in text.split("; "):  # one part per model for a flag several models share
            assert part.count("(default") <= 1, (prog, flags, text)
    image_channels = [t for p, f, t in helps if "--image-channels" in f]
    assert image_channels == ["image folders: 1 (greyscale) or 3 (RGB) (default: the most common mode)"]


def test_the_progress_bar_is_off_when_stderr_is_not_a_terminal(monkeypatch, tmp_path):
    from capsnet.training.callbacks import RunLog
    from capsnet.training.config import FitConfig

    captured = io.StringIO()  # not a TTY, as a log file or a pipe
    monkeypatch.setattr(sys, "stderr", captured)
    logger = RunLog(tmp_path, FitConfig(epochs=2, out=str(tmp_path), tensorboard=False), enabled=True)
    bar = logger.bar(0, 100, 0)
    for _ in range(100):
        bar.update(1)
    bar.close()
    assert bar.disable and captured.getvalue() == ""
