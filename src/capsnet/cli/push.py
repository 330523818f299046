"""`capsnet push --checkpoint PATH ORG/NAME`: a checkpoint published on the Hugging Face Hub (capsnet.models.hf_hub)
with a README.md model card made from how it was trained (capsnet.models.model_card).

PATH is a finished training run (its validation-chosen best/, with the card `tools/ship_weights.py` would write:
capsnet.tools.ship.ship_card, and the run's seed), a folder with a card.json (shipped weights), or a plain
save_pretrained folder (a card that claims no figure). The folder is loaded first, with every check of a load: what
goes up loads back. The token is huggingface_hub's (HF_TOKEN, `hf auth login`).
"""

from __future__ import annotations

import argparse
import json
import shlex
from pathlib import Path
from typing import Any

from ..errors import CheckpointError


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "push",
        description="Publish a checkpoint on the Hugging Face Hub: config.json, model.safetensors and a README.md "
        "model card (library_name: capsnet; the data set; validation and test accuracy as model-index results with "
        "the seeds, the validation protocol and the command). Needs the hub extra: pip install 'capsnet[hub]'; "
        "the token is huggingface_hub's (HF_TOKEN or `hf auth login`), the Hub HF_ENDPOINT's.",
    )
    p.add_argument(
        "--checkpoint",
        required=True,
        metavar="PATH",
        help="a finished training run (its best/), or a save_pretrained folder (with its card.json, if any)",
    )
    p.add_argument("repo", metavar="ORG/NAME", help="the Hub repository (created if it does not exist)")
    p.add_argument("--revision", metavar="BRANCH", help="the branch to commit to (default: the default branch)")
    p.add_argument("--private", action="store_true", help="create the repository private")
    p.add_argument("--message", metavar="TEXT", help="the commit message")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..models import hf_hub
    from ..models.model_card import render_card
    from ..models.pretrained import load_pretrained

    hf_hub.check_repo_id(args.repo, what="capsnet push")
    if args.revision is not None:
        hf_hub.parse_ref(f"{hf_hub.PREFIX}{args.repo}@{args.revision}")
    folder, card = checkpoint_card(Path(args.checkpoint))
    model = load_pretrained(folder)  # (every check of a load, before anything goes up)
    text = render_card(card, repo_id=args.repo, model_type=model.model_type, config_file=folder / "config.json")
    done = hf_hub.push_folder(
        folder,
        args.repo,
        card_text=text,
        revision=args.revision,
        private=args.private or None,
        commit_message=args.message,
    )
    print(f"pushed {folder} to {done['repo']}: commit {done['commit']} ({done['url']})")
    print(f"load it with --pretrained {done['ref']} (pinned), or hf-hub:{done['repo']} (the branch's latest)")
    return 0


def checkpoint_card(path: Path) -> tuple[Path, dict[str, Any] | None]:
    """The folder to publish and its card: a run's best/ and its ship card (with the run's seed), a folder and its
    card.json (the seed its command sets), or a folder without a card (None)."""
    from ..models.hub import read_card
    from ..tools.ship import ship_card
    from ..training.checkpoint import resolve_checkpoint

    if not path.is_dir():
        raise CheckpointError(f"{path}: not a folder (give a finished training run or a save_pretrained folder)")
    record = _run_record(path)
    if record is not None:
        card = ship_card(path)  # (CheckpointError for a run that did not finish or did not validate)
        return path / "best", {**card, "seeds": [int(record["train"].get("seed", 0))]}
    folder = resolve_checkpoint(path)
    shipped = read_card(folder)
    return folder, None if shipped is None else {**shipped, "seeds": [_command_seed(str(shipped["command"]))]}


def _run_record(path: Path) -> dict[str, Any] | None:
    """A training run's record (its config.json, with "train"), None for any other folder."""
    try:
        record = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and isinstance(record.get("train"), dict) else None


def _command_seed(command: str) -> int:
    """The training seed a recorded `capsnet train` command sets: its --seed, else TrainConfig's default."""
    import dataclasses

    from ..config import field_default
    from ..training.config import TrainConfig

    words = shlex.split(command)
    if "--seed" in words and words.index("--seed") + 1 < len(words):
        try:
            return int(words[words.index("--seed") + 1])
        except ValueError:
            pass
    return int(field_default(next(f for f in dataclasses.fields(TrainConfig) if f.name == "seed")))
