"""Weights that ship inside the package, loaded offline by `create_model(NAME, pretrained=TAG)`,
`load_pretrained("NAME:TAG")` and `capsnet evaluate --pretrained NAME:TAG`; and save_pretrained folders published
at a URL (`fetch_pretrained`).

    WEIGHTS_ROOT/<model name>/<tag>/config.json        a save_pretrained folder ...
                                   /model.safetensors
                                   /card.json          ... and how it was made (CARD_FIELDS)

WEIGHTS_ROOT is the package's `models/weights/` folder; the environment variable CAPSNET_WEIGHTS_DIR names another
root instead (tests, or a shared folder of weights). `save_shipped` writes a folder with its card.

A URL names a save_pretrained folder on a web server, pinned as a whole by the SHA-256 in its fragment,
`https://host/path/folder#sha256=HEX`: HEX is `folder_sha256`, the SHA-256 of the folder's manifest (the
text `sha256sum config.json model.safetensors` prints), so `cd folder && sha256sum config.json model.safetensors |
sha256sum` gives it. Both files are downloaded with `capsnet.fetch.fetch_url` (retries, byte limits, a
deadline, atomic writes, a lock) into a fresh folder of the cache, which becomes CACHE/pretrained/<HEX>/ only when
the two files have that SHA-256. Files of another SHA-256 are fetched again, from scratch, FOLDER_FETCHES times in
all (a transient fault), then refused: an altered config.json (or weights) is refused and nothing is kept.
config.json is then read strictly and must fit the weights. A cached folder that still has the SHA-256 is used
without asking the server again.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import urllib.parse
from pathlib import Path
from typing import Any

from ..errors import CheckpointError, ConfigError, DownloadError
from ..fetch import cache_root, fetch_url, file_digest, url_problem
from ..fileio import atomic_write_json, staging_folder
from ..limits import CONFIG_DOWNLOAD_DEADLINE_S, MAX_CONFIG_DOWNLOAD_BYTES

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


# Registered models that ship no `mnist-sample` weights, and why (the README's model table prints it).
# docs/results.md gives the commands that make them.
NOT_SHIPPED: dict[str, str] = {
    "baseline": "35.4 M parameters, 71 MB in float16: more than the wheel holds",
    "deepcaps": "17 MB in float16 would take the shipped weights past their 45 MiB budget",
}


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


FOLDER_FILES = ("config.json", "model.safetensors")  # what a URL's SHA-256 covers, in the manifest's order
# How many times a folder is fetched before its files are called not the URL's: a fault that serves the right
# length of wrong bytes once (a proxy, a half-written file on the server) passes on the second fetch.
FOLDER_FETCHES = 2


def folder_sha256(folder: str | os.PathLike) -> str:
    """The SHA-256 that pins a save_pretrained folder in a URL: that of its manifest, one line `<sha256>  <name>` per
    file of FOLDER_FILES (what `sha256sum config.json model.safetensors` prints)."""
    manifest = "".join(f"{file_digest(Path(folder) / name, hashlib.sha256)}  {name}\n" for name in FOLDER_FILES)
    return hashlib.sha256(manifest.encode()).hexdigest()


def fetch_pretrained(url: str, *, cache_dir: str | os.PathLike | None = None) -> Path:
    """The save_pretrained folder published at `url` (`...#sha256=HEX`, see the module docstring), downloaded into
    capsnet's cache (`capsnet.fetch.cache_root`) unless it is there already; returns the cached folder."""
    problem = url_problem(url)
    if problem is not None:
        raise ConfigError(f"{url}: not a valid URL ({problem})")
    base, fragment = urllib.parse.urldefrag(url)
    sha256 = (urllib.parse.parse_qs(fragment).get("sha256") or [""])[0].lower()
    if not re.fullmatch(r"[0-9a-f]{64}", sha256):
        raise ConfigError(
            f"{url}: give the folder's SHA-256 in the URL, as URL#sha256=<64 hex digits> "
            "(sha256sum config.json model.safetensors | sha256sum); a URL without one is "
            "refused"
        )
    base = base.removesuffix("model.safetensors").removesuffix("config.json")
    base = base if base.endswith("/") else base + "/"
    root = cache_root(cache_dir) / "pretrained"
    folder = root / sha256
    if _pinned(folder, sha256):
        return folder
    for attempt in range(1, FOLDER_FETCHES + 1):
        with staging_folder(folder) as staging:  # (a failed try leaves nothing for the next one)
            got = _fetch_folder(base, staging)
            if got == sha256:
                if folder.exists():  # (a copy that lost its SHA-256: replaced)
                    shutil.rmtree(folder)
                with contextlib.suppress(OSError):  # (another process may have put the same folder there meanwhile)
                    os.replace(staging, folder)
                break
            if file_digest(staging / "model.safetensors", hashlib.sha256) == sha256:  # (no fetch can mend this)
                raise DownloadError(
                    f"{base}: the URL gives the SHA-256 of model.safetensors alone; a URL pins the "
                    "whole folder: compute it from the folder you published (sha256sum config.json "
                    "model.safetensors | sha256sum); nothing was kept",
                    url=url,
                    permanent=True,
                )
            if attempt == FOLDER_FETCHES:
                raise DownloadError(
                    f"{base}: the files served have SHA-256 {got}, not the URL's (config.json or the "
                    f"weights differ) (fetched {attempt} times); nothing was kept",
                    url=url,
                    permanent=True,
                )
    if not _pinned(folder, sha256):
        raise DownloadError(f"{folder}: the downloaded folder cannot be moved into the cache", url=url)
    return folder


def _fetch_folder(base: str, staging: Path) -> str:
    """Download the folder at `base` into `staging` (config.json first, checked before the weights are asked for);
    returns its `folder_sha256`."""
    fetch_url(
        base + "config.json",
        staging / "config.json",
        max_bytes=MAX_CONFIG_DOWNLOAD_BYTES,
        deadline=CONFIG_DOWNLOAD_DEADLINE_S,
    )
    _check_config(staging / "config.json", base)
    fetch_url(base + "model.safetensors", staging / "model.safetensors")
    return folder_sha256(staging)


def _pinned(folder: Path, sha256: str) -> bool:
    """Whether `folder` holds both files of FOLDER_FILES, with the SHA-256 `sha256`."""
    return all((folder / name).is_file() for name in FOLDER_FILES) and folder_sha256(folder) == sha256


def _check_config(config: Path, base: str) -> None:
    """CheckpointError unless `config` reads as a save_pretrained config.json (before the weights are fetched)."""
    try:
        meta = json.loads(config.read_text(encoding="utf-8"))
        fine = isinstance(meta, dict) and isinstance(meta.get("config"), dict) and "model_type" in meta
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        fine = False
    if not fine:
        raise CheckpointError(f"{base}config.json: not the config.json of a save_pretrained folder")


def resolve_pretrained(name: str, pretrained: str | os.PathLike) -> Path:
    """The save_pretrained folder that `create_model(name, pretrained=...)` loads: a shipped tag of model `name`,
    a URL of a published folder (`fetch_pretrained`), or a folder (a save_pretrained folder, or a training
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
    and card.json (checked by `check_card`). `root` defaults to `weights_root`; `metadata`: the
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
    "FOLDER_FILES",
    "WEIGHTS_DIR_ENV",
    "WEIGHTS_ROOT",
    "fetch_pretrained",
    "folder_sha256",
    "is_url",
    "read_card",
    "resolve_pretrained",
    "save_shipped",
    "shipped_folder",
    "shipped_tags",
    "weights_root",
]
