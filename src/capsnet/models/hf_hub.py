"""Models on the Hugging Face Hub: `hf-hub:ORG/REPO[@REVISION]` loaded (`fetch_hf`), and a save_pretrained
folder published with its model card (`push_folder`), both through `huggingface_hub` (the `hub` extra).

    create_model("capsnet", pretrained="hf-hub:ORG/REPO")          # the default branch, resolved once
    load_pretrained("hf-hub:ORG/REPO@v1.0")                         # a tag or branch, resolved once
    load_pretrained("hf-hub:ORG/REPO@<40 hex digits>")              # a commit: the files are pinned
    model.push_to_hub("ORG/REPO")                                   # config.json, model.safetensors, README.md

huggingface_hub does the talking: its cache (HF_HUB_CACHE, HF_HOME), its endpoint (HF_ENDPOINT), its offline mode
(HF_HUB_OFFLINE) and its token (HF_TOKEN, `hf auth login`). capsnet adds the checks of a local folder and the order:

1. the reference is checked before any request: ORG/REPO as the Hub spells names, a revision of the characters git
   allows in a ref, with no `..` (it names a file of the cache's refs/ folder);
2. the revision is resolved to a commit once (`HfApi.resolve_revision`; offline, from the cache's refs/), so that
   both files come from that commit, recorded in the model's `provenance`;
3. unless both files of that commit are in the cache (then nothing more is asked), the repository's file list at
   that commit (at most MAX_HUB_FILES entries) must hold config.json and model.safetensors within the byte limits
   (capsnet.limits) before either is downloaded, by commit (`hf_hub_download`);
4. the folder is loaded as a local folder is: config.json strictly, the weights' names, shapes, kinds and
   finiteness against it, the parameter count against MAX_PARAMETERS.

README.md (the card) is never read to load a model. Every failure is one line (`capsnet.errors.DownloadError`
or ConfigError): a missing repository, revision or file, a refused token, offline with nothing cached.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import CapsNetError, CheckpointError, ConfigError, DownloadError
from ..limits import CONFIG_FILE_BYTES, MAX_DOWNLOAD_BYTES, MAX_HUB_FILES

PREFIX = "hf-hub:"
REPO_FILES = ("config.json", "model.safetensors")  # what a capsnet repository holds for loading (the card aside)
CARD_FILE = "README.md"
COMMIT = re.compile(r"[0-9a-f]{40}")
# The Hub's names (huggingface_hub's validate_repo_id, ORG/NAME required here): letters, digits, "-", "_", ".", at
# most 96 characters a part, no "--" or "..", not starting or ending with "-" or ".".
_PART = re.compile(r"(?!.*(--|\.\.))[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9])?")
# A branch, tag or pull-request ref (refs/pr/1): parts of git's ref characters joined by "/", no ".." anywhere.
_REVISION = re.compile(r"(?!.*\.\.)(?!.*\.lock(/|$))[A-Za-z0-9_][A-Za-z0-9._-]*(/[A-Za-z0-9_][A-Za-z0-9._-]*)*")
log = logging.getLogger("capsnet")


@dataclass(frozen=True)
class HubRef:
    """A checked `hf-hub:` reference: the repository and the revision asked for (None: the default branch)."""

    repo_id: str
    revision: str | None = None

    def __str__(self) -> str:
        return PREFIX + self.repo_id + (f"@{self.revision}" if self.revision else "")


def is_hf_ref(text: Any) -> bool:
    """Whether `text` is an `hf-hub:` reference (well-formed or not: `parse_ref` says what is wrong)."""
    return isinstance(text, str) and text.startswith(PREFIX)


def check_repo_id(repo_id: str, *, what: str) -> str:
    """`repo_id` if it is ORG/NAME as the Hub spells names; ConfigError otherwise."""
    parts = repo_id.split("/")
    if len(parts) != 2 or not all(_PART.fullmatch(p) for p in parts) or repo_id.endswith(".git"):
        raise ConfigError(
            f"{what}: {repo_id!r} is not a repository ORG/NAME (letters, digits, '-', '_', '.'; at "
            "most 96 characters each; no '--' or '..')"
        )
    return repo_id


def parse_ref(text: str) -> HubRef:
    """The repository and revision of `hf-hub:ORG/REPO[@REVISION]`; ConfigError, before any request, for a malformed
    name or a revision that is not a commit, branch or tag name (a path such as `../../x` among them)."""
    body = text[len(PREFIX) :] if text.startswith(PREFIX) else text
    shown = text if text.isprintable() else repr(text)
    repo_id, at, revision = body.partition("@")
    check_repo_id(repo_id, what=shown)
    if at and (len(revision) > 255 or not _REVISION.fullmatch(revision)):
        raise ConfigError(
            f"{shown}: {revision!r} is not a revision (a commit hash, or a branch or tag name of letters, "
            "digits, '.', '_', '-' and '/', without '..')"
        )
    return HubRef(repo_id, revision or None)


def hub_module() -> Any:
    """huggingface_hub, imported on first use (with its `constants` and `errors`); ConfigError with the install line
    when it is missing."""
    try:
        for name in ("huggingface_hub.constants", "huggingface_hub.errors"):
            importlib.import_module(name)
        return importlib.import_module("huggingface_hub")
    except ImportError:
        raise ConfigError("the Hugging Face Hub needs huggingface_hub: pip install 'capsnet[hub]'") from None


def fetch_hf(text: str) -> tuple[Path, dict[str, Any]]:
    """The folder of config.json and model.safetensors that `hf-hub:ORG/REPO[@REVISION]` names, in huggingface_hub's
    cache (downloaded unless there), and its provenance: {"source", "repo", "revision", "commit", "pinned"}."""
    ref = parse_ref(text)
    hub = hub_module()
    api = hub.HfApi()
    offline = bool(hub.constants.HF_HUB_OFFLINE)
    with hub_errors(ref, offline=offline):
        commit = str(api.resolve_revision(ref.repo_id, revision=ref.revision).resolved)
        if not COMMIT.fullmatch(commit):
            raise DownloadError(f"{ref}: the Hub resolved it to {commit[:60]!r}, not a commit hash", url=str(ref))
        cached = [hub.try_to_load_from_cache(ref.repo_id, name, revision=commit) for name in REPO_FILES]
        if all(isinstance(path, str) for path in cached):  # (a commit's files never change: no request)
            paths = [Path(path) for path in cached]
        else:
            if not offline:
                check_listing(ref, _listing(api, ref, commit))
            paths = [Path(hub.hf_hub_download(ref.repo_id, name, revision=commit)) for name in REPO_FILES]
    folder = paths[0].parent
    if any(p.parent != folder for p in paths):  # (both files of one commit share its snapshot folder)
        raise DownloadError(f"{ref}: its files did not land in one snapshot folder of the cache", url=str(ref))
    pinned = ref.revision is not None and COMMIT.fullmatch(ref.revision) is not None
    if not pinned:
        log.debug("%s: commit %s", ref, commit)  # (the provenance is in the model's .provenance)
    provenance = {
        "source": str(ref),
        "repo": ref.repo_id,
        "revision": ref.revision or "main",
        "commit": commit,
        "pinned": pinned,
    }
    return folder, provenance


def _listing(api: Any, ref: HubRef, commit: str) -> dict[str, Any]:
    """path -> entry of the repository's top folder at `commit`, read page by page: at most MAX_HUB_FILES entries."""
    entries: dict[str, Any] = {}
    for entry in api.list_repo_tree(ref.repo_id, revision=commit):
        entries[str(entry.path)] = entry
        if len(entries) > MAX_HUB_FILES:
            raise DownloadError(
                f"{ref}: the repository lists more than {MAX_HUB_FILES:,} files (MAX_HUB_FILES); a "
                "capsnet repository holds config.json, model.safetensors and README.md",
                url=str(ref),
            )
    return entries


def check_listing(ref: HubRef, entries: dict[str, Any]) -> None:
    """CheckpointError unless the listing holds REPO_FILES as files within their byte limits."""
    missing = [name for name in REPO_FILES if type(entries.get(name)).__name__ != "RepoFile"]  # (not a folder)
    if missing:
        held = ", ".join(sorted(entries)[:8]) + (", ..." if len(entries) > 8 else "") or "nothing"
        raise CheckpointError(
            f"{ref}: no {' or '.join(missing)} (a capsnet repository holds config.json and "
            f"model.safetensors; this one holds {held})"
        )
    for name, limit, limit_name in (
        ("config.json", CONFIG_FILE_BYTES, "CONFIG_FILE_BYTES"),
        ("model.safetensors", MAX_DOWNLOAD_BYTES, "MAX_DOWNLOAD_BYTES"),
    ):
        size = entries[name].size
        if not isinstance(size, int) or isinstance(size, bool) or not 0 < size <= limit:
            listed = f"{size:,}" if isinstance(size, int) else repr(size)
            raise CheckpointError(
                f"{ref}: {name} is listed with {listed} bytes; a file to load has 1 to {limit:,} bytes ({limit_name})"
            )


@contextlib.contextmanager
def hub_errors(ref: HubRef | str, *, offline: bool = False) -> Iterator[None]:
    """huggingface_hub's failures as one line each (DownloadError), naming `ref`."""
    hub = hub_module()
    errors = hub.errors
    import httpx2

    where = f"the Hub at {hub.constants.ENDPOINT}"
    try:
        yield
    except CapsNetError:
        raise
    except errors.GatedRepoError:
        raise DownloadError(
            f"{ref}: a gated repository; accept its conditions on {where} and log in (HF_TOKEN or `hf auth login`)",
            url=str(ref),
            permanent=True,
        ) from None
    except errors.RepositoryNotFoundError:
        raise DownloadError(
            f"{ref}: no such repository on {where} (or a private one: give a token that may read "
            "it, HF_TOKEN or `hf auth login`)",
            url=str(ref),
            permanent=True,
        ) from None
    except errors.RevisionNotFoundError:
        raise DownloadError(f"{ref}: no such revision on {where}", url=str(ref), permanent=True) from None
    except errors.RemoteEntryNotFoundError as e:
        raise DownloadError(
            f"{ref}: a file is missing from the repository ({_first_line(e)})", url=str(ref), permanent=True
        ) from None
    except (errors.LocalEntryNotFoundError, errors.RevisionResolutionError, errors.OfflineModeIsEnabled) as e:
        why = "HF_HUB_OFFLINE is set" if offline else f"{where} cannot be reached ({_first_line(e.__cause__ or e)})"
        raise DownloadError(
            f"{ref}: not in the Hub cache ({hub.constants.HF_HUB_CACHE}) and {why}", url=str(ref)
        ) from None
    except errors.HfHubHTTPError as e:
        status = e.response.status_code if e.response is not None else None
        if status == 401:
            raise DownloadError(
                f"{ref}: {where} refused the token (HTTP 401: {_server_message(e)}); give another "
                "(HF_TOKEN or `hf auth login`)",
                url=str(ref),
                permanent=True,
            ) from None
        if status == 403:
            raise DownloadError(
                f"{ref}: the token may not do this (HTTP 403: {_server_message(e)})", url=str(ref), permanent=True
            ) from None
        raise DownloadError(f"{ref}: HTTP {status} from {where} ({_server_message(e)})", url=str(ref)) from None
    except httpx2.HTTPError as e:
        raise DownloadError(
            f"{ref}: {where} cannot be reached ({type(e).__name__}: {_first_line(e)})", url=str(ref)
        ) from None
    except (ValueError, KeyError) as e:  # huggingface_hub's words for a response it cannot read
        raise DownloadError(
            f"{ref}: {where} answered what huggingface_hub cannot read ({_first_line(e)})", url=str(ref)
        ) from None


def _first_line(e: BaseException) -> str:
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    return lines[0][:300] if lines else type(e).__name__


def _server_message(e: Any) -> str:
    """What the Hub said about a failed request: its X-Error-Message header, else the error's first line."""
    message = e.response.headers.get("X-Error-Message") if e.response is not None else None
    return str(message)[:300] if message else _first_line(e)


def push_folder(
    folder: str | Path,
    repo_id: str,
    *,
    card_text: str,
    revision: str | None = None,
    private: bool | None = None,
    token: str | None = None,
    commit_message: str | None = None,
) -> dict[str, str]:
    """Publish a save_pretrained `folder` as Hub repository `repo_id`: its config.json and model.safetensors as they
    are, and README.md `card_text`, in one commit (the repository is created if need be). Returns {"repo", "commit",
    "url", "ref"}, `ref` the `hf-hub:` reference pinned to the new commit."""
    check_repo_id(repo_id, what="push")
    if revision is not None:
        parse_ref(f"{PREFIX}{repo_id}@{revision}")
    folder = Path(folder)
    missing = [name for name in REPO_FILES if not (folder / name).is_file()]
    if missing:
        raise CheckpointError(f"{folder}: no {' or '.join(missing)} (not a save_pretrained folder)")
    hub = hub_module()
    api = hub.HfApi(token=token)
    operations = [hub.CommitOperationAdd(path_in_repo=name, path_or_fileobj=str(folder / name)) for name in REPO_FILES]
    operations.append(hub.CommitOperationAdd(path_in_repo=CARD_FILE, path_or_fileobj=card_text.encode("utf-8")))
    with hub_errors(repo_id):
        api.create_repo(repo_id, private=private, exist_ok=True)
        info = api.create_commit(
            repo_id, operations, commit_message=commit_message or "Upload a capsnet model", revision=revision
        )
    commit = str(info.oid)
    return {"repo": repo_id, "commit": commit, "url": str(info.commit_url), "ref": f"{PREFIX}{repo_id}@{commit}"}


__all__ = [
    "CARD_FILE",
    "PREFIX",
    "REPO_FILES",
    "HubRef",
    "check_repo_id",
    "fetch_hf",
    "hub_errors",
    "is_hf_ref",
    "parse_ref",
    "push_folder",
]
