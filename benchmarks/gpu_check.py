"""One-command GPU check: CUDA tests, a profile of the training step, epoch timings against the labml loop, and a
Fashion-MNIST run.

    python benchmarks/gpu_check.py [--out gpu_check] [--minutes 8] [--profile]     (or: make gpu-check)
    python benchmarks/gpu_check.py --smoke --device cpu [--profile]                 (tiny sizes: checks the script)

On one GPU it takes under `--minutes` (8) and writes OUT/gpu_check.json, OUT/gpu_check.md (markdown tables) and
OUT/pytest.log:

1. tests: `pytest -m cuda` (tests/test_devices.py and every other CUDA-marked test: each routing path and model
   forward/backward on CUDA against CPU float64 references, bf16 autocast, torch.compile, save/load across
   devices, no host sync in the training step, the CUDA-graph step and the Triton routing kernels against eager),
   with the counts of passed/failed/skipped;
   (--profile) torch.profiler over a few training steps at each batch, fp32 and bf16 (capsnet.tools.profiling):
   kernel time per phase (conv, routing, decoder, loss, optimizer, data; forward and backward), the top kernels,
   launches per step, the host's time between launches and the GPU's idle share;
2. epochs: one 60,000-image epoch (Fashion-MNIST's training set if it is on this machine, else generated 28×28
   images written as an MNIST-format folder) of `capsnet train` in each variant (--variants: a precision, fp32 or
   bf16, with options joined by '+': compile, graphs (--cuda-graphs), triton (CAPSNET_TRITON=1), cl
   (--channels-last), bench (--cudnn-benchmark)), and of the plain labml loop (benchmarks/bench_epoch.py, fp32),
   at batch 128 and 512: images/s, seconds per epoch and peak GPU memory. capsnet runs two epochs and reports the
   second (so compilation, capture and warm-up are not timed); images/s excludes the test pass, as for the labml
   loop. Variants are timed in the order given, both batches each, until the time budget's share for them is spent
   (a failing variant is one row with its error);
3. routing: benchmarks/bench_routing_algos.py (each routing layer against its paper's transcription) and
   benchmarks/bench_em.py (ConvCaps1 of the smallNORB model, EM routing in chunks against the transcription) on the
   device: speeds, peak memory and the largest difference of the results;
4. accuracy: `capsnet train` on full Fashion-MNIST in the fastest configuration from 2. for the minutes left,
   with the test accuracy of every epoch (skipped when Fashion-MNIST is not on this machine).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))
sys.path.insert(0, str(HERE))

from bench_epoch import labml_epoch  # noqa: E402

from capsnet import CapsNetConfig  # noqa: E402
from capsnet.data import load_dataset  # noqa: E402
from capsnet.errors import CapsNetError  # noqa: E402
from capsnet.tools.profiling import markdown as profile_markdown  # noqa: E402
from capsnet.tools.profiling import profile_training  # noqa: E402
from capsnet.training.api import train  # noqa: E402
from capsnet.training.config import TrainConfig  # noqa: E402
from capsnet.training.hardware import bf16_native  # noqa: E402

SMOKE_MODEL = CapsNetConfig(conv_channels=16, primary_types=4, primary_dim=4, class_dim=6, decoder_hidden=(32, 64))
# The epoch table's variants, most telling first (a time budget cut drops the last ones).
VARIANTS = ["fp32", "bf16", "bf16+graphs", "fp32+graphs", "bf16+triton", "bf16+graphs+triton", "bf16+cl", "bf16+bench",
            "bf16+compile"]  # fmt: skip
OPTIONS = {"compile": {"compile": True}, "graphs": {"cuda_graphs": True}, "cl": {"channels_last": True},
           "bench": {"cudnn_benchmark": True}, "triton": {}}  # fmt: skip


def variant_options(variant: str) -> tuple[dict, bool]:
    """(TrainConfig fields, whether CAPSNET_TRITON is on) of a variant such as "bf16+graphs+triton"."""
    precision, *options = variant.split("+")
    unknown = [o for o in options if o not in OPTIONS]
    if precision not in ("fp32", "bf16") or unknown:
        raise ValueError(f"variant {variant!r}: a precision (fp32, bf16) and options from {', '.join(OPTIONS)}")
    fields = {"precision": precision, "compile": False, "cuda_graphs": False, "channels_last": False,
              "cudnn_benchmark": False}  # fmt: skip
    for option in options:
        fields.update(OPTIONS[option])
    return fields, "triton" in options


@contextlib.contextmanager
def triton_routing(on: bool):
    """CAPSNET_TRITON=1 (the Triton routing kernels on CUDA) inside the block when `on`."""
    old = os.environ.get("CAPSNET_TRITON")
    os.environ["CAPSNET_TRITON"] = "1" if on else "0"
    try:
        yield
    finally:
        if old is None:
            del os.environ["CAPSNET_TRITON"]
        else:
            os.environ["CAPSNET_TRITON"] = old


# ------------------------------------------------------------------------------------------- data
def write_idx(path: Path, array: np.ndarray) -> None:
    """An uint8 array as an IDX file (magic 0x0000 08 ndim, big-endian sizes, then the bytes)."""
    header = bytes([0, 0, 8, array.ndim]) + b"".join(int(n).to_bytes(4, "big") for n in array.shape)
    path.write_bytes(header + np.ascontiguousarray(array, dtype=np.uint8).tobytes())


def generated_folder(folder: Path, n_train: int, n_test: int, seed: int = 0) -> Path:
    """An MNIST-format folder of random 28×28 'images' (blurred blobs, 10 classes): data to time, not to learn."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        images = (rng.random((n, 28, 28)) ** 4 * 255).astype(np.uint8)
        write_idx(folder / f"{prefix}-images-idx3-ubyte", images)
        write_idx(folder / f"{prefix}-labels-idx1-ubyte", rng.integers(0, 10, n).astype(np.uint8))
    return folder


def epoch_data(smoke: bool, tmp: Path) -> tuple[str, str]:
    """(dataset argument, description): Fashion-MNIST when present (never downloaded here), else generated."""
    if not smoke:
        try:
            load_dataset("fashion-mnist", download=False)
            return "fashion-mnist", "Fashion-MNIST (60,000 training images)"
        except CapsNetError:
            pass
    n = 64 if smoke else 60_000
    folder = generated_folder(tmp / "generated", n, 64 if smoke else 1_000)
    return str(folder), f"generated 28x28 images ({n:,}; Fashion-MNIST not on this machine)"


# ------------------------------------------------------------------------------------------- parts
def run_tests(device: str, timeout: float, log: Path | None = None) -> dict:
    """`pytest -m cuda` (its whole output in `log`); on a machine without CUDA every case skips."""
    cmd = [sys.executable, "-m", "pytest", "-m", "cuda", "-q", "-rfE", "-p", "no:cacheprovider",
           str(HERE.parent / "tests")]  # fmt: skip
    t0 = time.perf_counter()
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=HERE.parent)
        output, code = r.stdout + r.stderr, r.returncode
    except subprocess.TimeoutExpired as e:
        raw = e.stdout or b""
        output, code = raw.decode(errors="replace") if isinstance(raw, bytes) else raw, -1
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|deselected|error)", output)}
    if log is not None:
        log.write_text(output)
    failures = [line for line in output.splitlines() if line.startswith(("FAILED ", "ERROR "))]
    return {"command": "pytest -m cuda", "exit_code": code, "seconds": round(time.perf_counter() - t0, 1),
            "counts": counts, "failures": failures, "tail": output.strip().splitlines()[-15:]}  # fmt: skip


def run_routing(device: str, smoke: bool, timeout: float) -> list[dict]:
    """The routing layers against their papers' transcriptions, on the device (tiny sizes in a smoke run)."""
    runs = [["bench_routing_algos.py", "--device", device, *(["--batch-size", "2", "--repeats", "1"] if smoke else [])],
            ["bench_em.py", "--device", device, *(["--layer", "caps2", "--batch", "1", "--repeat", "1"] if smoke
                                                  else [])]]  # fmt: skip
    results = []
    for script, *options in runs:
        t0 = time.perf_counter()
        try:
            r = subprocess.run([sys.executable, str(HERE / script), *options], capture_output=True, text=True,
                               timeout=timeout, cwd=HERE.parent)  # fmt: skip
            lines, code = r.stdout.strip().splitlines() + r.stderr.strip().splitlines()[-5:], r.returncode
        except subprocess.TimeoutExpired:
            lines, code = [f"timed out after {timeout:.0f} s"], -1
        results.append({"command": " ".join(["python benchmarks/" + script, *options]), "exit_code": code,
                        "seconds": round(time.perf_counter() - t0, 1), "output": lines})  # fmt: skip
        print(json.dumps(results[-1]), flush=True)
    return results


def reset_peak(device: torch.device) -> float:
    """Free what earlier rows left (garbage, cached blocks) and restart the peak count; returns the MiB still
    allocated, which `peak_memory` leaves out of this row's figure."""
    if device.type != "cuda":
        return 0.0
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_allocated(device) / 2**20


def peak_memory(device: torch.device, before: float) -> float | None:
    """The row's peak GPU memory (MiB) above what was allocated when it began (`before`, from `reset_peak`)."""
    return torch.cuda.max_memory_allocated(device) / 2**20 - before if device.type == "cuda" else None


def time_capsnet(dataset: str, batch: int, variant: str, device: torch.device, model_config) -> dict:
    fields, triton = variant_options(variant)
    before = reset_peak(device)
    with tempfile.TemporaryDirectory(prefix="capsnet-gpu-check-") as out, triton_routing(triton):
        config = TrainConfig(dataset=dataset, batch_size=batch, epochs=2, lr_end=1.0, device=str(device), out=out,
                             progress=False, tensorboard=False, test_subset=1000, **fields)  # fmt: skip
        row = train(config, model_config).history[-1]  # the second epoch: warm, compiled, captured
    return {"loop": "capsnet", "variant": variant, "batch": batch, "images_per_s": row["images_per_s"],
            "seconds": row["seconds"], "peak_mib": peak_memory(device, before), "held_before_mib": before}  # fmt: skip


def describe(e: Exception) -> str:
    """One line for a failure: the exception's type and the first line of its message."""
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0][:300]}" if lines else type(e).__name__


def timed_row(run: str, dataset: str, batch: int, device: torch.device, n: int, model_config) -> dict:
    """One row of the epoch table; a failure is a row with its error (the check goes on)."""
    try:
        if run == "labml":
            return time_labml(dataset, batch, device, n)
        return time_capsnet(dataset, batch, run, device, model_config)
    except Exception as e:
        return {"loop": "labml" if run == "labml" else "capsnet", "variant": "fp32" if run == "labml" else run,
                "batch": batch, "error": describe(e)}  # fmt: skip


def run_profile(device: torch.device, batches: list[int], variants: list[str], smoke: bool, dataset: str,
                model_config) -> list[dict]:  # fmt: skip
    """capsnet.tools.profiling.profile_training at each batch and variant (a few steps after a warm-up)."""
    reports = []
    for variant in variants:
        fields, triton = variant_options(variant)
        for batch in batches:
            with tempfile.TemporaryDirectory(prefix="capsnet-gpu-check-") as out, triton_routing(triton):
                config = TrainConfig(dataset=dataset, batch_size=batch, device=str(device), out=out, progress=False,
                                     tensorboard=False, train_subset=256 if smoke else None, **fields)  # fmt: skip
                try:
                    report = profile_training(config, model_config, steps=2 if smoke else 5, warmup=1 if smoke else 5)
                except Exception as e:
                    report = {"batch": batch, "error": describe(e)}
            reports.append({"variant": variant, **report})
            print(json.dumps({k: v for k, v in reports[-1].items() if k not in ("phases", "top_kernels")}), flush=True)
    return reports


def time_labml(dataset: str, batch: int, device: torch.device, n: int) -> dict:
    before = reset_peak(device)
    rate = labml_epoch(batch, device, seed=0, dataset=dataset)
    return {"loop": "labml", "variant": "fp32", "batch": batch, "images_per_s": rate, "seconds": n / rate,
            "peak_mib": peak_memory(device, before), "held_before_mib": before}  # fmt: skip


def accuracy_run(best: dict, device: torch.device, seconds_left: float, smoke: bool, dataset: str,
                 model_config) -> dict:  # fmt: skip
    """Train on full Fashion-MNIST in the fastest configuration until the time is up: validation accuracy per
    epoch, and (when the planned epochs finished) the test accuracy of the epoch chosen on validation."""
    if not smoke and dataset != "fashion-mnist":
        return {"skipped": "Fashion-MNIST is not on this machine (capsnet data fashion-mnist fetches it)"}
    epoch_s = best["seconds"] * 1.25 + 2.0  # + the test pass
    epochs = max(1, int(seconds_left // epoch_s)) if not smoke else 1
    fields, triton = variant_options(best["variant"])
    deadline = time.perf_counter() + seconds_left
    with tempfile.TemporaryDirectory(prefix="capsnet-gpu-check-") as out, triton_routing(triton):
        config = TrainConfig(dataset=dataset, batch_size=best["batch"], epochs=epochs, device=str(device), out=out,
                             progress=False, tensorboard=False, train_subset=64 if smoke else None,
                             test_subset=64 if smoke else None, **fields)  # fmt: skip
        result = train(config, model_config, on_step=lambda _: time.perf_counter() > deadline)
    return {"batch": best["batch"], "variant": best["variant"], "epochs_planned": epochs,
            "interrupted": result.interrupted,
            "val_acc": [round(r["val_acc"], 4) for r in result.history],
            "test": result.test,
            "seconds": [round(r["seconds"], 2) for r in result.history]}  # fmt: skip


# ------------------------------------------------------------------------------------------- report
def epoch_table(rows: list[dict]) -> list[str]:
    lines = ["| loop | variant | batch | images/s | s per epoch | vs labml | vs capsnet fp32 | peak MiB |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    ok = [r for r in rows if "error" not in r]
    labml = {r["batch"]: r["images_per_s"] for r in ok if r["loop"] == "labml"}
    fp32 = {r["batch"]: r["images_per_s"] for r in ok if r["loop"] == "capsnet" and r["variant"] == "fp32"}
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['loop']} | {r['variant']} | {r['batch']} | failed: {r['error']} | | | | |")
            continue
        ratios = [f"{r['images_per_s'] / ref[r['batch']]:.2f}x" if r["batch"] in ref else "-" for ref in (labml, fp32)]
        mem = f"{r['peak_mib']:.0f}" if r["peak_mib"] is not None else "-"
        lines.append(f"| {r['loop']} | {r['variant']} | {r['batch']} | {r['images_per_s']:.0f} | "
                     f"{r['seconds']:.2f} | {ratios[0]} | {ratios[1]} | {mem} |")  # fmt: skip
    return lines


def markdown(report: dict) -> str:
    lines = [f"# GPU check: {report['device_name']}", "", f"torch {report['torch']}, triton {report['triton']}, "
             f"data: {report['data']}, bf16 native: {report['bf16_native']}, total {report['seconds']:.0f} s",
             ""]  # fmt: skip
    tests = report["tests"]
    lines += [f"Tests (`{tests['command']}`): exit {tests['exit_code']}, {tests['counts']}", ""]
    lines += [f"- `{line}`" for line in tests.get("failures", [])] + ([""] if tests.get("failures") else [])
    if report["profile"]:
        lines += ["## Profile of the training step", "", *profile_markdown(
            [r for r in report["profile"] if "error" not in r]), ""]  # fmt: skip
        lines += [f"Profile of {r['variant']} at batch {r['batch']} failed: {r['error']}" for r in report["profile"]
                  if "error" in r]  # fmt: skip
    for run in report["routing"]:
        lines += [f"`{run['command']}`: exit {run['exit_code']}, {run['seconds']} s", "", "```", *run["output"],
                  "```", ""]  # fmt: skip
    lines += ["## Epochs", "", *epoch_table(report["epochs"])]
    if report["skipped_for_time"]:
        lines += ["", f"Not timed (the time budget's share was spent): {', '.join(report['skipped_for_time'])}"]
    if report["smoke"]:
        lines += ["", "Smoke run: a small CapsNet against the full-size labml model, on a few generated images; "
                  "the figures check the script, they measure nothing."]  # fmt: skip
    acc = report["accuracy"]
    lines.append("")
    if "skipped" in acc:
        lines.append(f"Fashion-MNIST training: skipped ({acc['skipped']})")
    else:
        lines += [f"Fashion-MNIST training ({acc['variant']}, batch {acc['batch']}):", "",
                  "| epoch | validation accuracy | seconds |", "|---:|---:|---:|"]  # fmt: skip
        lines += [f"| {k + 1} | {a:.4f} | {s:.2f} |" for k, (a, s) in enumerate(zip(acc["val_acc"], acc["seconds"]))]
        if acc["test"]:
            best = acc["test"].get("best", acc["test"]["last"])
            lines += ["", f"Test accuracy of the epoch chosen on validation (epoch {best['epoch']}): "
                      f"{best['accuracy']:.4f}"]  # fmt: skip
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="gpu_check", help="folder for gpu_check.json and gpu_check.md")
    p.add_argument("--device", default="cuda", help="cuda (the check) or cpu (with --smoke)")
    p.add_argument("--minutes", type=float, default=8.0, help="time budget for the whole check")
    p.add_argument("--batches", type=int, nargs="+", default=[128, 512])
    p.add_argument("--variants", nargs="+", default=VARIANTS, help=f"capsnet variants (default: {' '.join(VARIANTS)})")
    p.add_argument("--profile", action="store_true", help="profile a few training steps at each batch (after tests)")
    p.add_argument("--profile-variants", nargs="+", default=["fp32", "bf16"], help="the variants --profile profiles")
    p.add_argument("--smoke", action="store_true",
                   help="a dry run: 64 generated images, batch 32, a small CapsNet, 1 training epoch")  # fmt: skip
    p.add_argument("--skip-tests", action="store_true", help="do not run pytest -m cuda")
    p.add_argument("--skip-routing", action="store_true", help="do not run the routing benchmarks")
    p.add_argument("--no-accuracy", action="store_true", help="no Fashion-MNIST run: the epochs get all the time")
    args = p.parse_args(argv)
    for variant in {*args.variants, *args.profile_variants}:
        try:
            variant_options(variant)
        except ValueError as e:
            p.error(str(e))
    return args


def time_epochs(args, dataset: str, n: int, device: torch.device, model_config, until: float, report: dict,
                save) -> None:  # fmt: skip
    """The epoch table's rows (variants in order, both batches each) until `until` (perf_counter) into
    report["epochs"] (saved after each), and what was not timed for lack of time into report["skipped_for_time"]."""
    batches = [32] if args.smoke else args.batches
    for run in ("labml", *args.variants):
        for batch in batches:
            if time.perf_counter() > until:
                report["skipped_for_time"].append(f"{run} at batch {batch}")
                continue
            report["epochs"].append(timed_row(run, dataset, batch, device, n, model_config))
            print(json.dumps(report["epochs"][-1]), flush=True)
            save()


def run_check(args, device: torch.device, out: Path, t_start: float) -> dict:
    """Every part of the check in turn; OUT's JSON and markdown are rewritten after each (a run stopped early still
    leaves what it measured)."""
    budget = args.minutes * 60
    model_config = SMOKE_MODEL if args.smoke else None
    with tempfile.TemporaryDirectory(prefix="capsnet-gpu-check-data-") as tmp:
        dataset, described = epoch_data(args.smoke, Path(tmp))
        n = len(load_dataset(dataset).train)
        report = {"device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (smoke)",
                  "torch": torch.__version__, "triton": triton_version(), "data": described,
                  "bf16_native": bf16_native(device), "smoke": args.smoke, "minutes": args.minutes,
                  "tests": {"command": "not run yet", "exit_code": None, "counts": {}}, "profile": [], "routing": [],
                  "epochs": [], "skipped_for_time": [], "accuracy": {"skipped": "not reached"}}  # fmt: skip

        def save() -> None:
            report["seconds"] = time.perf_counter() - t_start
            (out / "gpu_check.json").write_text(json.dumps(report, indent=2) + "\n")
            (out / "gpu_check.md").write_text(markdown(report))

        if args.skip_tests:
            report["tests"] = {"command": "skipped", "exit_code": None, "counts": {}}
        else:
            report["tests"] = run_tests(args.device, timeout=max(0.3 * budget, 150.0), log=out / "pytest.log")
        save()
        batches = [32] if args.smoke else args.batches
        if args.profile:
            report["profile"] = run_profile(device, batches, args.profile_variants, args.smoke, dataset, model_config)
            save()
        # The epochs until 95% of the budget (70% with the accuracy run after them), less the routing benchmarks'.
        limit = 300.0 if args.smoke else 0.1 * budget  # each routing benchmark's (a smoke run's CPU may be busy)
        until = (0.95 if args.no_accuracy else 0.7) * budget - (0 if args.skip_routing else min(2 * limit, 90.0))
        until = float("inf") if args.smoke else t_start + until  # (a dry run times every row)
        time_epochs(args, dataset, n, device, model_config, until, report, save)
        report["routing"] = [] if args.skip_routing else run_routing(args.device, args.smoke, limit)
        save()
        capsnet_rows = [r for r in report["epochs"] if r["loop"] == "capsnet" and "error" not in r]
        left = max(30.0, budget - (time.perf_counter() - t_start) - 20.0)
        if args.no_accuracy or not capsnet_rows:
            report["accuracy"] = {"skipped": "--no-accuracy" if args.no_accuracy else "no capsnet variant ran"}
        else:
            best = max(capsnet_rows, key=lambda r: r["images_per_s"])
            report["accuracy"] = accuracy_run(best, device, left, args.smoke, dataset, model_config)
        save()
    return report


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("error: no CUDA GPU here; for a dry run on the CPU: --smoke --device cpu", file=sys.stderr)
        return 2
    if device.type != "cuda" and not args.smoke:
        print("error: the check needs --device cuda (or --smoke for a dry run)", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = run_check(args, device, out, time.perf_counter())
    print(markdown(report))
    routing_ok = all(r["exit_code"] == 0 for r in report["routing"])
    failed = [r for r in report["epochs"] + report["profile"] if "error" in r]
    return 0 if report["tests"]["exit_code"] in (0, 5, None) and routing_ok and not failed else 1  # 5: no test


def triton_version() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    return str(triton.__version__)


if __name__ == "__main__":
    sys.exit(main())
