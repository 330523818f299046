"""The wheel that `python -m build` makes: data files, the C++ source, every subpackage, and nothing else."""

import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from helpers import small_config
from test_api import CARD

import capsnet
from capsnet import CapsNet
from capsnet.models.hub import CARD_NAME, WEIGHTS_ROOT, save_shipped

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "capsnet"
TEST_TAG = "packaging-test"
# Size budget: the code and the bundled digits stay under CODE_BUDGET; the weights shipped in the package under
# WEIGHTS_BUDGET in all, so that the wheel stays under 50 MiB (half PyPI's default limit of 100 MB per file): a
# pip install of capsnet, weights included, is a small download.
CODE_BUDGET = 5 * 2**20
WEIGHTS_BUDGET = 45 * 2**20


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """Build the wheel from a copy of the checkout (so no build/ folder lands in it), without build isolation:
    the build backend comes from the environment, so nothing is downloaded."""
    tmp = tmp_path_factory.mktemp("wheel")
    project = tmp / "project"
    project.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, project / name)
    shutil.copytree(ROOT / "src", project / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info", "*.so"))
    # A tiny model's shipped-weights folder, written into the copy only: the wheel must carry such folders.
    save_shipped(CapsNet(config=small_config()), name="capsnet", tag=TEST_TAG, card=CARD,
                 root=project / "src" / "capsnet" / "models" / "weights")  # fmt: skip
    cmd = [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(tmp / "dist"), str(project)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (path,) = (tmp / "dist").glob("capsnet-*.whl")
    return path


@pytest.mark.slow
@pytest.mark.tooling
def test_wheel_holds_the_package_data_and_no_tests(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    for split in ("train", "t10k"):
        for kind in ("images-idx3", "labels-idx1"):
            assert f"capsnet/data/files/mnist-sample/{split}-{kind}-ubyte.gz" in names
    assert "capsnet/data/files/NOTICE" in names
    csrc = PACKAGE / "routing" / "csrc"  # the C++ kernels are compiled at first use: each needs its headers
    sources = {f"capsnet/routing/csrc/{p.name}" for p in csrc.iterdir()}
    assert {"capsnet/routing/csrc/routing_cpu.cpp", "capsnet/routing/csrc/routing_common.h"} <= sources <= names
    for source in csrc.glob("*.cpp"):
        for header in re.findall(r'^#include "(.+)"', source.read_text(), flags=re.MULTILINE):
            assert f"capsnet/routing/csrc/{header}" in names, (source.name, header)
    subpackages = sorted(p.parent.relative_to(PACKAGE.parent).as_posix() for p in PACKAGE.rglob("__init__.py"))
    assert len(subpackages) >= 9  # capsnet and its subpackages nn, routing, models, data, training, ...
    for package in subpackages:
        assert f"{package}/__init__.py" in names, package
        modules = {p.relative_to(PACKAGE.parent).as_posix() for p in (PACKAGE.parent / package).glob("*.py")}
        assert modules <= names, modules - names
    assert any(n.endswith("entry_points.txt") for n in names)
    assert wheel.name == f"capsnet-{capsnet.__version__}-py3-none-any.whl"  # pyproject.toml and _version.py agree
    top = {n.split("/")[0] for n in names}
    assert top == {"capsnet", wheel.name.removesuffix("-py3-none-any.whl") + ".dist-info"}
    assert not [n for n in names if n.endswith((".ipynb", ".pyc", ".so")) or "tests/" in n or "test_" in n]


@pytest.mark.slow
@pytest.mark.tooling
def test_wheel_reads_its_bundled_digits(wheel, tmp_path):
    """The unpacked wheel alone (no checkout on the path) loads the bundled sample and shipped weights by their tag,
    and parses the CLI."""
    zipfile.ZipFile(wheel).extractall(tmp_path / "site")
    code = (
        "import capsnet, capsnet.cli; from capsnet.data import load_dataset; d = load_dataset('mnist-sample'); "
        f"m = capsnet.create_model('capsnet', pretrained='{TEST_TAG}'); "
        "print(capsnet.__file__, len(d.train), len(d.test), m.config.conv_channels)"
    )
    r = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env={"PYTHONPATH": str(tmp_path / "site"), "PATH": ""},
    )
    assert r.returncode == 0, r.stderr[-3000:]
    where, n_train, n_test, conv_channels = r.stdout.split()
    assert Path(where).is_relative_to(tmp_path / "site") and (n_train, n_test) == ("6000", "2000")
    assert conv_channels == str(small_config().conv_channels)  # the shipped folder, read from the wheel


@pytest.mark.slow
@pytest.mark.tooling
def test_wheel_holds_the_shipped_weights_and_stays_small(wheel):
    infos = zipfile.ZipFile(wheel).infolist()
    names = {i.filename for i in infos}
    folder = f"capsnet/models/weights/capsnet/{TEST_TAG}"
    assert {f"{folder}/config.json", f"{folder}/model.safetensors", f"{folder}/{CARD_NAME}"} <= names
    weights = [i for i in infos if i.filename.startswith("capsnet/models/weights/")]
    shipped = {f"capsnet/models/weights/{p.relative_to(WEIGHTS_ROOT).as_posix()}" for p in WEIGHTS_ROOT.rglob("*")
               if p.is_file() and p.name in ("config.json", "model.safetensors", CARD_NAME)}  # fmt: skip
    assert {i.filename for i in weights} - {f"{folder}/{n}" for n in ("config.json", "model.safetensors", CARD_NAME)} \
        == shipped  # every file of the package's own shipped folders, and nothing else there  # fmt: skip
    weights_size = sum(i.file_size for i in weights if not i.filename.startswith(folder))
    code_size = sum(i.compress_size for i in infos if not i.filename.startswith("capsnet/models/weights/"))
    assert code_size < CODE_BUDGET, f"code and data: {code_size / 2**20:.1f} MiB compressed"
    assert weights_size < WEIGHTS_BUDGET, f"shipped weights: {weights_size / 2**20:.1f} MiB"
    assert wheel.stat().st_size < CODE_BUDGET + WEIGHTS_BUDGET


# -------------------------------------------------------------------------------------------- the torch range
def test_pyproject_declares_the_torch_that_the_import_check_asks_for():
    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    (low,) = re.findall(r'"torch>=([0-9.]+),<3"', text)
    assert tuple(int(v) for v in low.split(".")) == capsnet._version.TORCH_MIN == (2, 4)
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert f"any torch >= {low} " in readme and "torch >= 2.1" not in readme


@pytest.mark.parametrize("version", ["2.3.1", "2.3.1+cu121", "2.1.0", "1.13.1"])
def test_an_older_torch_is_refused_in_one_line(version):
    with pytest.raises(ImportError, match=rf"^capsnet needs torch >= 2\.4, found torch {re.escape(version)};"):
        capsnet._version.check_torch(version)


@pytest.mark.parametrize("version", ["2.4.0", "2.4.0a0+git1234", "2.13.0+cpu", "3.0.0"])
def test_torch_2_4_and_newer_pass(version):
    capsnet._version.check_torch(version)


def test_import_capsnet_on_an_older_torch_says_which_version_it_needs():
    """`import capsnet` with torch.__version__ set to 2.3.1 before: one ImportError line, before any module that
    uses 2.4's APIs is imported."""
    code = "import torch; torch.__version__ = '2.3.1'\ntry:\n    import capsnet\nexcept ImportError as e:\n    print(e)"
    code += "\nimport sys; print('capsnet.routing' in sys.modules)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == ["capsnet needs torch >= 2.4, found torch 2.3.1; pip install 'torch>=2.4'", "False"]
