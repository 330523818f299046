import os
import subprocess
import sys
from pathlib import Path

from helpers import SMALL_FLAGS

from capsnet import load_pretrained
from capsnet.data import Split, load_dataset
from capsnet.training.checkpoint import read_summary
from capsnet.training.evaluate import evaluate


def test_torchrun_two_cpu_processes(tmp_path):
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1] / "src"), "OMP_NUM_THREADS": "1",
           "PYTHONFAULTHANDLER": "1"}  # a crash prints every thread's Python stack
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "-m", "capsnet", "train", "--out", str(out), "--epochs", "2", "--train-subset", "128",
           "--test-subset", "100", "--batch-size", "16", "--device", "cpu", "--no-progress", "--no-tensorboard",
           *SMALL_FLAGS]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, f"stdout:\n{r.stdout[-2000:]}\nstderr:\n{r.stderr[-6000:]}"
    # only rank 0 prints and writes: one summary line per epoch, one closing line
    assert r.stdout.count("epoch 1/2") == 1 and r.stdout.count("epoch 2/2") == 1
    assert r.stdout.count("done: best test accuracy") == 1
    rows = read_summary(out)
    assert [row["epoch"] for row in rows] == [1, 2]
    # metrics were reduced over both ranks: accuracy on all 100 test images is a multiple of 1/100
    assert abs(rows[-1]["test_acc"] * 100 - round(rows[-1]["test_acc"] * 100)) < 1e-6
    # the two ranks' shards, summed, give what one process measures on the same 100 images
    model = load_pretrained(out / "last")
    test = load_dataset("mnist-sample").test
    single = evaluate(model, Split(test.images[:100], test.labels[:100]))
    assert single["n"] == 100
    assert rows[-1]["test_acc"] == single["accuracy"]
