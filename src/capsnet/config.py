"""Dataclass configs as plain dicts, and command-line flags generated from them.

A config field becomes the flag `--field-name`; its help text comes from `field(metadata={"help": ...})`.
Configs round-trip through JSON (`asdict` / `from_dict`), so loading a config never needs pickle.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import types
import typing
from pathlib import Path
from typing import Any, TypeVar, cast

from .errors import ConfigError
from .limits import CONFIG_FILE_BYTES, MAX_CLASSES, MAX_IMAGE_SIDE

# Integer config fields with a limit, by name, whichever dataclass has them (docs/security.md).
FIELD_LIMITS = {"n_classes": MAX_CLASSES, "image_size": MAX_IMAGE_SIDE}

T = TypeVar("T")


def from_dict(cls: type[T], data: dict[str, Any], *, what: str = "config") -> T:
    """Build dataclass `cls` from a plain dict, strictly: unknown keys and wrong types are errors."""
    if not isinstance(data, dict):
        raise ConfigError(f"{what}: expected a JSON object, got {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cast(Any, cls))}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ConfigError(f"{what}: unknown key(s) {', '.join(unknown)}; known: {', '.join(fields)}")
    hints = typing.get_type_hints(cls)
    values = {name: _coerce(hints[name], value, f"{what}.{name}") for name, value in data.items()}
    for name, limit in FIELD_LIMITS.items():
        value = values.get(name)
        if any(isinstance(v, int) and v > limit for v in (value if isinstance(value, (tuple, list)) else [value])):
            raise ConfigError(f"{what}.{name}: {value!r} is more than the limit of {limit:,}")
    try:
        return cls(**values)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{what}: {e}") from None


def _coerce(tp: Any, value: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        for arg in args[:-1]:  # int | tuple[int, ...]: the first member type that takes the value
            try:
                return _coerce(arg, value, where)
            except ConfigError:
                pass
        return _coerce(args[-1], value, where)
    if origin is typing.Literal:
        if value not in typing.get_args(tp):
            raise ConfigError(f"{where}: {value!r} is not one of {list(typing.get_args(tp))}")
        return value
    if origin in (tuple, list):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        (inner, *_) = typing.get_args(tp) or (Any,)
        items = [_coerce(inner, v, where) for v in value]
        return tuple(items) if origin is tuple else items
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}: expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected a string, got {value!r}")
        return value
    return value


def to_dict(obj: Any) -> dict[str, Any]:
    """A dataclass as a JSON-ready dict (tuples become lists)."""
    return json.loads(json.dumps(dataclasses.asdict(obj)))


def load_config_file(path: str | Path) -> dict[str, Any]:
    """Read a YAML or JSON config file into a dict."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"{path}: a folder, not a config file")
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    text = read_text_file(path, what="config file")
    if path.suffix.lower() in (".yaml", ".yml"):
        try:
            import yaml
        except ImportError:
            raise ConfigError("reading YAML configs needs PyYAML: pip install 'capsnet[config]'") from None
        if _yaml_has_alias(yaml, text):
            raise ConfigError(f"{path}: YAML aliases (*name) are not accepted in a config file; write the values out")
        try:
            data = yaml.safe_load(text)
        except RecursionError:
            raise ConfigError(f"{path}: nested too deeply to be a config file") from None
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)  # where the parser stopped
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
            what = getattr(e, "problem", None) or type(e).__name__
            raise ConfigError(f"{path}: not valid YAML ({what}{where})") from None
    else:
        data = parse_json(text, path)
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level")
    return data


def read_text_file(path: Path, *, what: str, limit: int = CONFIG_FILE_BYTES) -> str:
    """The UTF-8 text of a small file (a config): ConfigError if it is larger than `limit` bytes or not UTF-8; an
    OSError (no permission, ...) propagates with its path."""
    with open(path, "rb") as f:
        raw = f.read(limit + 1)
    if len(raw) > limit:
        raise ConfigError(f"{path}: larger than the {limit:,} bytes a {what} may have (CONFIG_FILE_BYTES)")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None


def parse_json(text: str, path: str | Path) -> Any:
    """`json.loads(text)`: ConfigError naming `path` if it is not JSON or is nested too deeply."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from None
    except RecursionError:
        raise ConfigError(f"{path}: nested too deeply to be a config file") from None


def parse_option(text: str) -> tuple[str, Any]:
    """ "conv-channels=16" -> ("conv_channels", 16): a NAME=VALUE option of a model's config, the value JSON where
    it parses, else a string. ConfigError without a name and an "="."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"expected NAME=VALUE, got {text!r}")
    name = key.strip().replace("-", "_")
    try:
        return name, parse_json(value, "--option")
    except ConfigError:
        return name, value


def _yaml_has_alias(yaml: Any, text: str) -> bool:
    """Whether the YAML `text` uses an alias (`*name`): the billion-laughs expansion needs them, a config never
    does. Scanned token by token, before anything is built; a malformed text is left to the parser's message."""
    try:
        return any(isinstance(token, yaml.AliasToken) for token in yaml.scan(text, Loader=yaml.SafeLoader))
    except yaml.YAMLError:
        return False


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_dataclass_arguments(parser: argparse.ArgumentParser, cls: type, *, exclude: tuple[str, ...] = ()) -> None:
    """Add one flag per field of `cls`. Defaults are left as None so a --config file can fill them."""
    hints = typing.get_type_hints(cls)
    group = parser.add_argument_group(cls.__name__)
    for f in dataclasses.fields(cls):
        if f.name in exclude or not f.init:
            continue
        help_text = f.metadata.get("help", "")
        if "(default" not in help_text:  # a help text that explains its default in words keeps its own
            help_text = f"{help_text} (default: {field_default(f)})".strip()
        add_field_argument(group, f.name, hints[f.name], help_text)


def field_default(f: dataclasses.Field) -> Any:
    """The default value of a dataclass field (calling its default_factory if it has one)."""
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default


def add_field_argument(group: Any, name: str, tp: Any, help_text: str) -> None:
    """Add the flag `--name` for a field of type `tp` to `group` (a parser or an argument group), default None."""
    kwargs: dict[str, Any] = {"dest": name, "default": None, "help": help_text}
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        tp = next(a for a in typing.get_args(tp) if a is not type(None))
        origin = typing.get_origin(tp)
    if tp is bool:
        group.add_argument(_flag(name), action=argparse.BooleanOptionalAction, **kwargs)
    elif origin is typing.Literal:
        group.add_argument(_flag(name), choices=list(typing.get_args(tp)), **kwargs)
    elif origin in (tuple, list):
        (inner, *_) = typing.get_args(tp)
        inner = finite_float if inner is float else inner
        group.add_argument(_flag(name), type=inner, nargs="+", metavar=name.upper(), **kwargs)
    else:
        tp = finite_float if tp is float else tp
        group.add_argument(_flag(name), type=tp, metavar=name.split("_")[-1].upper(), **kwargs)


def finite_float(text: str) -> float:
    """A float flag's value: a finite number (nan and inf are usage errors)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def dataclass_from_args(cls: type[T], args: argparse.Namespace, base: dict[str, Any] | None = None) -> T:
    """Defaults, then `base` (a config file), then the flags given on the command line."""
    data: dict[str, Any] = dict(base or {})
    for f in dataclasses.fields(cast(Any, cls)):
        value = getattr(args, f.name, None)
        if value is not None:
            data[f.name] = list(value) if isinstance(value, tuple) else value
    return from_dict(cls, data, what=cls.__name__)
