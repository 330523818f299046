import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import SMALL_FLAGS, small_config
from safetensors.torch import load_file

from capsnet import CapsNet, load_pretrained
from capsnet.data import Split, load_dataset
from capsnet.training.checkpoint import load_state, read_summary
from capsnet.training.evaluator import evaluate
from capsnet.training.loop import STOP_CHECK_EVERY
from capsnet.training.state import EpochSums

N_TEST = 101  # odd: the two ranks' shares (51 and 50 images) differ, so a figure from one rank alone shows


def _env() -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": str(Path(__file__).parents[1] / "src"),
        "OMP_NUM_THREADS": "1",
        "PYTHONFAULTHANDLER": "1",
    }  # a crash prints every thread's Python stack


@pytest.mark.slow
def test_torchrun_two_cpu_processes(tmp_path):
    out = tmp_path / "run"
    env = _env()
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        "-m",
        "capsnet",
        "train",
        "--out",
        str(out),
        "--epochs",
        "2",
        "--train-subset",
        "128",
        "--test-subset",
        str(N_TEST),
        "--batch-size",
        "16",
        "--device",
        "cpu",
        "--no-progress",
        "--no-tensorboard",
        *SMALL_FLAGS,
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, f"stdout:\n{r.stdout[-2000:]}\nstderr:\n{r.stderr[-6000:]}"
    # only rank 0 prints and writes: one summary line per epoch, one closing line
    assert r.stdout.count("epoch 1/2") == 1 and r.stdout.count("epoch 2/2") == 1
    assert r.stdout.count("done: best/ is epoch") == 1 and r.stdout.count("test accuracy: best/") == 1
    rows = read_summary(out)
    assert [row["epoch"] for row in rows] == [1, 2]
    # Metrics were reduced over both ranks. With 101 test images rank 0 scores 51 of them and rank 1 50, so a
    # figure from one rank alone (k/51 or k/50) is never k/101 unless it is 0 or 1, and its loss differs too.
    tested = json.loads((out / "test.json").read_text())["last"]
    acc = tested["accuracy"]
    assert 0 < acc < 1 and abs(acc * N_TEST - round(acc * N_TEST)) < 1e-9 and tested["n"] == N_TEST
    model = load_pretrained(out / "last")
    test = load_dataset("mnist-sample").test
    whole = Split(test.images[:N_TEST], test.labels[:N_TEST])
    single = evaluate(model, whole)  # one process, all 101 images
    assert single["n"] == N_TEST
    assert acc == pytest.approx(single["accuracy"], abs=1e-5)
    assert tested["loss"] == pytest.approx(single["loss"], rel=1e-4)
    for rank in (0, 1):  # each rank's share alone gives other figures
        share = evaluate(model, Split(whole.images[rank::2], whole.labels[rank::2]))
        assert share["n"] == (51, 50)[rank]
        assert share["accuracy"] != pytest.approx(acc, abs=1e-5)
        assert share["loss"] != pytest.approx(single["loss"], rel=1e-4)


EVAL_SCRIPT = """
import json, sys, torch
from capsnet import load_pretrained
from capsnet.data import Split, load_dataset
from capsnet.training import distributed
from capsnet.training.evaluator import evaluate

info = distributed.setup(torch.device("cpu"))
test = load_dataset("mnist-sample").test
n = int(sys.argv[2])
r = evaluate(load_pretrained(sys.argv[1]), Split(test.images[:n], test.labels[:n]), batch_size=16, dist=info)
result = {"rank": info.rank, "world": info.world_size, "n": r["n"], "accuracy": r["accuracy"]}
# One file per rank: the ranks share stdout, where their lines can interleave.
with open(f"{sys.argv[3]}/rank{info.rank}.json", "w") as f:
    json.dump(result, f)
distributed.teardown(info)
"""


@pytest.mark.slow
def test_evaluate_under_torchrun_counts_every_image_once(tmp_path):
    model = CapsNet(config=small_config())
    model.save_pretrained(tmp_path / "model")
    script = tmp_path / "eval.py"
    script.write_text(EVAL_SCRIPT)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        str(script),
        str(tmp_path / "model"),
        str(N_TEST),
        str(tmp_path),
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=600)
    assert r.returncode == 0, f"stdout:\n{r.stdout[-2000:]}\nstderr:\n{r.stderr[-6000:]}"
    results = [json.loads((tmp_path / f"rank{k}.json").read_text()) for k in range(2)]
    assert [(d["rank"], d["world"]) for d in results] == [(0, 2), (1, 2)]
    test = load_dataset("mnist-sample").test
    single = evaluate(CapsNet.from_pretrained(tmp_path / "model"), Split(test.images[:N_TEST], test.labels[:N_TEST]))
    for d in results:  # the reduced count is the total, on every rank, and so is the accuracy
        assert d["n"] == N_TEST
        assert d["accuracy"] == pytest.approx(single["accuracy"], abs=1e-9)


EM_SCRIPT = """
import sys, torch
from capsnet.cli import build_parser
from capsnet.cli.train import configs_from_args
from capsnet.training.api import train
from capsnet.training.classification import ClassificationTask

class Keeping(ClassificationTask):
    def evaluate(self, model, **kw):
        self.model = model
        return super().evaluate(model, **kw)

out, flags = sys.argv[1], sys.argv[2:]
config, model_config = configs_from_args(build_parser().parse_args(["train", "--out", out, *flags]))
task = Keeping.from_config(config)
train(config, model_config, task=task)
rank = int(__import__("os").environ["RANK"])
torch.save({k: v.clone() for k, v in task.model.state_dict().items()}, f"{out}/rank{rank}.pt")
"""


@pytest.mark.slow
def test_torchrun_em_capsnet_ranks_hold_the_same_weights(tmp_path):
    """EMCapsNet centres beta_a on data before its first step: under torchrun both ranks must do it alike (before DDP
    wraps the model, which never broadcasts the parameters again), else they train apart for the whole run."""
    script = tmp_path / "em.py"
    script.write_text(EM_SCRIPT)
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script), str(out),
           "--model", "em-capsnet", "--conv-channels", "8", "--primary-types", "4", "--caps1-types", "4",
           "--caps2-types", "4", "--epochs", "1", "--train-subset", "64", "--test-subset", "16", "--batch-size", "8",
           "--device", "cpu", "--no-progress", "--no-tensorboard"]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=600)
    assert r.returncode == 0, f"stdout:\n{r.stdout[-2000:]}\nstderr:\n{r.stderr[-6000:]}"
    a, b = (torch.load(out / f"rank{k}.pt", weights_only=True) for k in (0, 1))
    assert a.keys() == b.keys() and any(k.endswith("beta_a_ready") for k in a)
    for key in a:
        assert torch.equal(a[key], b[key]), key
    assert bool(a["caps1.beta_a_ready"]) and a["caps1.beta_a"].abs().sum() > 0  # centred, then trained
    assert int(a["train_steps"]) == 4  # 64 images, 2 ranks, batch 8: 4 steps each


RESUME_SCRIPT = """
import json, os, sys
from capsnet import CapsNetConfig
from capsnet.training import api, distributed, loop
from capsnet.training.config import TrainConfig

out, record, stop_at = sys.argv[1], sys.argv[2], int(sys.argv[3])
rank = int(os.environ["RANK"])
closed = []
evaluate_epoch = loop.evaluate_epoch

def recording(run, state):  # the epoch's [loss sum, correct, count] over both ranks, as the loop closes it
    closed.append(distributed.all_sum(state.sums.to_list(), run.dist, run.device)[:3])
    return evaluate_epoch(run, state)

loop.evaluate_epoch = recording
on_step = (lambda step: rank == 1 and step == stop_at) if stop_at else None  # rank 1 alone asks to stop
if os.path.exists(os.path.join(out, "state.pt")):
    result = api.resume(out, on_step=on_step)
else:
    model = CapsNetConfig(conv_channels=8, primary_types=2, primary_dim=4, class_dim=4, decoder_hidden=(16, 16))
    config = TrainConfig(out=out, epochs=1, train_subset=int(sys.argv[4]), test_subset=8, val_fraction=0.0,
                         batch_size=2, device="cpu", progress=False, tensorboard=False)
    result = api.train(config, model, on_step=on_step)
with open(os.path.join(record, f"rank{rank}.json"), "w") as f:
    json.dump({"closed": closed, "interrupted": result.interrupted}, f)
"""


@pytest.mark.slow
def test_torchrun_resumes_a_mid_epoch_stop_with_the_epochs_running_sums(tmp_path):
    """Two processes stopped mid-epoch and resumed by two processes close the epoch with the uninterrupted run's
    sums: the mid-epoch state.pt holds both ranks' sums, restored once (on rank 0), not once per rank."""
    script = tmp_path / "resume.py"
    script.write_text(RESUME_SCRIPT)
    n_images, batch, steps = 90, 2, STOP_CHECK_EVERY  # 23 steps an epoch on each rank; the stop agreed at step 16
    env = {**_env(), "CAPSNET_NO_EXT": "1"}  # (the routing kernel's compilation is no part of this test)

    def launch(out: str, stop_at: int) -> list[dict]:
        record = tmp_path / f"record-{len(list(tmp_path.glob('record-*')))}"
        record.mkdir()
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script),
               str(tmp_path / out), str(record), str(stop_at), str(n_images)]  # fmt: skip
        r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
        assert r.returncode == 0, f"stdout:\n{r.stdout[-2000:]}\nstderr:\n{r.stderr[-6000:]}"
        return [json.loads((record / f"rank{k}.json").read_text()) for k in range(2)]

    whole = launch("whole", 0)
    assert [d["interrupted"] for d in whole] == [False, False]
    (loss, correct, count), = whole[0]["closed"]  # fmt: skip
    assert count == n_images
    stopped = launch("parts", 3)
    assert [d["interrupted"] for d in stopped] == [True, True] and stopped[0]["closed"] == []
    saved = load_state(tmp_path / "parts")
    assert (saved["epoch"], saved["batch_in_epoch"], saved["running_ranks"]) == (0, steps, 2)
    assert saved["running"][2] == steps * batch * 2 and saved["history"] == []  # both ranks' images so far
    resumed = launch("parts", 0)
    assert [d["interrupted"] for d in resumed] == [False, False]
    for d in resumed:  # every rank closed the epoch with the uninterrupted run's sums
        (r_loss, r_correct, r_count), = d["closed"]  # fmt: skip
        assert (r_count, r_correct) == (count, correct) and r_loss == pytest.approx(loss, rel=1e-9)
    rows = [load_state(tmp_path / run)["history"] for run in ("whole", "parts")]
    assert [len(h) for h in rows] == [1, 1]
    for key in ("train_loss", "train_acc", "test_loss", "test_acc"):
        assert rows[1][0][key] == pytest.approx(rows[0][0][key], rel=1e-9), key
    weights = [load_file(str(tmp_path / run / "last" / "model.safetensors")) for run in ("whole", "parts")]
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])  # the same 23 steps
    summaries = [read_summary(tmp_path / run)[0] for run in ("whole", "parts")]
    assert summaries[1]["train_loss"] == summaries[0]["train_loss"]
    assert summaries[1]["train_acc"] == summaries[0]["train_acc"]


def test_a_mid_epoch_state_restores_its_running_sums_once():
    """A state.pt with "running_ranks" holds the sums over every rank: rank 0 restores them, the others start from
    zero. One without (written when state.pt held rank 0's own sums) restores them on every rank, as it did."""
    running = [12.5, 7.0, 32.0, 3.25]
    cpu = torch.device("cpu")
    for saved, on_rank1 in [({"running": running, "running_ranks": 2}, [0.0] * 4),
                            ({"running": running}, running)]:  # fmt: skip
        assert EpochSums.restored(saved, is_main=True, device=cpu).to_list() == running
        assert EpochSums.restored(saved, is_main=False, device=cpu).to_list() == on_rank1
