"""Weights that ship inside the package, loaded offline by `create_model(NAME, pretrained=TAG)`,
`load_pretrained("NAME:TAG")` and `capsnet evaluate --pretrained NAME:TAG`; and save_pretrained folders published
at a URL (:func:`fetch_pretrained`).

    WEIGHTS_ROOT/<model name>/<tag>/config.json        a save_pretrained folder ...
                                   /model.safetensors
                                   /card.json          ... and how it was made (CARD_FIELDS)

WEIGHTS_ROOT is the package's `models/weights/` folder; the environment variable CAPSNET_WEIGHTS_DIR names another
root instead (tests, or a shared folder of weights). :func:`save_shipped` writes a folder with its card.

A URL names a save_pretrained folder on a web server, with the SHA-256 of its weights in the fragment:
`https://host/path/folder#sha256=<the 64 hex digits of sha256sum model.safetensors>`. Both files are downloaded
with :func:`capsnet.fetch.fetch_url` (retries, Content-Length, atomic writes, a lock) into the cache,
CACHE/pretrained/<sha256>/; the weights must have that SHA-256 (a URL without one is refused), and config.json is
read strictly and must fit them (the weights load strictly into the model it describes). A cached folder whose
weights still have the SHA-256 is used without asking the server again.
"""

from __future__ import annotations

import json
import os
import re
import urllib.parse
from pathlib import Path
from typing import Any

from ..errors import CheckpointError, ConfigError
from ..fetch import cache_root, fetch_url
from ..fileio import atomic_write_json

WEIGHTS_ROOT = Path(__file__).with_name("weights")
WEIGHTS_DIR_ENV = "CAPSNET_WEIGHTS_DIR"
CARD_NAME = "card.json"
# What a card records, and the type of each entry: the command that trained the weights, the data set, the accuracy
# on the validation split (that chose `epoch`) and on the test split, capsnet's version, and the MD5 of each data file.
CARD_FIELDS: dict[str, type | tuple[type, ...]] = {
    "command": str,
    "dataset": str,
    "val_accuracy": (int, float),
    "test_accuracy": (int, float),
    "epoch": int,
    "capsnet_version": str,
    "data_md5": dict,
}
_TAG = re.compile(r"[a-z0-9][a-z0-9._-]*")


def weights_root() -> Path:
    """Where shipped weights are looked up: $CAPSNET_WEIGHTS_DIR if set, else the package's WEIGHTS_ROOT."""
    return Path(os.environ.get(WEIGHTS_DIR_ENV) or WEIGHTS_ROOT)


def shipped_tags(name: str) -> list[str]:
    """The tags of the weights shipped for model `name` (its registered name), sorted; [] if none."""
    folder = weights_root() / name
    if not folder.is_dir():
        return []
    return sorted(p.name for p in folder.iterdir() if (p / "config.json").is_file())


def shipped_folder(name: str, tag: str) -> Path:
    """The folder of model `name`'s weights `tag`; ConfigError naming the shipped tags otherwise."""
    if tag not in shipped_tags(name):
        tags = ", ".join(shipped_tags(name)) or "none"
        raise ConfigError(f"no shipped weights {tag!r} for {name} (shipped: {tags})")
    return weights_root() / name / tag


def is_ref(text: str) -> bool:
    """Whether `text` reads as NAME:TAG (and is not an existing path)."""
    name, sep, tag = text.partition(":")
    return bool(sep and name and _TAG.fullmatch(tag)) and not Path(text).exists()


def resolve_ref(ref: str) -> Path:
    """The folder that "NAME:TAG" names (NAME: a registered model name or alias)."""
    from .registry import MODELS

    name, _, tag = ref.partition(":")
    return shipped_folder(MODELS.canonical(name), tag)


def is_url(text: Any) -> bool:
    """Whether `text` is an http(s) URL (of a published save_pretrained folder)."""
    return isinstance(text, str) and text.lower().startswith(("https://", "http://"))


def fetch_pretrained(url: str, *, cache_dir: str | os.PathLike | None = None) -> Path:
    """The save_pretrained folder published at `url` (`...#sha256=HEX`, see the module docstring), downloaded into
    capsnet's cache (:func:`capsnet.fetch.cache_root`) unless it is there already; returns the cached folder."""
    base, fragment = urllib.parse.urldefrag(url)
    sha256 = (urllib.parse.parse_qs(fragment).get("sha256") or [""])[0].lower()
    if not re.fullmatch(r"[0-9a-f]{64}", sha256):
        raise ConfigError(f"{url}: give the SHA-256 of the folder's model.safetensors in the URL, as "
                          "URL#sha256=<64 hex digits> (sha256sum model.safetensors); a URL without one is "
                          "refused")  # fmt: skip
    base = base.removesuffix("model.safetensors").removesuffix("config.json")
    base = base if base.endswith("/") else base + "/"
    folder = cache_root(cache_dir) / "pretrained" / sha256
    fetch_url(base + "model.safetensors", folder / "model.safetensors", sha256=sha256)
    config = fetch_url(base + "config.json", folder / "config.json")  # (kept when cached: named by the weights)
    try:
        meta = json.loads(config.read_text(encoding="utf-8"))
        fine = isinstance(meta, dict) and isinstance(meta.get("config"), dict) and "model_type" in meta
    except (UnicodeDecodeError, json.JSONDecodeError):
        fine = False
    if not fine:
        config.unlink()  # (not kept: the next try downloads it again)
        raise CheckpointError(f"{base}config.json: not the config.json of a save_pretrained folder")
    return folder


def resolve_pretrained(name: str, pretrained: str | os.PathLike) -> Path:
    """The save_pretrained folder that `create_model(name, pretrained=...)` loads: a shipped tag of model `name`,
    a URL of a published folder (:func:`fetch_pretrained`), or a folder (a save_pretrained folder, or a training
    run folder: its best/, else last/)."""
    if isinstance(pretrained, str) and pretrained in shipped_tags(name):
        return weights_root() / name / pretrained
    if is_url(pretrained):
        return fetch_pretrained(str(pretrained))
    folder = Path(pretrained).expanduser()
    if folder.is_dir():
        if not (folder / "model.safetensors").is_file():
            for sub in ("best", "last"):
                if (folder / sub / "config.json").is_file():
                    return folder / sub
        return folder
    tags = ", ".join(shipped_tags(name)) or "none"
    raise ConfigError(f"pretrained={str(pretrained)!r}: neither a shipped tag of {name} (shipped: {tags}) nor a folder")


def read_card(folder: str | os.PathLike) -> dict[str, Any] | None:
    """The card.json of a shipped folder, checked against CARD_FIELDS; None if the folder has none."""
    path = Path(folder) / CARD_NAME
    if not path.is_file():
        return None
    try:
        card = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None
    check_card(card, what=str(path))
    return card


def check_card(card: Any, *, what: str = "card") -> None:
    """CheckpointError unless `card` has every CARD_FIELDS entry, of its type, with accuracies in [0, 1]."""
    if not isinstance(card, dict):
        raise CheckpointError(f"{what}: expected a JSON object")
    missing = [k for k in CARD_FIELDS if k not in card]
    if missing:
        raise CheckpointError(f"{what}: missing {', '.join(missing)}")
    for key, kind in CARD_FIELDS.items():
        if not isinstance(card[key], kind) or isinstance(card[key], bool):
            raise CheckpointError(f"{what}: {key} has the wrong type ({type(card[key]).__name__})")
    if not all(0.0 <= card[k] <= 1.0 for k in ("val_accuracy", "test_accuracy")):
        raise CheckpointError(f"{what}: val_accuracy and test_accuracy must lie in [0, 1]")
    if card["epoch"] < 1 or not all(re.fullmatch(r"[0-9a-f]{32}", str(v)) for v in card["data_md5"].values()):
        raise CheckpointError(f"{what}: epoch must be >= 1 and data_md5 must map file names to MD5s")


def save_shipped(
    model: Any,
    *,
    name: str,
    tag: str,
    card: dict[str, Any],
    root: str | os.PathLike | None = None,
    metadata: dict[str, Any] | None = None,
) -> Path:
    """Write `model` (a registered model) as shipped weights: root/name/tag/ with config.json, model.safetensors
    and card.json (checked by :func:`check_card`). `root` defaults to :func:`weights_root`; `metadata`: the
    training run's record of the checkpoint (config.json's "checkpoint", see Pretrained.save_pretrained)."""
    from .registry import MODELS

    if type(model) is not MODELS[MODELS.canonical(name)]:
        raise ConfigError(f"a {type(model).__name__} cannot ship as {name}")
    if not _TAG.fullmatch(tag):
        raise ConfigError(f"tag {tag!r}: use lower-case letters, digits, '.', '_' and '-'")
    check_card(card, what=f"card of {name}:{tag}")
    folder = Path(root if root is not None else weights_root()) / MODELS.canonical(name) / tag
    model.save_pretrained(folder, metadata=metadata)
    atomic_write_json(folder / CARD_NAME, card)
    return folder


__all__ = [
    "CARD_FIELDS",
    "WEIGHTS_DIR_ENV",
    "WEIGHTS_ROOT",
    "fetch_pretrained",
    "is_url",
    "read_card",
    "resolve_pretrained",
    "save_shipped",
    "shipped_folder",
    "shipped_tags",
    "weights_root",
]
