"""The README.md model card a published capsnet model carries on the Hugging Face Hub, made from its card.json fields
(capsnet.models.hub.CARD_FIELDS: command, data set, validation and test accuracy, epoch, version, data MD5s).

The card's metadata (the YAML block the Hub reads) says `library_name: capsnet`, the tags, the data set, and the
accuracies as `model-index` results whose metric `args` hold the seeds, the validation protocol and the command;
its text says how to load the model and how it was made. Without a card, only what the weights are, no figure.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .hf_hub import PREFIX, hub_module

TAGS = ["capsnet", "capsule-network", "image-classification", "pytorch", "safetensors"]
# The data sets whose Hub copy holds the same images and labels as capsnet's reader of that name (as the Hub names
# them); the others are named by capsnet's name alone.
HUB_DATASETS = {
    "mnist": "ylecun/mnist",
    "fashion-mnist": "zalando-datasets/fashion_mnist",
    "cifar10": "uoft-cs/cifar10",
    "cifar100": "uoft-cs/cifar100",
    "svhn": "ufldl-stanford/svhn",
}


def render_card(card: dict[str, Any] | None, *, repo_id: str, model_type: str, config_file: str | Path) -> str:
    """README.md for Hub repository `repo_id` holding a `model_type` model whose config.json is `config_file`, from
    `card` (a card.json's fields, plus "seeds": the training seeds, when known); None: no figures."""
    hub = hub_module()
    checkpoint = _checkpoint_record(config_file)
    tags = [*TAGS, model_type]
    if card is None:
        data = hub.ModelCardData(library_name="capsnet", tags=tags, pipeline_tag="image-classification")
        return (
            f"---\n{data.to_yaml()}\n---\n\n{_usage(repo_id, model_type)}\nNo card records how these weights "
            "were made: no accuracy is claimed for them.\n"
        )
    dataset = str(card["dataset"])
    hub_dataset = HUB_DATASETS.get(dataset)
    args = {
        "seeds": list(card.get("seeds") or []),
        "validation": card.get("validation") or {},
        "epoch": card["epoch"],
        "selected_on": checkpoint.get("selected_on", "val_acc"),
        "command": card["command"],
    }
    results = [
        hub.EvalResult(
            task_type="image-classification",
            dataset_type=hub_dataset or dataset,
            dataset_name=dataset,
            dataset_split=split,
            metric_type="accuracy",
            metric_value=float(card[key]),
            metric_name=name,
            metric_args=args,
            verified=False,
        )
        for split, key, name in (
            ("test", "test_accuracy", "test accuracy"),
            ("validation", "val_accuracy", "validation accuracy"),
        )
    ]
    data = hub.ModelCardData(
        library_name="capsnet",
        tags=tags,
        pipeline_tag="image-classification",
        datasets=[hub_dataset] if hub_dataset else None,
        model_name=repo_id,
        eval_results=results,
    )
    return f"---\n{data.to_yaml()}\n---\n\n{_usage(repo_id, model_type)}\n{_how_made(card, checkpoint)}"


def _checkpoint_record(config_file: str | Path) -> dict[str, Any]:
    """config.json's "checkpoint" record (which epoch, chosen on what), {} when it has none."""
    try:
        meta = json.loads(Path(config_file).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    record = meta.get("checkpoint") if isinstance(meta, dict) else None
    return record if isinstance(record, dict) else {}


def _usage(repo_id: str, model_type: str) -> str:
    return (
        f"# {repo_id}\n\nA `{model_type}` model of capsnet, capsule networks for PyTorch: `config.json` and "
        f"`model.safetensors` as `save_pretrained` writes them.\n\n"
        f'```python\nimport capsnet\n\nmodel = capsnet.load_pretrained("{PREFIX}{repo_id}")  # or '
        f"@REVISION: a commit hash pins the files\n```\n\n"
        f"```sh\ncapsnet predict --pretrained {PREFIX}{repo_id} image.png\n```\n"
    )


def _how_made(card: dict[str, Any], checkpoint: dict[str, Any]) -> str:
    validation = card.get("validation") or {}
    if validation.get("source") == "held out of the training split":
        held = (
            f"{validation.get('fraction', 0):.0%} of the training split held out, stratified, seed "
            f"{validation.get('seed')} ({validation.get('n', '?'):,} images)"
        )
    else:
        held = str(validation.get("source", "not recorded"))
    seeds = ", ".join(str(s) for s in card.get("seeds") or []) or "not recorded"
    test_n = f" on {card['test_n']:,} images" if isinstance(card.get("test_n"), int) else ""
    rows = [
        ("data set", f"`{card['dataset']}`"),
        ("command", f"`{card['command']}`"),
        ("training seeds", seeds),
        ("validation split", held),
        (
            "checkpoint",
            f"epoch {card['epoch']}, chosen on {checkpoint.get('selected_on', 'val_acc')} of the validation split",
        ),
        ("validation accuracy", f"{card['val_accuracy']:.2%}"),
        ("test accuracy", f"{card['test_accuracy']:.2%}{test_n}, that checkpoint's, measured once at the end"),
        ("capsnet", str(card.get("capsnet_version", "unknown"))),
    ]
    table = "\n".join(f"| {k} | {v} |" for k, v in rows)
    md5 = "\n".join(f"- `{name}`: `{value}`" for name, value in sorted((card.get("data_md5") or {}).items()))
    return f"## How it was made\n\n| | |\n|---|---|\n{table}\n\nThe data's files (MD5):\n\n{md5}\n"


__all__ = ["HUB_DATASETS", "TAGS", "render_card"]
