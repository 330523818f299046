"""Ctrl-C during training: the first saves a checkpoint at the next step; a second exits at once, with status 130,
even while a long evaluation runs."""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

# `capsnet train` with an evaluation that takes ten minutes (as a long evaluation, compile or kernel build would).
SCRIPT = """
import sys, time
from capsnet.cli import main
from capsnet.training.classification import ClassificationTask

def evaluate(self, model, **kwargs):
    print("evaluating", flush=True)
    time.sleep(600)

ClassificationTask.evaluate = evaluate
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_a_second_sigint_exits_at_once_with_status_130(tmp_path):
    script = tmp_path / "slow_eval.py"
    script.write_text(textwrap.dedent(SCRIPT))
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1] / "src"), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(script), "train", "--out", str(tmp_path / "run"), "--epochs", "3", "--train-subset",
           "32", "--test-subset", "16", "--batch-size", "16", "--device", "cpu", "--no-progress", "--no-tensorboard",
           "--model", "baseline", "--channels", "8", "8", "--hidden", "32", "16"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout is not None
        first = [proc.stdout.readline() for _ in range(2)]  # the run's note (its learning rate), then the evaluation
        assert first[-1] == "evaluating\n" and first[0].startswith("lr ")  # inside the long evaluation
        proc.send_signal(signal.SIGINT)
        time.sleep(1.0)
        assert proc.poll() is None  # the first Ctrl-C waits for the evaluation (then saves and stops)
        start = time.perf_counter()
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=30)
        waited = time.perf_counter() - start
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, stderr
    assert waited < 10, waited  # not the ten minutes of the evaluation
    assert "Traceback" not in stderr
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert lines[-2].startswith("interrupted: saving a checkpoint at the next step"), stderr
    assert lines[-1].startswith("interrupted again: exiting now"), stderr
