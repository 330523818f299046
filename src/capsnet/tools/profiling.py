"""Where a training step's time goes: torch.profiler over a few real steps, summarized per phase and per kernel.

The step's phase ranges are capsnet.training.phases'. `summarize` reads the profiler's events. On CUDA the
"kernels" are the device's kernels, copies and fills, each attributed to the phase of the operator that launched it;
on the CPU they are the operators themselves (their own time, children excluded). A backward kernel is attributed to
the phase of the forward operator whose autograd node ran it (the profiler records both with the same sequence
number). `profile_training` builds a run as `capsnet train` does, takes a few warm-up steps and profiles the
next ones.
"""

from __future__ import annotations

import itertools
import statistics
from collections import defaultdict
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from ..training.phases import BACKWARD, LABELS, PHASES, STEP, phase, profiled


# ------------------------------------------------------------------------------------------------ the summary
def _ancestors(event) -> Iterator[Any]:
    while event is not None:
        yield event
        event = event.cpu_parent


def _is_backward_node(event) -> bool:
    return event.name.startswith("autograd::engine::evaluate_function")


def _forward_phases(events, labels: set[str]) -> dict[tuple[int, int], str]:
    """(thread, sequence number) of each forward operator -> the innermost phase range around it. An operator that
    makes no autograd node records the next node's number: of those sharing a number, the last one made the node."""
    found = {}
    for e in sorted(events, key=lambda e: e.time_range.start):
        if e.sequence_nr < 0 or e.is_user_annotation or _is_backward_node(e):
            continue
        for a in _ancestors(e.cpu_parent):
            if _is_backward_node(a):
                break  # an operator run by the backward pass, not a forward one
            if a.is_user_annotation and a.name in labels:
                found[(e.thread, e.sequence_nr)] = a.name
                break
    return found


def attribute(op, forward: Mapping[tuple[int, int], str], labels: set[str]) -> tuple[str, str]:
    """(phase, "forward" | "backward") of the work that operator `op` (or None) did."""
    for a in _ancestors(op):
        if _is_backward_node(a):
            name = forward.get((a.fwd_thread, a.sequence_nr))
            return (name, "backward") if name else ("backward (other)", "backward")
        if a.is_user_annotation and a.name == BACKWARD:
            return "backward (other)", "backward"
        if a.is_user_annotation and a.name in labels:
            return a.name, "forward"
    return "other", "forward"


def _union_us(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals (µs)."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


RUNTIME_CALLS = ("cu",)  # the host's CUDA runtime and driver calls: cudaLaunchKernel, cuLaunchKernelEx, cudaMemcpyAsync


def _cuda_kernels(events) -> tuple[list, list[float], float, float]:
    """(kernel, launching operator, µs) for every device activity (kernels, copies, fills; not the ranges' copies
    on the device's timeline); the host's gaps between launch calls; the device's busy time (the union of its
    activities) and the window from the first to the last one (µs). torch records the link from an activity to its
    launch on each event from 2.13 (`linked_correlation_id`); before, only in each operator's `kernels` list, and
    the launch calls are known by their names."""
    device = [e for e in events if e.device_type.name == "CUDA" and not e.is_user_annotation]
    host = [e for e in events if e.device_type.name == "CPU"]
    if all(hasattr(e, "linked_correlation_id") for e in events):
        ops = {e.id: e for e in host if e.linked_correlation_id == 0}
        kernels = [(e, ops.get(e.linked_correlation_id), e.time_range.end - e.time_range.start) for e in device]
        calls = sorted(e.time_range.start for e in host if e.linked_correlation_id > 0)
    else:
        kernels = [(k, e, k.duration) for e in host if not e.is_user_annotation for k in e.kernels]
        calls = sorted(
            e.time_range.start for e in host if not e.is_user_annotation and e.name.startswith(RUNTIME_CALLS)
        )
    spans = [(e.time_range.start, e.time_range.end) for e in device]
    window = (max(b for _, b in spans) - min(a for a, _ in spans)) if spans else 0.0
    return kernels, [b - a for a, b in itertools.pairwise(calls)], _union_us(spans), window


def _cpu_kernels(events, host_us: float) -> tuple[list, list[float], float, float]:
    """As `_cuda_kernels` for a CPU profile of `host_us` µs of steps: each operator with its own time; the
    host's time outside every operator, per operator (no device timeline: window 0)."""
    kernels = [
        (e, e, e.self_cpu_time_total)
        for e in events
        if not e.is_user_annotation
        and e.device_type.name == "CPU"
        and e.self_cpu_time_total > 0
        and not _is_backward_node(e)
    ]
    outer = [
        (e.time_range.start, e.time_range.end)
        for e in events
        if not e.is_user_annotation and (e.cpu_parent is None or e.cpu_parent.is_user_annotation)
    ]
    busy = _union_us(outer)
    return kernels, ([(host_us - busy) / len(kernels)] if kernels else []), busy, 0.0


def summarize(events, *, steps: int, device_type: str, top: int = 12, labels: set[str] | None = None) -> dict:
    """The per-step figures of `events` (a profile of `steps` steps, each inside a STEP range): time per phase
    (forward and backward), the top kernels, kernel launches, the host's time between launches and the device's
    idle share (CUDA). `labels`: the phase ranges' names (default: those `profiled` and `phase` use)."""
    events = list(events)
    labels = set(LABELS if labels is None else labels)
    forward = _forward_phases(events, labels)
    step_ranges = [e for e in events if e.is_user_annotation and e.name == STEP and e.device_type.name == "CPU"]
    step_us = sum(e.time_range.end - e.time_range.start for e in step_ranges) / max(len(step_ranges), 1)
    found = _cuda_kernels(events) if device_type == "cuda" else _cpu_kernels(events, step_us * steps)
    kernels, gaps, busy, window = found
    per_phase: dict[str, dict[str, float]] = defaultdict(lambda: {"forward": 0.0, "backward": 0.0})
    by_name: dict[str, list[float]] = defaultdict(list)
    for e, op, us in kernels:
        name, direction = attribute(op, forward, labels)
        per_phase[name][direction] += us
        by_name[e.name].append(us)
    kernel_us = sum(us for _, _, us in kernels)
    ms = 1e-3 / steps  # µs in total -> ms per step
    phases = [
        {
            "phase": p,
            "forward_ms": round(per_phase[p]["forward"] * ms, 3),
            "backward_ms": round(per_phase[p]["backward"] * ms, 3),
        }
        for p in [p for p in PHASES if p in per_phase] + sorted(set(per_phase) - set(PHASES))
    ]
    ranked = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:top]
    top_kernels = [
        {
            "name": name[:100],
            "calls_per_step": round(len(times) / steps, 1),
            "ms_per_step": round(sum(times) * ms, 3),
            "pct": round(100.0 * sum(times) / max(kernel_us, 1e-9), 1),
        }
        for name, times in ranked
    ]
    return {
        "steps": steps,
        "step_ms": round(step_us * 1e-3, 3),
        "kernel_ms": round(kernel_us * ms, 3),
        "device_busy_ms": round(busy * ms, 3),
        "device_idle_pct": round(100.0 * (1.0 - busy / window), 1) if window > 0 else None,
        "launches_per_step": round(len(kernels) / steps, 1),
        "host_gap_us": round(statistics.fmean(gaps), 2) if gaps else None,
        "host_gap_median_us": round(statistics.median(gaps), 2) if gaps else None,
        "phases": phases,
        "top_kernels": top_kernels,
    }


# ------------------------------------------------------------------------------------------------ the driver
def profile_training(config, model_config=None, *, steps: int = 5, warmup: int = 5) -> dict:
    """Build a run as `capsnet train` does (`config`: a TrainConfig), take `warmup` training steps, then profile
    `steps` more; returns `summarize`'s figures (with the configuration's batch, precision and device)."""
    from torch.profiler import ProfilerActivity, profile

    from ..training.build import build
    from ..training.distributed import DistInfo
    from ..training.hardware import resolve_device
    from ..training.loop import train_step

    device = resolve_device(config.device)
    run = build(config, model_config, device, DistInfo(), None)
    assert run.config.batch_size is not None  # (the device's default is filled in by build)
    size: int = run.config.batch_size

    def epochs() -> Iterator[Any]:  # the training batches, epoch after epoch
        for epoch in itertools.count():
            yield from run.task.batches(
                epoch=epoch,
                batch_size=size,
                seed=config.seed,
                rank=0,
                world_size=1,
                device=device,
                generator=run.augment_rng,
            )

    batches = epochs()
    run.model.train()

    def one_step() -> None:
        with phase(STEP):
            with phase("data"):
                batch = next(batches)
            train_step(run, batch)

    with profiled(run.model):
        for _ in range(warmup):
            one_step()
        synchronize(device)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with profile(activities=activities) as prof:
            for _ in range(steps):
                one_step()
            synchronize(device)
    report = summarize(prof.events(), steps=steps, device_type=device.type)
    return {"device": str(device), "batch": run.config.batch_size, "precision": config.precision, **report}


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def markdown(reports: list[dict], *, top: int = 8) -> list[str]:
    """Markdown lines: one summary row per profiled configuration, then each one's phases and top kernels."""
    lines = [
        "| variant | batch | step ms | kernel ms | device idle % | launches/step | host µs between launches |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in reports:
        idle = "-" if r["device_idle_pct"] is None else f"{r['device_idle_pct']:.1f}"
        gap = "-" if r["host_gap_us"] is None else f"{r['host_gap_us']:.1f}"
        lines.append(
            f"| {r.get('variant', r['precision'])} | {r['batch']} | {r['step_ms']:.2f} | "
            f"{r['kernel_ms']:.2f} | {idle} | {r['launches_per_step']:.0f} | {gap} |"
        )
    for r in reports:
        lines += [
            "",
            f"{r.get('variant', r['precision'])}, batch {r['batch']}: kernel time per phase (ms per step)",
            "",
            "| phase | forward | backward |",
            "|---|---:|---:|",
        ]
        lines += [f"| {p['phase']} | {p['forward_ms']:.3f} | {p['backward_ms']:.3f} |" for p in r["phases"]]
        lines += ["", "| kernel | calls/step | ms/step | % |", "|---|---:|---:|---:|"]
        lines += [
            f"| `{k['name'][:70]}` | {k['calls_per_step']:g} | {k['ms_per_step']:.3f} | {k['pct']:.1f} |"
            for k in r["top_kernels"][:top]
        ]
    return lines
