"""One-command GPU check: CUDA tests, epoch timings against the labml loop, and a Fashion-MNIST run.

    python benchmarks/gpu_check.py [--out gpu_check] [--minutes 8]      (or: make gpu-check)
    python benchmarks/gpu_check.py --smoke --device cpu                  (tiny sizes: checks the script itself)

On one GPU it takes under `--minutes` (8) and writes OUT/gpu_check.json and OUT/gpu_check.md (markdown tables):

1. tests: `pytest -m cuda` (tests/test_devices.py and every other CUDA-marked test: each routing path and model
   forward/backward on CUDA against CPU float64 references, bf16 autocast, torch.compile, save/load across
   devices, no host sync in the training step), with the counts of passed/failed/skipped;
2. epochs: one 60,000-image epoch (Fashion-MNIST's training set if it is on this machine, else generated 28×28
   images written as an MNIST-format folder) of `capsnet train` in fp32, bf16 and bf16 + torch.compile, and of the
   plain labml loop (benchmarks/bench_epoch.py, fp32), at batch 128 and 512: images/s, seconds per epoch and peak
   GPU memory. capsnet runs two epochs and reports the second (so compilation and warm-up are not timed);
   images/s excludes the test pass, as for the labml loop;
3. routing: benchmarks/bench_routing_algos.py (each routing layer against its paper's transcription) and
   benchmarks/bench_em.py (ConvCaps1 of the smallNORB model, EM routing in chunks against the transcription) on the
   device: speeds, peak memory and the largest difference of the results;
4. accuracy: `capsnet train` on full Fashion-MNIST in the fastest configuration from 2. for the minutes left,
   with the test accuracy of every epoch (skipped when Fashion-MNIST is not on this machine).
"""

from __future__ import annotations

import argparse
import json
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
from capsnet.training.hardware import bf16_native  # noqa: E402
from capsnet.training.loop import TrainConfig, train  # noqa: E402

SMOKE_MODEL = CapsNetConfig(conv_channels=16, primary_types=4, primary_dim=4, class_dim=6, decoder_hidden=(32, 64))
VARIANTS = {"fp32": ("fp32", False), "bf16": ("bf16", False), "bf16+compile": ("bf16", True)}


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
def run_tests(device: str, timeout: float) -> dict:
    """`pytest -m cuda`; on a machine without CUDA every case skips."""
    cmd = [sys.executable, "-m", "pytest", "-m", "cuda", "-q", "-p", "no:cacheprovider", str(HERE.parent / "tests")]
    t0 = time.perf_counter()
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=HERE.parent)
        output, code = r.stdout + r.stderr, r.returncode
    except subprocess.TimeoutExpired as e:
        raw = e.stdout or b""
        output, code = raw.decode(errors="replace") if isinstance(raw, bytes) else raw, -1
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|deselected|error)", output)}
    return {"command": "pytest -m cuda", "exit_code": code, "seconds": round(time.perf_counter() - t0, 1),
            "counts": counts, "tail": output.strip().splitlines()[-15:]}  # fmt: skip


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


def peak_memory(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def time_capsnet(dataset: str, batch: int, variant: str, device: torch.device, model_config) -> dict:
    precision, compile_ = VARIANTS[variant]
    reset_peak(device)
    with tempfile.TemporaryDirectory(prefix="capsnet-gpu-check-") as out:
        config = TrainConfig(dataset=dataset, batch_size=batch, epochs=2, lr_end=1.0, precision=precision,
                             compile=compile_, device=str(device), out=out, progress=False, tensorboard=False,
                             test_subset=1000)  # fmt: skip
        row = train(config, model_config).history[-1]  # the second epoch: warm, compiled
    return {"loop": "capsnet", "variant": variant, "batch": batch, "images_per_s": row["images_per_s"],
            "seconds": row["seconds"], "peak_mib": peak_memory(device)}  # fmt: skip


def time_labml(dataset: str, batch: int, device: torch.device, n: int) -> dict:
    reset_peak(device)
    rate = labml_epoch(batch, device, seed=0, dataset=dataset)
    return {"loop": "labml", "variant": "fp32", "batch": batch, "images_per_s": rate, "seconds": n / rate,
            "peak_mib": peak_memory(device)}  # fmt: skip


def accuracy_run(best: dict, device: torch.device, seconds_left: float, smoke: bool, dataset: str,
                 model_config) -> dict:  # fmt: skip
    """Train on full Fashion-MNIST in the fastest configuration until the time is up: validation accuracy per
    epoch, and (when the planned epochs finished) the test accuracy of the epoch chosen on validation."""
    if not smoke and dataset != "fashion-mnist":
        return {"skipped": "Fashion-MNIST is not on this machine (capsnet data fashion-mnist fetches it)"}
    epoch_s = best["seconds"] * 1.25 + 2.0  # + the test pass
    epochs = max(1, int(seconds_left // epoch_s)) if not smoke else 1
    precision, compile_ = VARIANTS[best["variant"]]
    deadline = time.perf_counter() + seconds_left
    with tempfile.TemporaryDirectory(prefix="capsnet-gpu-check-") as out:
        config = TrainConfig(dataset=dataset, batch_size=best["batch"], epochs=epochs, precision=precision,
                             compile=compile_, device=str(device), out=out, progress=False, tensorboard=False,
                             train_subset=64 if smoke else None, test_subset=64 if smoke else None)  # fmt: skip
        result = train(config, model_config, on_step=lambda _: time.perf_counter() > deadline)
    return {"batch": best["batch"], "variant": best["variant"], "epochs_planned": epochs,
            "interrupted": result.interrupted,
            "val_acc": [round(r["val_acc"], 4) for r in result.history],
            "test": result.test,
            "seconds": [round(r["seconds"], 2) for r in result.history]}  # fmt: skip


# ------------------------------------------------------------------------------------------- report
def markdown(report: dict) -> str:
    lines = [f"# GPU check: {report['device_name']}", "", f"torch {report['torch']}, data: {report['data']}, "
             f"bf16 native: {report['bf16_native']}, total {report['seconds']:.0f} s", ""]  # fmt: skip
    tests = report["tests"]
    lines += [f"Tests (`{tests['command']}`): exit {tests['exit_code']}, {tests['counts']}", ""]
    for run in report["routing"]:
        lines += [f"`{run['command']}`: exit {run['exit_code']}, {run['seconds']} s", "", "```", *run["output"],
                  "```", ""]  # fmt: skip
    lines += ["| loop | precision | batch | images/s | s per epoch | vs labml | peak MiB |",
              "|---|---|---:|---:|---:|---:|---:|"]  # fmt: skip
    labml = {r["batch"]: r["images_per_s"] for r in report["epochs"] if r["loop"] == "labml"}
    for r in report["epochs"]:
        ratio = r["images_per_s"] / labml[r["batch"]] if r["batch"] in labml else float("nan")
        mem = f"{r['peak_mib']:.0f}" if r["peak_mib"] is not None else "-"
        lines.append(f"| {r['loop']} | {r['variant']} | {r['batch']} | {r['images_per_s']:.0f} | "
                     f"{r['seconds']:.2f} | {ratio:.2f}x | {mem} |")  # fmt: skip
    if report["skipped_for_time"]:
        lines += ["", f"Not timed (over 70% of the time budget): {', '.join(report['skipped_for_time'])}"]
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="gpu_check", help="folder for gpu_check.json and gpu_check.md")
    p.add_argument("--device", default="cuda", help="cuda (the check) or cpu (with --smoke)")
    p.add_argument("--minutes", type=float, default=8.0, help="time budget for the whole check")
    p.add_argument("--batches", type=int, nargs="+", default=[128, 512])
    p.add_argument("--smoke", action="store_true",
                   help="a dry run: 64 generated images, batch 32, a small CapsNet, 1 training epoch")  # fmt: skip
    p.add_argument("--skip-tests", action="store_true", help="do not run pytest -m cuda")
    p.add_argument("--skip-routing", action="store_true", help="do not run the routing benchmarks")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("error: no CUDA GPU here; for a dry run on the CPU: --smoke --device cpu", file=sys.stderr)
        return 2
    if device.type != "cuda" and not args.smoke:
        print("error: the check needs --device cuda (or --smoke for a dry run)", file=sys.stderr)
        return 2
    t_start = time.perf_counter()
    budget = args.minutes * 60
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    batches = [32] if args.smoke else args.batches
    model_config = SMOKE_MODEL if args.smoke else None
    with tempfile.TemporaryDirectory(prefix="capsnet-gpu-check-data-") as tmp:
        dataset, described = epoch_data(args.smoke, Path(tmp))
        n = len(load_dataset(dataset).train)
        report = {"device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (smoke)",
                  "torch": torch.__version__, "data": described, "bf16_native": bf16_native(device),
                  "smoke": args.smoke, "minutes": args.minutes}  # fmt: skip
        report["tests"] = (
            {"command": "skipped", "exit_code": None, "counts": {}}
            if args.skip_tests
            else run_tests(args.device, timeout=0.3 * budget)
        )
        limit = 300.0 if args.smoke else 0.1 * budget  # (a smoke run's CPU may be busy with other tests)
        report["routing"] = [] if args.skip_routing else run_routing(args.device, args.smoke, limit)
        epochs, skipped = [], []
        for batch in batches:
            for run in ("labml", *VARIANTS):
                if time.perf_counter() - t_start > 0.7 * budget:  # keep time for the accuracy run
                    skipped.append(f"{run} at batch {batch}")
                    continue
                if run == "labml":
                    epochs.append(time_labml(dataset, batch, device, n))
                else:
                    epochs.append(time_capsnet(dataset, batch, run, device, model_config))
                print(json.dumps(epochs[-1]), flush=True)
        report["epochs"], report["skipped_for_time"] = epochs, skipped
        capsnet_rows = [r for r in epochs if r["loop"] == "capsnet"]
        best = max(capsnet_rows, key=lambda r: r["images_per_s"])
        left = max(30.0, budget - (time.perf_counter() - t_start) - 20.0)
        report["accuracy"] = accuracy_run(best, device, left, args.smoke, dataset, model_config)
    report["seconds"] = time.perf_counter() - t_start
    (out / "gpu_check.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "gpu_check.md").write_text(markdown(report))
    print(markdown(report))
    routing_ok = all(r["exit_code"] == 0 for r in report["routing"])
    return 0 if report["tests"]["exit_code"] in (0, 5, None) and routing_ok else 1  # 5: pytest collected no test


if __name__ == "__main__":
    sys.exit(main())
