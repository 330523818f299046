"""One entry of `capsnet compare`, in its own process: train it, then measure its validation-chosen checkpoint.

    python -m capsnet.experiments.measure SPEC_JSON

SPEC is {"model", "overrides" (model config fields), "train" (TrainConfig fields), "infer_batch", "infer_seconds"}.
The run trains with capsnet.training (best/ chosen on the validation split, the test split scored once), then best/
is measured:

- test accuracy: the run's test.json (best/ on the test split, scored once);
- accuracy on the same test images under one fixed random affine transform (capsnet.data.augment.AFFINE_TEST, as
  `capsnet reproduce zoo` measures it), which training never saw beyond its shifts;
- trainable parameters; training images/s (the mean over epochs); inference images/s at batch 1 and at
  `infer_batch` (eval mode, no gradients, inputs prepared beforehand), each timed for `infer_seconds`;
- peak memory in MiB: on CUDA torch.cuda.max_memory_allocated over the process, on CPU the process's maximum
  resident set (training included);
- routing spread: how far the class capsules' routing weights move from uniform (capsnet.routing.base.weight_spread,
  mean over the test images), for models whose forward takes `return_coupling`.

Every input goes through the model's input recipe (capsnet.models.recipe.model_input). The last line printed is
RESULT_PREFIX followed by the measurement as JSON; an error is one line on stderr and exit status 2.
"""

from __future__ import annotations

import inspect
import json
import resource
import sys
import time
from pathlib import Path
from typing import Any

import torch

from ..config import from_dict
from ..data.augment import affine_test_images
from ..data.scaling import channel_stats
from ..data.split import Split
from ..errors import CapsNetError
from ..models.pretrained import load_pretrained
from ..models.recipe import model_input
from ..models.registry import MODELS
from ..routing.base import weight_spread
from ..training.api import train
from ..training.checkpoint_data import checkpoint_data
from ..training.config import TrainConfig
from ..training.evaluator import evaluate, standardizes_channels
from ..training.hardware import resolve_device
from .zoo import device_name, git_commit

RESULT_PREFIX = "capsnet-compare-result: "
INFER_BATCH = 100  # the batch of the batched inference speed
INFER_SECONDS = 1.0  # how long each inference speed is timed (at least three passes)


def run(spec: dict[str, Any]) -> dict[str, Any]:
    """Train the entry `spec` describes and measure its best/ checkpoint."""
    config = TrainConfig(model=spec["model"], **spec["train"])
    config_class = MODELS[config.model].config_class
    overrides = spec.get("overrides") or {}
    model_config = from_dict(config_class, overrides, what=f"--model {config.model}") if overrides else None
    device = resolve_device(config.device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    result = train(config, model_config)
    if result.interrupted or not result.test:
        raise CapsNetError(f"{config.out}: the run stopped before its test")
    run_dir = Path(config.out)
    recorded = json.loads((run_dir / "config.json").read_text(encoding="utf-8"))
    model = load_pretrained(run_dir / "best", map_location=device)
    data = checkpoint_data(model, [run_dir / "best"], n_classes=model.config.n_classes)
    test, train_split = data.test, data.train
    assert test is not None and train_split is not None  # (the run used both)
    if config.test_subset is not None:
        test = Split(test.images[: config.test_subset], test.labels[: config.test_subset], test.channel_stats)
    validation = recorded.get("validation") or {}
    held_out = validation.get("source", "").startswith("held out")
    n_train = min(len(train_split), config.train_subset or len(train_split)) - (
        validation.get("n", 0) if held_out else 0
    )
    batch, seconds = int(spec.get("infer_batch", INFER_BATCH)), float(spec.get("infer_seconds", INFER_SECONDS))
    return {
        "test_acc": result.best_test_acc,
        "affine_acc": evaluate(model, affine_split(test), batch_size=config.eval_batch_size, device=device)["accuracy"],
        "protocol": protocol(result.test),
        "params": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "train_images": n_train,
        "val_images": validation.get("n", 0),
        "test_images": len(test),
        "epochs": result.epochs_done,
        "batch_size": recorded["train"]["batch_size"],
        "precision": config.precision,
        "train_img_s": sum(r["images_per_s"] for r in result.history) / max(1, len(result.history)),
        "infer_img_s_b1": inference_speed(model, test, 1, device, seconds),
        "infer_img_s_batch": inference_speed(model, test, batch, device, seconds),
        "infer_batch": batch,
        "peak_mem_mb": peak_memory_mb(device),
        "routing_spread": routing_spread(model, test, device),
        "cpu": device_name(device),
        "torch": torch.__version__,
        "commit": git_commit(),
        "note": "peak memory: "
        + ("torch.cuda.max_memory_allocated" if device.type == "cuda" else "the process's maximum resident set"),
    }


def protocol(test: dict[str, Any]) -> str:
    """How the scored checkpoint was chosen, in the results data's words."""
    chosen = test.get("selected_on") or "?"
    if str(chosen).startswith("test_"):
        return f"best/ on {chosen} (no validation split): a maximum over epochs"
    return f"best/ on {chosen}, test scored once"


def affine_split(test: Split) -> Split:
    """`test`'s images under AFFINE_TEST (the same draw as `capsnet reproduce zoo`'s), labels and statistics kept."""
    return Split(affine_test_images(test.images), test.labels, test.channel_stats)


def _inputs(model: torch.nn.Module, split: Split, n: int, device: torch.device) -> torch.Tensor:
    """The model's input for the first `n` images of `split` (cycled when it has fewer)."""
    index = torch.arange(n) % len(split)
    stats = channel_stats(split) if standardizes_channels(model) else None
    return model_input(model, split.images[index].to(device), stats=stats)


@torch.no_grad()
def inference_speed(
    model: torch.nn.Module, split: Split, batch: int, device: torch.device, seconds: float = INFER_SECONDS
) -> float:
    """Images per second of `model`'s forward at `batch` in eval mode: two warm-up passes, then passes for about
    `seconds` (at least three)."""
    model.eval()
    x = _inputs(model, split, batch, device)
    for _ in range(2):
        model(x)
    _sync(device)
    passes, start = 0, time.perf_counter()
    while passes < 3 or time.perf_counter() - start < seconds:
        model(x)
        passes += 1
        _sync(device)
    return passes * batch / (time.perf_counter() - start)


@torch.no_grad()
def routing_spread(model: torch.nn.Module, split: Split, device: torch.device, batch: int = 100) -> float | None:
    """Mean weight spread of the class capsules' routing over `split`; None for a model without routing weights."""
    if "return_coupling" not in inspect.signature(model.forward).parameters:
        return None
    model.eval()
    stats = channel_stats(split) if standardizes_channels(model) else None
    total, n = 0.0, 0
    for start in range(0, len(split), batch):
        x = model_input(model, split.images[start : start + batch].to(device), stats=stats)
        coupling = model(x, return_coupling=True).coupling
        if coupling is None:
            return None
        total += weight_spread(coupling) * len(x)
        n += len(x)
    return total / max(n, 1)


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main(argv: list[str]) -> int:
    try:
        measured = run(json.loads(argv[0]))
    except (CapsNetError, OSError) as e:
        print(str(e).replace("\n", " "), file=sys.stderr)
        return 2
    print(RESULT_PREFIX + json.dumps(measured), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
