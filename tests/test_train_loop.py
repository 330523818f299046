"""The training loop's device behaviour: no host syncs in the step, data on the device, precision checks,
per-device defaults, CUDA random states in checkpoints and compile (torchrun: tests/test_distributed.py)."""

import pytest
import torch
from helpers import small_config, small_model_config
from safetensors.torch import load_file
from torch.utils._python_dispatch import TorchDispatchMode

from capsnet.models.baseline import BaselineCNN, BaselineConfig
from capsnet.models.registry import MODELS
from capsnet.training import classification, hardware
from capsnet.training.api import train
from capsnet.training.build import build
from capsnet.training.checkpoint import get_rng_states, load_state, set_rng_states
from capsnet.training.config import TrainConfig
from capsnet.training.distributed import DistInfo
from capsnet.training.loop import train_step
from capsnet.training.state import EpochSums

TINY = dict(train_subset=96, test_subset=64, batch_size=32, epochs=1, progress=False, tensorboard=False)
SMALL_BASELINE = BaselineConfig(channels=(8, 8), hidden=(32, 16))


class HostSyncs(TorchDispatchMode):
    """Counts the reads of a tensor's value by the host: `aten._local_scalar_dense` (behind .item(), float(t),
    int(t), bool(t)), plus .tolist() and .numpy(), which read memory without an aten op. On a GPU each one waits
    for the device (torch.cuda.set_sync_debug_mode's equivalent, on the CPU)."""

    def __init__(self):
        super().__init__()
        self.count = 0
        self._saved = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.count += 1
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        for name in ("tolist", "numpy"):
            original = self._saved[name] = getattr(torch.Tensor, name)
            setattr(torch.Tensor, name, self._counting(original))
        return super().__enter__()

    def __exit__(self, *exc):
        for name, original in self._saved.items():
            setattr(torch.Tensor, name, original)
        return super().__exit__(*exc)

    def _counting(self, original):
        def read(t, *a, **k):
            self.count += 1
            return original(t, *a, **k)

        return read


def _run_config(tmp_path, name, **kw):
    return TrainConfig(out=str(tmp_path / name), **{**TINY, **kw})


@pytest.mark.slow
def test_the_training_step_never_reads_the_device(tmp_path):
    config = _run_config(tmp_path, "r")
    run = build(config, small_config(), torch.device("cpu"), DistInfo(), None)
    batches = list(run.task.batches(epoch=0, batch_size=32, seed=0, rank=0, world_size=1, device=run.device,
                                    generator=run.augment_rng))  # fmt: skip
    sums = EpochSums.zeros(run.device)
    with HostSyncs() as syncs:
        for batch in batches:
            loss, n_correct = train_step(run, batch)
            sums.add(loss, n_correct, batch.images.shape[0])
    assert syncs.count == 0
    with HostSyncs() as syncs:  # (the counter does see reads)
        sums.to_list()
        loss.item()
    assert syncs.count == 2


@pytest.mark.slow
@pytest.mark.parametrize("model", list(MODELS))
def test_no_host_reads_between_steps(tmp_path, model):
    """For every registered model, in a whole run (batches, augmentation, step, running sums, stop checks), nothing
    reads the device between one step's end and the next: the reads all fall at the epoch's end (sums, evaluation,
    checkpoint), and before the first step (a data-dependent initialisation)."""
    config = _run_config(tmp_path, model, train_subset=48, test_subset=16, batch_size=8, model=model)  # 6 steps
    counts = []
    with HostSyncs() as syncs:
        train(config, small_model_config(model), on_step=lambda _: counts.append(syncs.count) and False)
        total = syncs.count
    assert len(counts) == 6 and counts == [counts[0]] * 6, counts
    assert total > counts[-1]  # (the epoch's end does read, and the counter sees it)


@pytest.mark.slow
def test_bf16_and_channels_last_training_runs(tmp_path):
    result = train(_run_config(tmp_path, "r", precision="bf16", channels_last=True), small_config())
    row = result.history[0]
    assert torch.isfinite(torch.tensor(row["train_loss"])) and 0 <= row["val_acc"] <= 1


@pytest.mark.slow
def test_compiled_training_equals_eager(tmp_path):
    """`compile=True` (inductor, on the CPU; tests/test_devices.py compiles a step on CUDA) trains as eager does: the
    epoch's losses and accuracies, and the weights its steps leave (so the compiled gradients are eager's)."""
    torch._dynamo.reset()
    # 71 images: 7 held out for validation and two full batches of 32, so that inductor compiles one batch size
    eager = train(_run_config(tmp_path, "eager", train_subset=71), small_config())
    compiled = train(_run_config(tmp_path, "compiled", train_subset=71, compile=True), small_config())
    for key in ("train_loss", "train_acc", "val_loss", "val_acc"):
        assert compiled.history[0][key] == pytest.approx(eager.history[0][key], rel=1e-4, abs=1e-5), key
    weights = [load_file(str(tmp_path / run / "last" / "model.safetensors")) for run in ("eager", "compiled")]
    assert weights[0].keys() == weights[1].keys()
    for name, w in weights[0].items():
        assert torch.allclose(weights[1][name], w, rtol=1e-5, atol=1e-6), name  # (3e-8 apart at most here)


def test_recon_weight_zero_skips_the_decoder_in_training():
    from capsnet import CapsNet

    model = CapsNet(config=small_config(recon_weight=0.0)).train()
    x, y = torch.rand(2, 1, 28, 28), torch.tensor([1, 2])
    out = model(x, y)
    assert out.reconstructions is None
    model.loss(out, x, y)[0].backward()
    assert all(p.grad is None and not p.requires_grad for p in model.decoder.parameters())  # frozen, for DDP
    assert model.eval()(x).reconstructions is not None  # inference still reconstructs


# ------------------------------------------------------------------------------------- precision, defaults
@pytest.mark.parametrize("native, expect_note", [(True, False), (False, True)])
def test_bf16_on_a_cpu_without_native_support_gets_one_line(native, expect_note, monkeypatch):
    monkeypatch.setattr(hardware, "cpu_bf16_native", lambda: native)
    note = hardware.precision_note(torch.device("cpu"), "bf16")
    assert (note is not None) == expect_note
    if note:
        assert "\n" not in note and "fp32" in note and "AVX512_BF16" in note
    assert hardware.precision_note(torch.device("cpu"), "fp32") is None


@pytest.mark.parametrize(
    "avx512_bf16, amx, expected", [(False, False, False), (True, False, True), (False, True, True)]
)
def test_cpu_bf16_capability_check(avx512_bf16, amx, expected, monkeypatch):
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16, raising=False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx, raising=False)
    assert hardware.cpu_bf16_native() is expected
    # without torch's probes: the /proc/cpuinfo flags decide
    monkeypatch.delattr(torch.cpu, "_is_avx512_bf16_supported")
    monkeypatch.delattr(torch.cpu, "_is_amx_tile_supported")
    flags = {"avx2"} | ({"avx512_bf16"} if avx512_bf16 else set()) | ({"amx_bf16"} if amx else set())
    monkeypatch.setattr(hardware, "cpu_flags", lambda: flags)
    assert hardware.cpu_bf16_native() is expected


def test_cuda_bf16_capability_check(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: not including_emulation)
    assert hardware.bf16_native(torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: False)
    assert "this GPU" in hardware.precision_note(torch.device("cuda"), "bf16")


def test_bf16_warning_is_printed_before_training(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(hardware, "cpu_bf16_native", lambda: False)
    train(_run_config(tmp_path, "r", precision="bf16", train_subset=32), small_config())
    err = [line for line in capsys.readouterr().err.splitlines() if "bf16" in line]
    assert len(err) == 1 and "fp32" in err[0]


@pytest.mark.slow
def test_default_batch_is_per_device_and_printed(tmp_path, capsys):
    assert TrainConfig().batch_size is None
    assert hardware.default_batch_size(torch.device("cpu")) == 16
    assert hardware.default_batch_size(torch.device("cuda")) == 128
    config = _run_config(tmp_path, "r", batch_size=None, train_subset=32)
    train(config, small_config())
    out = capsys.readouterr().out
    assert "batch size 16 per process (the cpu default; set --batch-size" in out and "lr 0.001 (capsnet's" in out
    assert load_state(tmp_path / "r")["step"] == 2  # 32 images at the CPU default of 16


@pytest.mark.parametrize(
    ("model", "device", "expected"),
    [
        ("deepcaps", "cuda", (256, True)),  # its authors' batch, on any device
        ("hvc-capsnet", "cpu", (120, True)),
        ("em-capsnet", "cuda", (128, False)),  # no recipe batch: the device's default
        ("capsnet", "cpu", (16, False)),
        (None, "cuda", (128, False)),  # a FitConfig names no registry model
    ],
)
def test_the_batch_is_the_recipes_else_the_devices(model, device, expected):
    assert hardware.batch_size_for(model, torch.device(device)) == expected


def test_an_explicit_cuda_device_is_not_replaced_silently(capsys):
    dist = DistInfo(rank=0, world_size=2, local_rank=1)
    assert hardware.rank_device(torch.device("cuda", 3), dist) == torch.device("cuda", 1)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--device cuda:3 ignored under torchrun" in err[0] and "CUDA_VISIBLE_DEVICES" in err[0]
    assert hardware.rank_device(torch.device("cuda"), dist) == torch.device("cuda", 1)
    assert hardware.rank_device(torch.device("cpu"), dist) == torch.device("cpu")
    assert capsys.readouterr().err == ""


# ------------------------------------------------------------------------------------- data on the device
def test_staged_batches_equal_the_resident_ones(monkeypatch):
    from capsnet.data import load_dataset

    data = load_dataset("mnist-sample")
    task = classification.ClassificationTask(train=classification.subset(data.train, 100), test=data.test, shift=2)
    kw = dict(epoch=1, batch_size=32, seed=3, rank=1, world_size=2, device=torch.device("cpu"), start=1)
    resident = list(task.batches(generator=torch.Generator().manual_seed(5), **kw))
    monkeypatch.setattr(classification, "fits_on_device", lambda nbytes, device: False)
    task._resident.clear()
    staged = list(task.batches(generator=torch.Generator().manual_seed(5), **kw))
    assert task.on_device("train", torch.device("cpu")) is None and len(staged) == len(resident) == 1
    for a, b in zip(resident, staged, strict=True):
        assert torch.equal(a.images, b.images) and torch.equal(a.targets, b.targets)


def test_data_moves_to_the_device_only_within_its_budget(monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (1000, 4000))
    assert classification.fits_on_device(250, torch.device("cuda"))
    assert not classification.fits_on_device(251, torch.device("cuda"))
    assert classification.fits_on_device(10**12, torch.device("cpu"))


# ------------------------------------------------------------------------------------- resume, random states
@pytest.mark.slow
def test_baseline_resume_with_dropout_is_bit_exact(tmp_path):
    """The dropout masks come from the torch generator, which the checkpoint restores."""
    kw = dict(model="baseline", epochs=2, batch_size=32)
    full = train(_run_config(tmp_path, "full", **kw), SMALL_BASELINE)
    stopped = train(_run_config(tmp_path, "resumed", **kw), SMALL_BASELINE, on_step=lambda step: step == 4)
    assert stopped.interrupted
    train(_run_config(tmp_path, "resumed", resume=True, **kw), SMALL_BASELINE)
    a = BaselineCNN.from_pretrained(tmp_path / "full" / "last").state_dict()
    b = BaselineCNN.from_pretrained(tmp_path / "resumed" / "last").state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert full.epochs_done == 2


def test_checkpoints_hold_the_cuda_random_state(monkeypatch):
    """On CUDA the training GPU's generator is saved and restored (mocked here); CPU runs and older states have
    none, and restore without it."""
    cuda_state = torch.arange(16, dtype=torch.uint8)
    restored = {}
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device=None: cuda_state.clone())
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device=None: restored.update(state=state))
    gen = torch.Generator().manual_seed(1)
    states = get_rng_states(torch.device("cuda", 0), gen, DistInfo())
    assert torch.equal(states["cuda"], cuda_state)
    set_rng_states(states, torch.device("cuda", 0), gen, DistInfo())
    assert torch.equal(restored["state"], cuda_state)
    cpu_states = get_rng_states(torch.device("cpu"), gen, DistInfo())
    assert "cuda" not in cpu_states
    restored.clear()
    set_rng_states(cpu_states, torch.device("cuda", 0), gen, DistInfo())  # an older or CPU state: nothing to set
    assert not restored
