"""A plugin distribution, installed from a temporary folder, used from the command line: docs/plugins.md's plugin
(its module and pyproject.toml, copied from the page) is `pip install`ed into a folder on PYTHONPATH; its routing
and its model appear in `capsnet models`, train for one epoch, evaluate, are compared beside a built-in routing, and
reload from their run folders; where the plugin is not installed (the test's own interpreter), each reload is one
line that names it."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import SMALL_FLAGS

from capsnet.cli import main
from capsnet.results import read_rows

ROOT = Path(__file__).resolve().parents[1]
QUICK = ["--epochs", "1", "--train-subset", "48", "--test-subset", "24", "--batch-size", "16", "--device", "cpu",
         "--no-progress", "--no-tensorboard"]  # fmt: skip


def install_docs_plugin(tmp_path: Path) -> Path:
    """docs/plugins.md's capsnet_toy.py and pyproject.toml in a folder, pip-installed (no index, no build isolation:
    offline) into another folder, which is returned."""
    pytest.importorskip("setuptools")
    page = (ROOT / "docs" / "plugins.md").read_text(encoding="utf-8")
    source = tmp_path / "capsnet-toy"
    source.mkdir()
    for name, text in re.findall(r"```(?:python|toml)\n# (capsnet_toy\.py|pyproject\.toml)\n(.*?)```", page, re.S):
        (source / name).write_text(text, encoding="utf-8")
    assert sorted(p.name for p in source.iterdir()) == ["capsnet_toy.py", "pyproject.toml"]
    site = tmp_path / "site"
    pip = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index", "--no-build-isolation",
           "--target", str(site), str(source)]  # fmt: skip
    done = subprocess.run(pip, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return site


def capsnet(*argv: str, site: Path | None) -> subprocess.CompletedProcess[str]:
    """`capsnet ARGV` in a fresh interpreter, with the plugin's folder on its path (none: not installed)."""
    paths = [str(ROOT / "src"), *([str(site)] if site is not None else [])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths), "CAPSNET_NO_EXT": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "capsnet", *argv], capture_output=True, text=True, env=env,
                          timeout=900)  # fmt: skip


@pytest.mark.slow
def test_an_installed_plugin_trains_evaluates_compares_and_reloads(tmp_path, capsys):
    site = install_docs_plugin(tmp_path)
    listed = capsnet("models", site=site)
    assert listed.returncode == 0, listed.stderr
    assert re.search(r"^tiny-net .*\(plugin: capsnet-toy 0\.1\.0\)$", listed.stdout, re.M)
    assert re.search(r"^uniform .* plugin: capsnet-toy 0\.1\.0$", listed.stdout, re.M)

    runs = {"uniform": ["--routing", "uniform", *SMALL_FLAGS], "tiny-net": ["--model", "tiny-net", "--hidden", "16"]}
    for name, flags in runs.items():
        trained = capsnet("train", *flags, "--out", str(tmp_path / name), *QUICK, site=site)
        assert trained.returncode == 0, trained.stderr[-3000:]
        scored = json.loads((tmp_path / name / "test.json").read_text(encoding="utf-8"))
        evaluated = capsnet("evaluate", "--checkpoint", str(tmp_path / name), "--json", site=site)
        assert evaluated.returncode == 0, evaluated.stderr[-3000:]
        assert json.loads(evaluated.stdout)["accuracy"] == scored["best"]["accuracy"]  # best/, reloaded, scored again
        config = json.loads((tmp_path / name / "best" / "config.json").read_text(encoding="utf-8"))
        assert config["plugins"] == ["capsnet-toy 0.1.0"]

        capsys.readouterr()  # here, in the test's own interpreter, the plugin is not installed
        assert main(["evaluate", "--checkpoint", str(tmp_path / name)]) == 2
        missing = capsys.readouterr()
        assert missing.out == "" and missing.err.count("\n") == 1 and f"'{name}'" in missing.err
        assert "capsnet-toy 0.1.0" in missing.err

    options = [f"--option={o}" for o in ("conv_channels=16", "primary_types=4", "primary_dim=4", "class_dim=6",
                                         "decoder_hidden=[32,64]", "hidden=16")]  # fmt: skip
    compared = capsnet("compare", "--routings", "uniform,dynamic", "--models", "tiny-net", *QUICK[:-2], *options,
                       "--out", str(tmp_path / "compare"), "--infer-batch", "8", "--infer-seconds", "0.05",
                       site=site)  # fmt: skip
    assert compared.returncode == 0, compared.stderr[-3000:]
    rows = {row.config.split(" --")[0]: row for row in read_rows(tmp_path / "compare" / "results.csv")}
    assert set(rows) == {"--routing uniform", "--routing dynamic", "--hidden 16"}
    assert rows["--hidden 16"].model == "tiny-net" and rows["--hidden 16"].routing_spread is None
    assert rows["--routing uniform"].routing_spread == pytest.approx(0.0, abs=1e-4)  # its couplings are uniform
    assert rows["--hidden 16"].params == 28 * 28 * 16 + 16 + 16 * 10 + 10
    for row in rows.values():
        folder = {"capsnet": f"routing-{row.config.split()[1]}", "tiny-net": "model-tiny-net"}[row.model]
        scored = json.loads((tmp_path / "compare" / folder / "seed-0" / "test.json").read_text(encoding="utf-8"))
        assert row.test_acc_mean == pytest.approx(100 * scored["best"]["accuracy"], abs=1e-3)
        assert row.test_images == 24 and row.train_images + row.val_images == 48
