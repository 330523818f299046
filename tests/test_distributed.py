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
from capsnet.cli import main
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


# One launch of two gloo processes: each evaluates a saved model on its share (the reduced figures on every rank),
# then trains with --recon-weight 0 (the decoder gets no gradient and is skipped, which DDP needs), recording the
# targets of its batches and its model.
DDP_SCRIPT = """
import sys, torch
from capsnet import load_pretrained
from capsnet.cli import build_parser
from capsnet.cli.train import configs_from_args
from capsnet.data import Split, load_dataset
from capsnet.training import distributed
from capsnet.training.api import train
from capsnet.training.classification import ClassificationTask
from capsnet.training.evaluator import evaluate

class Recording(ClassificationTask):
    def batches(self, **kw):
        for batch in super().batches(**kw):
            self.seen = getattr(self, "seen", []) + [batch.targets.clone()]
            yield batch

    def evaluate(self, model, **kw):
        self.model = model
        return super().evaluate(model, **kw)

out, saved, n_test, flags = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4:]
info = distributed.setup(torch.device("cpu"))
test = load_dataset("mnist-sample").test
scored = evaluate(load_pretrained(saved), Split(test.images[:n_test], test.labels[:n_test]), batch_size=16, dist=info)
config, model_config = configs_from_args(build_parser().parse_args(["train", "--out", out, *flags]))
task = Recording.from_config(config)
result = train(config, model_config, task=task)
torch.save({"weights": task.model.state_dict(), "seen": torch.cat(task.seen), "world": info.world_size,
            "evaluated": [scored["n"], scored["accuracy"]], "is_main": result.is_main}, f"{out}/rank{info.rank}.pt")
"""


@pytest.mark.slow
def test_torchrun_synchronises_gradients_and_counts_every_test_image_once(tmp_path):
    """Two gloo processes, each on its own share of the data: after training both hold the same weights, bit for
    bit; only rank 0 prints and writes; the test figures are reduced over both ranks (101 test images: rank 0
    scores 51, rank 1 50), in training's report and in `evaluate(dist=...)` on every rank."""
    script = tmp_path / "ddp.py"
    script.write_text(DDP_SCRIPT)
    CapsNet(config=small_config()).save_pretrained(tmp_path / "saved")
    out = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        str(script),
        str(out),
        str(tmp_path / "saved"),
        str(N_TEST),
        "--epochs",
        "2",
        "--train-subset",
        "96",
        "--test-subset",
        str(N_TEST),
        "--batch-size",
        "16",
        "--device",
        "cpu",
        "--recon-weight",
        "0",
        "--no-progress",
        "--no-tensorboard",
        *SMALL_FLAGS,
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=600)
    assert r.returncode == 0, f"stdout:\n{r.stdout[-2000:]}\nstderr:\n{r.stderr[-6000:]}"
    # gradients synchronised: different images, the same weights
    a, b = (torch.load(out / f"rank{k}.pt", weights_only=True) for k in (0, 1))
    assert a["world"] == b["world"] == 2
    assert not torch.equal(a["seen"], b["seen"])  # the ranks trained on different images
    assert a["weights"].keys() == b["weights"].keys()
    for key in a["weights"]:
        assert torch.equal(a["weights"][key], b["weights"][key]), key
    assert small_config().recon_weight != 0  # (the flag, not the default, turned the reconstruction off)
    # only rank 0 prints and writes: one summary line per epoch, one closing line
    assert r.stdout.count("epoch 1/2") == 1 and r.stdout.count("epoch 2/2") == 1
    assert a["is_main"] and not b["is_main"]  # (`capsnet train` prints its closing line where is_main)
    assert [row["epoch"] for row in read_summary(out)] == [1, 2]
    # evaluation counted once: a figure from one rank alone (k/51 or k/50) is never k/101 unless it is 0 or 1
    test = load_dataset("mnist-sample").test
    whole = Split(test.images[:N_TEST], test.labels[:N_TEST])
    before = evaluate(CapsNet.from_pretrained(tmp_path / "saved"), whole)
    for d in (a, b):  # evaluate(dist=...): the reduced count and accuracy, on every rank
        assert d["evaluated"][0] == N_TEST and d["evaluated"][1] == pytest.approx(before["accuracy"], abs=1e-9)
    tested = json.loads((out / "test.json").read_text())["last"]
    acc = tested["accuracy"]
    assert 0 < acc < 1 and abs(acc * N_TEST - round(acc * N_TEST)) < 1e-9 and tested["n"] == N_TEST
    model = load_pretrained(out / "last")
    single = evaluate(model, whole)  # one process, all 101 images
    assert single["n"] == N_TEST
    assert acc == pytest.approx(single["accuracy"], abs=1e-5)
    assert tested["loss"] == pytest.approx(single["loss"], rel=1e-4)
    for rank in (0, 1):  # each rank's share alone gives other figures
        share = evaluate(model, Split(whole.images[rank::2], whole.labels[rank::2]))
        assert share["n"] == (51, 50)[rank]
        assert share["accuracy"] != pytest.approx(acc, abs=1e-5)
        assert share["loss"] != pytest.approx(single["loss"], rel=1e-4)


@pytest.mark.slow
def test_em_capsnet_centres_beta_a_before_ddp_wraps_it(tmp_path, one_rank_ddp):
    """EMCapsNet centres beta_a on data before its first step: under torchrun every rank must do it alike and
    before DDP wraps the model (which never broadcasts the parameters again), else the ranks train apart. The batch
    it centres on is the same on every rank (`Task.init_batch` takes no rank); here, on a one-rank group, the
    model DDP wraps is already centred."""
    argv = [
        "train",
        "--out",
        str(tmp_path / "run"),
        "--model",
        "em-capsnet",
        "--conv-channels",
        "8",
        "--primary-types",
        "4",
        "--caps1-types",
        "4",
        "--caps2-types",
        "4",
        "--epochs",
        "1",
        "--train-subset",
        "32",
        "--test-subset",
        "16",
        "--batch-size",
        "8",
        "--device",
        "cpu",
        "--no-progress",
        "--no-tensorboard",
    ]
    assert main(argv) == 0
    ((_, at_wrap),) = one_rank_ddp
    assert bool(at_wrap["caps1.beta_a_ready"]) and at_wrap["caps1.beta_a"].abs().sum() > 0
    trained = load_pretrained(tmp_path / "run" / "last").state_dict()
    assert not torch.equal(trained["caps1.beta_a"], at_wrap["caps1.beta_a"])  # centred, then trained


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
