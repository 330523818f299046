"""capsnet.training.phases and capsnet.tools.profiling: the step's phase ranges (no-ops unless profiling), the
profile of real training steps on the CPU, and the attribution of CUDA kernels (a synthetic trace: the real one
needs a GPU)."""

from enum import Enum
from types import SimpleNamespace

import pytest
import torch
from helpers import small_config

from capsnet import CapsNet
from capsnet.tools.profiling import markdown, profile_training, summarize
from capsnet.training.config import TrainConfig
from capsnet.training.phases import STEP, phase, profiled


def test_phase_ranges_cost_nothing_outside_a_profile():
    model = CapsNet(config=small_config())
    assert phase("loss") is phase("optimizer")  # one shared no-op context, no record_function
    with profiled(model):
        assert isinstance(phase("loss"), torch.profiler.record_function)
        assert model.conv1._forward_pre_hooks and model._forward_hooks
    assert phase("loss") is phase("data")
    assert not model.conv1._forward_pre_hooks and not model._forward_pre_hooks and not model.decoder._forward_hooks


def test_profile_of_training_steps_on_the_cpu(tmp_path):
    config = TrainConfig(out=str(tmp_path / "r"), train_subset=64, test_subset=16, batch_size=8, device="cpu",
                         progress=False, tensorboard=False)  # fmt: skip
    report = profile_training(config, small_config(), steps=2, warmup=1)
    assert report["batch"] == 8 and report["device"] == "cpu" and report["steps"] == 2
    phases = {p["phase"]: p for p in report["phases"]}
    assert {"data", "conv", "routing", "decoder", "loss", "optimizer"} <= set(phases)
    for name in ("conv", "routing", "decoder"):  # each has forward work and backward work
        assert phases[name]["forward_ms"] > 0 and phases[name]["backward_ms"] > 0, name
    assert phases["optimizer"]["forward_ms"] > 0 and phases["data"]["backward_ms"] == 0
    total = sum(p["forward_ms"] + p["backward_ms"] for p in report["phases"])
    assert abs(total - report["kernel_ms"]) <= 0.01 * report["kernel_ms"] + 0.01  # every operator in one phase
    assert report["step_ms"] >= report["kernel_ms"] * 0.99 and report["launches_per_step"] > 50
    names = [k["name"] for k in report["top_kernels"]]
    assert any("convolution" in n for n in names) and report["device_idle_pct"] is None
    text = "\n".join(markdown([report]))
    assert "| fp32 | 8 |" in text and "| routing |" in text and "| kernel | calls/step |" in text


class _Device(Enum):
    CPU = 0
    CUDA = 1


def _event(name, start, end, *, parent=None, device=_Device.CPU, annotation=False, seq=-1, thread=1, fwd=0, id=0,
           link=0):  # fmt: skip
    span = SimpleNamespace(start=start, end=end)
    return SimpleNamespace(name=name, time_range=span, cpu_parent=parent, device_type=device, sequence_nr=seq,
                           is_user_annotation=annotation, thread=thread, fwd_thread=fwd, id=id,
                           linked_correlation_id=link, self_cpu_time_total=end - start)  # fmt: skip


def _as_before_torch_2_13(events):
    """The same trace as torch before 2.13 records it: no link on the events; each operator lists its kernels."""
    for e in events:
        e.kernels = [SimpleNamespace(name=k.name, duration=k.time_range.end - k.time_range.start) for k in events
                     if k.device_type is _Device.CUDA and k.linked_correlation_id == e.id != 0]  # fmt: skip
    for e in events:
        e.kernels = [] if e.device_type is _Device.CUDA else e.kernels
        del e.linked_correlation_id
    return events


@pytest.mark.parametrize("recorded", ["linked", "listed"], ids=["torch-2.13", "torch-2.11"])
def test_cuda_kernels_are_attributed_to_the_phase_of_their_operator_forward_and_backward(recorded):
    step = _event(STEP, 0, 100, annotation=True)
    conv = _event("conv", 1, 20, parent=step, annotation=True)
    conv_op = _event("aten::convolution", 2, 10, parent=conv, seq=7, id=11)
    backward = _event("backward", 30, 90, parent=step, annotation=True)
    node = _event("autograd::engine::evaluate_function: ConvolutionBackward0", 31, 60, parent=backward, seq=7,
                  thread=2, fwd=1)  # fmt: skip
    grad_op = _event("aten::convolution_backward", 32, 59, parent=node, thread=2, id=12)
    other_op = _event("aten::add_", 70, 72, parent=backward, id=13)
    launches = [_event("cudaLaunchKernel", t, t + 1, link=i) for t, i in ((3, 11), (33, 12), (35, 12), (71, 13))]
    kernels = [_event("implicit_gemm", 10, 40, device=_Device.CUDA, link=11),
               _event("wgrad", 40, 60, device=_Device.CUDA, link=12),
               _event("dgrad", 60, 70, device=_Device.CUDA, link=12),
               _event("add_kernel", 80, 85, device=_Device.CUDA, link=13)]  # fmt: skip
    on_gpu = [_event(name, 9, 86, device=_Device.CUDA, annotation=True) for name in (STEP, "conv")]
    events = [step, conv, conv_op, backward, node, grad_op, other_op, *launches, *kernels, *on_gpu]
    events = _as_before_torch_2_13(events) if recorded == "listed" else events
    report = summarize(events, steps=1, device_type="cuda")
    phases = {p["phase"]: p for p in report["phases"]}
    assert phases["conv"]["forward_ms"] == 0.030 and phases["conv"]["backward_ms"] == 0.030
    assert phases["backward (other)"]["backward_ms"] == 0.005
    assert report["launches_per_step"] == 4 and report["kernel_ms"] == 0.065
    assert report["device_idle_pct"] == round(100 * (1 - 65 / 75), 1)  # kernels cover 10-70 and 80-85 of 10-85
    assert report["host_gap_us"] == round((30 + 2 + 36) / 3, 2)
    assert [k["name"] for k in report["top_kernels"]][:2] == ["implicit_gemm", "wgrad"]
