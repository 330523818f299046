"""The model a command works on: `--checkpoint PATH` (a run folder or a save_pretrained folder) or
`--pretrained NAME:TAG` (weights shipped with capsnet; `capsnet models` lists them), `--pretrained URL#sha256=HEX`
(a published save_pretrained folder, downloaded into the cache: capsnet.models.hub) or `--pretrained
hf-hub:ORG/REPO[@REVISION]` (a Hugging Face Hub repository: capsnet.models.hf_hub)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from ..errors import ConfigError

CHECKPOINT_HELP = "run folder (uses best/, else last/) or save_pretrained folder"
PRETRAINED_HELP = (
    "weights shipped with capsnet, NAME:TAG (e.g. efficient-capsnet:mnist-sample; `capsnet models` lists "
    "them), a published save_pretrained folder, URL#sha256=HEX "
    "(HEX: sha256sum config.json model.safetensors | sha256sum), or a Hugging Face Hub repository, "
    "hf-hub:ORG/REPO[@REVISION] (a commit hash pins the files)"
)


def add_model_arguments(parser: argparse.ArgumentParser, *, repeat: str | None = None) -> None:
    """--checkpoint and --pretrained: exactly one of them, or with `repeat` (its help text) each repeatable, at
    least one in all."""
    if repeat:
        parser.add_argument(
            "--checkpoint", action="append", default=[], metavar="PATH", help=f"{CHECKPOINT_HELP}; {repeat}"
        )
        parser.add_argument("--pretrained", action="append", default=[], metavar="NAME:TAG", help=PRETRAINED_HELP)
        return
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--checkpoint", metavar="PATH", help=CHECKPOINT_HELP)
    group.add_argument("--pretrained", metavar="NAME:TAG", help=PRETRAINED_HELP)


def pretrained_folder(ref: str) -> Path:
    """The folder of the shipped weights NAME:TAG (ConfigError for an unknown model or tag), of a URL's, or of an
    hf-hub: reference's (in the Hub's cache)."""
    from ..models.hf_hub import fetch_hf, is_hf_ref
    from ..models.hub import fetch_pretrained, is_url, resolve_ref

    if is_hf_ref(ref):
        return fetch_hf(ref)[0]
    if is_url(ref):
        return fetch_pretrained(ref)
    if ":" not in ref:
        raise ConfigError(f"--pretrained {ref}: expected NAME:TAG, e.g. efficient-capsnet:mnist-sample")
    return resolve_ref(ref)


def model_paths(args: argparse.Namespace) -> list[str | os.PathLike]:
    """The checkpoints the arguments name: the --checkpoint paths, then the folders of the --pretrained weights."""
    checkpoints = args.checkpoint if isinstance(args.checkpoint, list) else [args.checkpoint]
    pretrained = args.pretrained if isinstance(args.pretrained, list) else [args.pretrained]
    paths: list[str | os.PathLike] = [c for c in checkpoints if c is not None]
    paths += [pretrained_folder(p) for p in pretrained if p is not None]
    if not paths:
        raise ConfigError("give --checkpoint PATH or --pretrained NAME:TAG")
    return paths
