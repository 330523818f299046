"""Execute examples/mnist.ipynb end to end with tiny settings."""

import json
import os
import re
from pathlib import Path

import pytest

import capsnet
from capsnet import CapsNet
from capsnet.inference import evaluate_checkpoint
from capsnet.models.baseline import count_parameters
from capsnet.training.checkpoint import read_summary

pytestmark = pytest.mark.tooling  # the project's tooling: `make test-tooling` and CI run it

NOTEBOOK = Path(__file__).resolve().parents[1] / "examples" / "mnist.ipynb"
# Replaces the values of the notebook's "parameters" cell: a few seconds of training.
TINY = """\
EPOCHS = 1
TRAIN_SUBSET = 64
TEST_SUBSET = 50
BATCH_SIZE = 16
SEED = 0
OUT = "runs/nb"
FIGURES = "figures"
"""
FIGURES = ("reconstructions", "perturbation", "routing", "curves", "confusion")


@pytest.mark.slow
def test_mnist_notebook_runs(tmp_path, monkeypatch):
    # nbclient, nbformat, ipykernel and matplotlib come with the dev extra that `make test` installs.
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(NOTEBOOK, as_version=4)
    params = [k for k, cell in enumerate(nb.cells) if "parameters" in cell.metadata.get("tags", [])]
    assert len(params) == 1, "the notebook needs exactly one cell tagged 'parameters'"
    injected = nbformat.v4.new_code_cell(TINY)
    injected.metadata["tags"] = ["injected-parameters"]
    nb.cells.insert(params[0] + 1, injected)

    # The kernel is a fresh process: let it import this checkout's capsnet, on at most 2 threads.
    src = str(Path(capsnet.__file__).resolve().parents[1])
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH")) if p))
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    work = tmp_path / "work"
    work.mkdir()
    client = NotebookClient(
        nb, timeout=600, kernel_name=_kernel_name(tmp_path, monkeypatch), resources={"metadata": {"path": str(work)}}
    )
    client.execute()  # raises CellExecutionError, with the cell and traceback, if any cell fails

    # What it produced: the run folder, the five figures as PNG files, each shown inline after the sample digits
    run = work / "runs" / "nb"
    rows = read_summary(run)
    assert [r["epoch"] for r in rows] == [1]
    for name in FIGURES:
        png = (work / "figures" / f"{name}.png").read_bytes()
        assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 2000, name
    images = [
        out
        for cell in nb.cells
        if cell.cell_type == "code"
        for out in cell.get("outputs", [])
        if "image/png" in out.get("data", {})
    ]
    assert len(images) == 1 + len(FIGURES)  # the sample digits, then each figure displayed inline
    text = "".join(out.get("text", "") for cell in nb.cells for out in cell.get("outputs", []))
    # the model's parameter count, the data, the run's best accuracy and the evaluation of its best checkpoint
    assert f"total: {count_parameters(CapsNet()):,} parameters" in " ".join(text.split())
    assert "mnist-sample: 6,000 training and 2,000 test images" in text
    best = re.search(r"best/ is epoch (\d+), chosen on validation loss [\d.]+ \(validation accuracy ([\d.]+)%\); "
                     r"its test accuracy: ([\d.]+)%", text)  # fmt: skip
    lowest = min(rows, key=lambda r: (r["val_loss"], r["epoch"]))
    assert best and int(best.group(1)) == lowest["epoch"]
    assert float(best.group(2)) == pytest.approx(100 * lowest["val_acc"], abs=0.006)
    tested = json.loads((run / "test.json").read_text())["best"]
    assert float(best.group(3)) == pytest.approx(100 * tested["accuracy"], abs=0.006)
    metrics = evaluate_checkpoint(run, dataset="mnist-sample", split="test")
    printed = re.search(r"accuracy ([\d.]+)% on ([\d,]+) test images", text)
    assert printed and printed.group(2) == f"{metrics['n']:,}" == "2,000"
    assert float(printed.group(1)) == pytest.approx(100 * metrics["accuracy"], abs=0.006)


def _kernel_name(tmp_path: Path, monkeypatch) -> str:
    """`python3`: jupyter_client finds ipykernel's own spec for this interpreter; failing that, a spec is
    installed into a temporary prefix that JUPYTER_PATH points at."""
    from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel

    try:
        KernelSpecManager().get_kernel_spec("python3")
    except NoSuchKernel:
        from ipykernel.kernelspec import install

        install(kernel_name="python3", prefix=str(tmp_path / "jupyter"))
        monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter" / "share" / "jupyter"))
    return "python3"
