"""--cuda-graphs (capsnet.training.graphs): the static-shape step on the CPU (its batches and training equal the eager
loop's; the last, smaller batch runs eagerly), the one-line fallback, the flag in config.json and on the command
line; and, on a GPU, the captured step against eager training (loss and gradients to fp32 tolerance)."""

import dataclasses
import json
from types import SimpleNamespace

import pytest
import torch
from helpers import small_config

from capsnet.cli import build_parser
from capsnet.cli.train import configs_from_args
from capsnet.training import graphs
from capsnet.training.api import train
from capsnet.training.build import build
from capsnet.training.classification import ClassificationTask
from capsnet.training.config import TrainConfig
from capsnet.training.distributed import DistInfo
from capsnet.training.loop import train_step

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
TINY = dict(train_subset=80, test_subset=32, batch_size=32, epochs=1, progress=False, tensorboard=False)  # 72 + 8 val


def _run(tmp_path, name, device="cpu", **kw):
    config = TrainConfig(out=str(tmp_path / name), device=device, **{**TINY, **kw})
    return build(config, small_config(), torch.device(device), DistInfo(), None)


def _eager_steps(run, start=0, grads=None):
    """(loss, n_correct, batch size) of each eager step; with a list `grads`, each step's gradients appended to it
    right after that step (the next step replaces them)."""
    batches = run.task.batches(epoch=0, batch_size=run.config.batch_size, seed=0, rank=0, world_size=1,
                               device=run.device, generator=run.augment_rng, start=start)  # fmt: skip
    steps = []
    for b in batches:
        steps.append((*train_step(run, b), b.images.shape[0]))
        if grads is not None:
            grads.append([p.grad.clone() for p in run.model.parameters()])
    return steps


@pytest.mark.parametrize("repeats, sizes", [(1, [32, 32, 8]), (2, [32, 32, 32, 32, 16])])
def test_static_batches_have_one_shape_and_equal_the_tasks_batches(tmp_path, repeats, sizes):
    run = _run(tmp_path, "a", epoch_repeats=repeats)
    seen = []

    def spy(run, batch):
        seen.append((batch.images.clone(), batch.targets.clone()))
        return torch.zeros(()), torch.zeros((), dtype=torch.long)

    # 72 images a pass: full batches (the static shape), then the rest eagerly
    assert [n for _, _, n in graphs.StepGraph(run, spy, capture=False).epoch(0, 0)] == sizes
    assert [x.shape[0] for x, _ in seen] == sizes
    reference = _run(tmp_path, "b", epoch_repeats=repeats)  # the same seed: the same initial augmentation stream
    expected = list(reference.task.batches(epoch=0, batch_size=32, seed=0, rank=0, world_size=1,
                                           device=reference.device, generator=reference.augment_rng))  # fmt: skip
    assert len(expected) == len(seen)
    for (x, y), batch in zip(seen, expected, strict=True):
        assert torch.equal(x, batch.images) and torch.equal(y, batch.targets)


@pytest.mark.slow
def test_static_steps_train_as_the_eager_loop(tmp_path):
    eager = _run(tmp_path, "eager")
    static = _run(tmp_path, "static")
    step_graph = graphs.StepGraph(static, train_step, capture=False)
    got, grads = [], []
    for step in step_graph.epoch(0, 0):
        got.append(step)
        grads.append([p.grad.clone() for p in static.model.parameters()])
    grads_e = []
    want = _eager_steps(eager, grads=grads_e)
    assert [n for *_, n in got] == [n for *_, n in want] == [32, 32, 8]
    for (loss, correct, _), (loss_e, correct_e, _) in zip(got, want, strict=True):
        assert torch.equal(loss, loss_e) and torch.equal(correct, correct_e)
    for step, step_e in zip(grads, grads_e, strict=True):  # each step's own gradients, not only the last step's
        assert all(torch.equal(g, g_e) for g, g_e in zip(step, step_e, strict=True))
    assert not torch.equal(grads_e[0][0], grads_e[-1][0])
    for p, q in zip(static.model.parameters(), eager.model.parameters(), strict=True):
        assert torch.equal(p, q)
    resumed = list(graphs.StepGraph(_run(tmp_path, "r"), train_step, capture=False).epoch(0, 1))  # from batch 1
    assert [n for *_, n in resumed] == [32, 8]
    assert torch.equal(resumed[0][0], _eager_steps(_run(tmp_path, "e2"), start=1)[0][0])


def test_without_cuda_the_run_trains_eagerly_after_one_line(tmp_path, capsys):
    run = _run(tmp_path, "a", cuda_graphs=True)
    assert graphs.epoch_steps(run, 0, 0, train_step) is None
    assert graphs.epoch_steps(run, 1, 0, train_step) is None  # decided once
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["capsnet: --cuda-graphs: needs a CUDA device, not cpu; training eagerly"]


def test_what_cannot_be_captured_is_named():
    def fake(**changes):
        task = ClassificationTask.__new__(ClassificationTask)
        task.on_device = lambda which, device: object()
        run = SimpleNamespace(device=torch.device("cuda"), config=SimpleNamespace(compile=False),
                              dist=DistInfo(), task=task)  # fmt: skip
        for key, value in changes.items():
            setattr(run, key, value) if key != "compile" else setattr(run.config, key, value)
        return run

    assert graphs.unsupported(fake()) is None
    assert "--compile" in graphs.unsupported(fake(compile=True))
    assert "torchrun" in graphs.unsupported(fake(dist=DistInfo(rank=0, world_size=2, local_rank=0)))

    class OwnBatches(ClassificationTask):
        name = "pairs"

        def batches(self, **kw):
            yield from ()

    other = OwnBatches.__new__(OwnBatches)
    assert "pairs task" in graphs.unsupported(fake(task=other))
    host = fake()
    host.task.on_device = lambda which, device: None
    assert "does not fit on the GPU" in graphs.unsupported(host)


@pytest.mark.slow
def test_the_flag_is_recorded_and_a_cpu_run_equals_eager(tmp_path, capsys):
    flagged = train(TrainConfig(out=str(tmp_path / "g"), cuda_graphs=True, cudnn_benchmark=True, **TINY),
                    small_config())  # fmt: skip
    assert "--cuda-graphs: needs a CUDA device" in capsys.readouterr().err
    plain = train(TrainConfig(out=str(tmp_path / "p"), **TINY), small_config())
    assert flagged.history[0]["train_loss"] == plain.history[0]["train_loss"]
    saved = json.loads((tmp_path / "g" / "config.json").read_text())["train"]
    assert saved["cuda_graphs"] is True and saved["cudnn_benchmark"] is True


def test_command_line_flags():
    config, _ = configs_from_args(build_parser().parse_args(["train", "--cuda-graphs", "--no-cudnn-benchmark"]))
    assert config.cuda_graphs is True and config.cudnn_benchmark is False
    config, _ = configs_from_args(build_parser().parse_args(["train"]))
    assert config.cuda_graphs is False and config.cudnn_benchmark is None


# ------------------------------------------------------------------------------------------------- on a GPU
@CUDA
@pytest.mark.cuda
@pytest.mark.parametrize("shift", [0, 2], ids=["no-augmentation", "shifts"])
def test_captured_steps_equal_eager_steps(tmp_path, shift):
    """Warm-up steps, the capture, replays and the last, eager batch: each step's loss and every gradient equal
    eager training's (the same initial weights and augmentation stream) to fp32 tolerance; so do the weights."""
    torch.backends.cudnn.deterministic, old = True, torch.backends.cudnn.deterministic
    try:
        # 120 images less the validation tenth: 6 full batches (the warm-up, the capture, replays), then 1 of 12
        kw = dict(train_subset=120, batch_size=16, shift=shift, device="cuda")
        eager, graphed = _run(tmp_path, "e", **kw), _run(tmp_path, "g", cuda_graphs=True, **kw)
        assert graphed.optimizer.param_groups[0]["capturable"]
        grads_e, grads_g = [], []
        want = _eager_steps(eager, grads=grads_e)
        steps = graphs.epoch_steps(graphed, 0, 0, train_step)
        assert steps is not None
        got = []
        for loss, correct, n in steps:
            got.append((loss, correct, n))
            grads_g.append([p.grad.clone() for p in graphed.model.parameters()])
        assert graphed.step_graph.graph is not None  # captured (after graphs.WARMUP eager steps)
        assert [n for *_, n in got] == [n for *_, n in want] == [16] * 6 + [12]
        names = [name for name, _ in graphed.model.named_parameters()]
        differ = []  # every (step, parameter) whose gradient differs, so that one GPU run shows the whole pattern
        for k, ((loss, correct, _), (loss_e, correct_e, _)) in enumerate(zip(got, want, strict=True)):
            assert loss.item() == pytest.approx(loss_e.item(), rel=1e-5, abs=1e-7), k
            assert correct.item() == correct_e.item(), k
            for name, g, g_e in zip(names, grads_g[k], grads_e[k], strict=True):
                scale = g_e.abs().max().item()
                if (g - g_e).abs().max().item() > 1e-4 * max(scale, 1e-6):
                    differ.append(f"step {k} {name}: |g| {g.abs().max().item():.3g}, eager {scale:.3g}")
        assert not differ, "\n".join(differ)
        for p, q in zip(graphed.model.parameters(), eager.model.parameters(), strict=True):
            assert (p - q).abs().max().item() <= 1e-5
        lr = graphed.optimizer.param_groups[0]["lr"]  # a device tensor since the capture
        eager.scheduler.step(), graphed.scheduler.step()  # the schedule reaches the captured Adam: in place
        assert graphed.optimizer.param_groups[0]["lr"] is lr and lr.is_cuda
        assert lr.item() == pytest.approx(eager.optimizer.param_groups[0]["lr"])
    finally:
        torch.backends.cudnn.deterministic = old


@CUDA
@pytest.mark.cuda
def test_a_graphed_cuda_run_trains_and_records_its_epochs(tmp_path, capsys):
    config = TrainConfig(out=str(tmp_path / "r"), device="cuda", cuda_graphs=True, **{**TINY, "epochs": 2})
    result = train(config, small_config())
    assert "--cuda-graphs" not in capsys.readouterr().err  # captured: no fallback line
    assert len(result.history) == 2 and all(torch.isfinite(torch.tensor(r["train_loss"])) for r in result.history)
    assert isinstance(result.history[1]["lr"], float) and result.history[1]["lr"] < result.history[0]["lr"]
    resumed = train(dataclasses.replace(config, epochs=3, resume=True), small_config())
    assert len(resumed.history) == 3
