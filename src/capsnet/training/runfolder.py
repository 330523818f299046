"""The run folder, opened in one order by `capsnet train`, `capsnet.training.train` and `capsnet.fit`.

`open_run` is the one way in. Its steps, in this order (each refusal is one line, a CapsNetError):

1. Settings. Resuming, the run's config.json is the truth: a setting not given is the run's own, one given again
   must agree with it unless it may change on resume (capsnet.training.record), and the validation split is the
   one it recorded. A resume needs the run's state.pt. The batch size is resolved.
2. Data. The task is made (its data opened) and checked by the caller's hook (fit: a first batch through the
   model), so a missing data set or a wrong flag is reported as such, never as a folder problem.
3. Folder. An existing folder that is not a capsnet run is refused with nothing written into it. Rank 0 takes the
   folder's lock (`LOCK_NAME`, a filelock.FileLock: an flock that the OS releases on any exit of its holder,
   kill -9 included), without waiting; a second writer is refused with the holder's PID (PID_NAME). A fresh run into
   a folder that holds a run is refused: with the same settings it asks for --resume, with other settings it says
   which one differs.
4. State. Resuming, the state.pt is loaded and checked against the data (the validation split, the data sizes).

The model's side of a resume (its saved config, the data's shape) is `saved_model_config` and
`check_same_shape`. The lock is released by `release` when the run ends (capsnet.training.api.launch).
On network file systems the lock is only as good as the server's flock.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from filelock import FileLock, Timeout

from ..config import from_dict, to_dict
from ..errors import CheckpointError, ConfigError, RunFolderError
from ..logs import LOGGER
from ..models.inputs import DATA_FIELDS, image_hw
from ..models.registry import MODELS
from .checkpoint import STATE_NAME, load_state
from .config import MIN_EPOCH_STEPS, FitConfig, TrainConfig, settle_epoch_repeats
from .hardware import device_settings
from .record import (
    FIT_TASK,
    conflicts,
    read_record,
    recorded_model_name,
    recorded_settings,
    resumed_settings,
    same,
    say,
)
from .tasks import Task

LOCK_NAME = ".capsnet.lock"  # the lock file (each try to take it truncates it: the PID lives beside it)
PID_NAME = ".capsnet.pid"  # the holder's PID while a run holds the folder
OWN_NAMES = (LOCK_NAME, PID_NAME, "tb")  # what a run may have written before its config.json
_held: dict[str, FileLock] = {}  # the resolved run folder -> the lock this process holds on it
_created: set[str] = set()  # the run folders this process made when it took their lock


@dataclass
class OpenedRun:
    """What `open_run` opened: the settings to train with, the task, the state.pt to resume from (on the
    CPU) or None for a fresh run."""

    config: TrainConfig | FitConfig
    task: Task
    saved: dict[str, Any] | None


def open_run(
    config: TrainConfig | FitConfig,
    device: torch.device,
    dist,
    *,
    make_task: Callable[[Any], Any],
    check_task: Callable[[Any, Any], None] | None = None,
    model_settings: dict[str, Any] | None = None,
    flag: str = "--resume",
    batches: bool = True,
    min_epoch_steps: int = MIN_EPOCH_STEPS,
) -> OpenedRun:
    """Open the run folder `config.out` in the order the module docstring gives. `make_task(config)` makes the
    task from the settled config and `check_task(config, task)` checks it; `model_settings` are the model options
    a fresh run compares with a recorded run's. `flag` names the resume switch in messages ("--resume" or
    "resume=True"); `batches`: whether the run batches at `batch_size` (then a default batch size is announced);
    `min_epoch_steps`: an epoch's fewest steps on one's own data (capsnet.training.config.min_epoch_steps)."""
    notes: list[tuple[str, int]] = []  # (what was chosen for the user, said once the data is known to fit)
    config = resumed_settings(config, flag=flag)  # (capsnet.training.record)
    config = device_settings(config, device, flag=flag, batches=batches, notes=notes)  # (hardware)
    task = make_task(config)
    if check_task is not None:
        check_task(config, task)
    if config.stop_at_val_acc and not task.has_val:
        cli = flag.startswith("--")
        named, hold = (
            ("--stop-at-val-acc", "--val-fraction") if cli else ("stop_at_val_acc=", "val_fraction= or val_data=")
        )
        raise ConfigError(f"{named} needs a validation split, and this run has none: hold one out with {hold}")
    notes += [(text, logging.INFO) for text in task.notes if not config.resume]  # (a resumed run's were said)
    for text, level in notes if dist.is_main else ():
        LOGGER.log(level, text)
    claim(config, dist, flag=flag, model_settings=model_settings)
    saved = None
    try:
        # (after the claim, which compares the settings given with a recorded run's, not the repeats derived)
        named = "--epoch-repeats" if flag.startswith("--") else "epoch_repeats="
        config, note = settle_epoch_repeats(
            config, task, world_size=dist.world_size, flag=named, min_steps=min_epoch_steps
        )  # (config)
        if note and dist.is_main:
            LOGGER.info(note)
        if config.resume:
            saved = load_state(Path(config.out))  # on the CPU: restore() copies what it needs
            check_resumed_data(task, saved, Path(config.out), fit=isinstance(config, FitConfig))
    except BaseException:
        abandon(config.out)  # (nothing written yet: a folder this run made goes)
        raise
    return OpenedRun(config, task, saved)


# ----------------------------------------------------------------------------------------------- 1. settings
# ----------------------------------------------------------------------------------------------- 3. folder
def folder_contents(run_dir: Path) -> list[str] | None:
    """The names in `run_dir` besides those a run writes before its record (None: no such folder)."""
    if not run_dir.exists():
        return None
    if not run_dir.is_dir():
        raise RunFolderError(f"{run_dir}: not a folder (the run folder to train into)")
    try:
        names = [p.name for p in run_dir.iterdir()]
    except OSError as e:
        raise RunFolderError(f"{run_dir}: cannot be read ({e.strerror})") from None
    strays = (n for n in names if n.startswith(".") and n.endswith(".tmp"))  # (capsnet.fileio's temporary files)
    return sorted(set(names) - set(OWN_NAMES) - set(strays))


def is_run(run_dir: Path) -> bool:
    """Whether `run_dir` holds a capsnet run: a state.pt, or a config.json that records a run's settings."""
    if (run_dir / STATE_NAME).is_file():
        return True
    try:
        return read_record(run_dir) is not None
    except CheckpointError:  # a config.json of something else
        return False


def claim(config, dist, *, flag: str, model_settings: dict[str, Any] | None = None) -> None:
    """Take the run folder for this run (module docstring, step 3); rank 0 holds its lock from here on."""
    run_dir, out = Path(config.out), "--out" if flag.startswith("--") else "out"
    names = folder_contents(run_dir)
    if names and not is_run(run_dir):
        shown = ", ".join(names[:4]) + (f", ... ({len(names)} entries)" if len(names) > 4 else "")
        raise RunFolderError(
            f"{run_dir} is not a capsnet run folder (it holds {shown}); a run is written into a "
            f"new or empty folder, or one of its own: choose another {out}"
        )
    if dist.is_main:
        acquire(run_dir, out=out)
    try:
        names = folder_contents(run_dir)  # (again, under the lock: what another run wrote meanwhile counts)
        if getattr(config, "overwrite", False) and names and dist.is_main:
            clear_run(run_dir)  # (a capsnet run's folder, checked above: the user asked for it to go)
            names = []
        if not config.resume and names:
            check_fresh(config, run_dir, flag=flag, out=out, model_settings=model_settings)
    except BaseException:
        release(run_dir)
        raise


def clear_run(run_dir: Path) -> None:
    """Delete the run in `run_dir` (overwrite): everything in it but the lock this process holds and its PID."""
    for entry in run_dir.iterdir():
        if entry.name in (LOCK_NAME, PID_NAME):
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()


def check_fresh(config, run_dir: Path, *, flag: str, out: str, model_settings: dict[str, Any] | None) -> None:
    """RunFolderError unless a fresh run may start in `run_dir`: a folder without a run, or with a run of the same
    settings that has no checkpoint yet (it was stopped before its first one)."""
    meta = read_record(run_dir)
    has_state = (run_dir / STATE_NAME).is_file()
    style = "flag" if flag.startswith("--") else "keyword"
    found = []
    if meta is not None:
        fit = isinstance(config, FitConfig)
        if (meta.get("task") == FIT_TASK) != fit:
            made_by = "capsnet train" if fit else "capsnet.fit"
            raise RunFolderError(f"{run_dir} holds a run made by {made_by}; choose another {out}")
        found = conflicts(to_dict(config), recorded_settings(meta, type(config)))
        recorded_model: dict[str, Any] = meta["model"] if isinstance(meta.get("model"), dict) else {}
        found += [
            (k, v, recorded_model[k])
            for k, v in (model_settings or {}).items()
            if k in recorded_model and k not in DATA_FIELDS and not same(v, recorded_model[k])
        ]
    if found:
        key, given, recorded = found[0]
        then = f"; {flag} continues it with its own settings" if has_state else ""
        raise RunFolderError(
            f"{run_dir} holds a run of other settings ({say(key, given, style)}, recorded "
            f"{say(key, recorded, style)}); choose another {out}{then}"
        )
    if has_state:
        raise RunFolderError(f"{run_dir} already holds a run; pass {flag} to continue it, or choose another {out}")


def acquire(run_dir: Path, *, out: str = "--out") -> None:
    """Hold the lock of `run_dir` (created if needed) for this process, without waiting; RunFolderError naming the
    holder's PID when another process (or another run of this one) holds it. The lock file is never removed:
    removing it would let two holders lock two files."""
    try:
        if not run_dir.exists():
            run_dir.mkdir(parents=True)
            _created.add(str(run_dir.resolve()))
        if (run_dir / LOCK_NAME).is_symlink():
            raise OSError(errno.ELOOP, "a link where its lock file goes")
        lock = FileLock(run_dir / LOCK_NAME)
        lock.acquire(timeout=0)
    except Timeout:
        try:
            holder = (run_dir / PID_NAME).read_text(encoding="ascii", errors="replace").strip() or "unknown"
        except OSError:
            holder = "unknown"
        raise RunFolderError(
            f"{run_dir} is in use by another capsnet run (PID {holder}); wait for it to end or choose another {out}"
        ) from None
    except OSError as e:
        why = "a link where its lock file goes" if e.errno == errno.ELOOP else e.strerror
        raise RunFolderError(f"{run_dir}: cannot take the run folder's lock ({why})") from None
    (run_dir / PID_NAME).write_text(f"{os.getpid()}\n", encoding="ascii")
    _held[str(run_dir.resolve())] = lock


def abandon(run_dir: str | os.PathLike) -> None:
    """Let go of `run_dir` after a failure before the run wrote anything: its lock files go (removed while held,
    so no other process holds them), and so does the folder if this process made it; then `release`."""
    key = str(Path(run_dir).resolve())
    if key in _held and {p.name for p in Path(run_dir).iterdir()} <= {LOCK_NAME, PID_NAME}:
        for name in (PID_NAME, LOCK_NAME):
            with contextlib.suppress(FileNotFoundError):
                (Path(run_dir) / name).unlink()
        if key in _created:
            Path(run_dir).rmdir()
    _created.discard(key)
    release(run_dir)


def release(run_dir: str | os.PathLike) -> None:
    """Let go of the lock this process holds on `run_dir` (nothing when it holds none); its PID file goes first."""
    lock = _held.pop(str(Path(run_dir).resolve()), None)
    if lock is not None:
        with contextlib.suppress(FileNotFoundError):
            (Path(run_dir) / PID_NAME).unlink()
        lock.release()


# ----------------------------------------------------------------------------------------------- 4. state
def check_resumed_data(task: Task, saved: dict, run_dir: Path, *, fit: bool) -> None:
    """ConfigError unless `task` is the resumed run's data: the same validation split (presence and size) and, for
    capsnet.fit's runs, the same number of examples in each split."""
    recorded = saved.get("validation") or {"source": "none"}
    mine = getattr(task, "recorded", {}).get("validation", {"source": "given" if task.has_val else "none"})
    if (recorded["source"] == "none") != (not task.has_val) or recorded.get("n", mine.get("n")) != mine.get("n"):
        raise ConfigError(
            f"--resume: {run_dir} was validated on {_describe(recorded)}, this data gives "
            f"{_describe(mine)}; resume with the run's own data and --val-fraction"
        )
    if not fit:
        return
    recorded, mine = saved.get("data") or {}, getattr(task, "recorded", {}).get("data") or {}
    for part in ("train", "val", "test"):
        then, now = (recorded.get(part) or {}).get("n"), (mine.get(part) or {}).get("n")
        if then is not None and now is not None and then != now:
            raise ConfigError(
                f"resume: {run_dir} was trained with {then:,} {part} examples, this {part} data has "
                f"{now:,}; resume with the run's own data"
            )


def _describe(validation: dict) -> str:
    return "no validation split" if validation["source"] == "none" else f"{validation.get('n', '?')} images"


def saved_model_config(model_class: Any, saved: dict, run_dir: Path, name: str) -> Any:
    """The model config a state.pt saved, for `model_class`; CheckpointError naming the run's model when the state
    is another model's."""
    recorded = recorded_model_name(saved, run_dir)
    if recorded is not None and recorded in MODELS and MODELS.canonical(recorded) != MODELS.canonical(name):
        raise CheckpointError(f"{run_dir / STATE_NAME}: a run of model {recorded!r}, not {name!r}")
    saved_config = {**model_class.saved_defaults, **(saved.get("model_config") or {})}  # older runs' keys
    try:
        return from_dict(model_class.config_class, saved_config, what=f"{run_dir}/{STATE_NAME}")
    except ConfigError as e:
        run_model = f"model {recorded!r}" if recorded and recorded != name else "another model"
        raise CheckpointError(f"{run_dir / STATE_NAME}: a run of {run_model}, not of {name!r} ({e})") from None


def check_same_shape(model_config: Any, fields: dict[str, Any], run_dir: Path) -> None:
    """ConfigError when the data would change the resumed model's input or classes (other data than the run's)."""
    saved = (model_config.in_channels, image_hw(model_config.image_size), model_config.n_classes)
    now = (
        fields.get("in_channels", saved[0]),
        image_hw(fields.get("image_size", model_config.image_size)),
        fields.get("n_classes", saved[2]),
    )
    if now != saved:

        def images(c, hw, n):
            return f"{c}x{hw[0]}x{hw[1]} images of {n} classes"

        raise ConfigError(
            f"--resume: {run_dir} trained on {images(*saved)}, this data gives {images(*now)}; resume "
            "with the run's own data"
        )


def resumed_line(epoch: int, batch: int, n_batches: int | None, epochs: int) -> str:
    """What a resumed run says of where it continues: `resumed at epoch E, batch B of N` (E counts from 1; B
    batches of epoch E are done)."""
    if epoch >= epochs:
        return f"resumed after its last epoch ({epochs})"
    return f"resumed at epoch {epoch + 1}, batch {batch} of {n_batches if n_batches is not None else '?'}"
