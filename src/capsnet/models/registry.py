"""The one model registry: `capsnet train --model NAME`, `capsnet models`, `create_model(NAME)` and the `model_type`
that config.json records all look names up here.

The registry is the floor of capsnet.models: it imports no model. Each built-in model registers itself with the
decorator `@register_model` on its class, under the name its config has in `capsnet.configs.MODEL_CONFIGS`,
and `capsnet.models` imports every model module, so that importing anything in capsnet.models fills the registry.
A model of one's own registers with `register_model(NAME, Class)` (or `@register_model(NAME)`). Its class names
its config dataclass (`config_class`), the `model_type` its saved config.json records (an alias of NAME when it
differs, so both load), its default learning rate (`default_lr`), optionally its fewest steps an epoch on data of
one's own (`own_data_epoch_steps`), and `paper` / `designed_for` for `capsnet models`.

A model of another installed distribution registers through an entry point in the group `capsnet.models`
(capsnet.plugins), which names the model class: it is registered under the entry point's name the first time that
name is looked up (or when every model is listed: `Registry.load_plugins`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, MutableMapping
from typing import Any, overload

from ..configs.base import MODEL_CONFIGS, config_name
from ..errors import ConfigError
from ..plugins import MODEL_GROUP, Plugin, PluginError, find, missing, names, plugins

_Model = Any  # a model class (a capsnet.models.pretrained.Pretrained subclass); the registry imports no model


class Registry(MutableMapping[str, _Model]):
    """Model name -> model class. Iterating gives the canonical names in registration order; looking up (`[]`,
    `in`) also takes an alias, such as the `model_type` a class saves under when it differs from its name."""

    def __init__(self) -> None:
        self._models: dict[str, _Model] = {}
        self._aliases: dict[str, str] = {}  # alias -> canonical name
        self._own_configs: set[str] = set()  # names whose config this registry added to MODEL_CONFIGS
        self._plugins: dict[str, str] = {}  # name of a plugin's model -> its distribution ("name version")

    def register(self, name: str, cls: _Model, *, aliases: Iterable[str] = (), flags: bool = True) -> _Model:
        """Add `cls` under `name` (and `aliases`, plus its `model_type` if that differs); returns `cls`. With `flags`,
        a model of one's own adds its config to MODEL_CONFIGS, whose fields are `capsnet train`'s model flags (a
        plugin's model does not: `capsnet train --model NAME` adds its flags alone)."""
        model_type = getattr(cls, "model_type", name)
        extra = [a for a in (*aliases, model_type) if a != name]
        for key in (name, *extra):
            owner = self._aliases.get(key, key if key in self._models else None)
            if owner is not None and owner != name:
                raise ValueError(f"model name {key!r} is taken by {owner!r}")
        self._models[name] = cls
        self._aliases.update(dict.fromkeys(extra, name))
        config_class = getattr(cls, "config_class", None)
        if flags and name not in MODEL_CONFIGS and config_class is not None and config_name(config_class) is None:
            MODEL_CONFIGS[name] = config_class  # a model of one's own: `capsnet train` takes its config's flags
            self._own_configs.add(name)
        # the built-in models in capsnet.configs' order (whichever module imports first), then the others
        order = {n: i for i, n in enumerate(MODEL_CONFIGS)}
        self._models = dict(sorted(self._models.items(), key=lambda item: order.get(item[0], len(order))))
        return cls

    def canonical(self, name: str) -> str:
        """The registered name for `name` (itself, or the model an alias stands for), registering the installed
        plugin of that name if there is one; ConfigError naming the known models otherwise."""
        name = self._aliases.get(name, name)
        if name not in self._models:
            plugin = find(MODEL_GROUP, name) if isinstance(name, str) else None
            if plugin is None:
                known = [*self._models, *(n for n in names(MODEL_GROUP) if n not in self._models)]
                raise ConfigError(missing(MODEL_GROUP, "model", str(name), known))
            self._register_plugin(plugin)
        return name

    def _register_plugin(self, plugin: Plugin) -> None:
        cls = plugin.load()
        if not isinstance(cls, type) or not hasattr(cls, "config_class"):
            raise PluginError(
                f"{plugin.describe()} names a {type(cls).__name__}, not a model class with a "
                "config_class (what register_model takes)"
            )
        try:
            self.register(plugin.name, cls, flags=False)
        except ValueError as e:
            raise PluginError(f"{plugin.describe()}: {e}") from None
        self._plugins[plugin.name] = plugin.distribution or "a plugin"

    def load_plugins(self) -> list[str]:
        """Register every installed model plugin not registered yet; returns one line per plugin that failed."""
        failed = []
        for plugin in plugins(MODEL_GROUP).values():
            if plugin.name not in self._models and plugin.name not in self._aliases:
                try:
                    self._register_plugin(plugin)
                except PluginError as e:
                    failed.append(str(e))
        return failed

    def plugin(self, name: str) -> str:
        """The distribution ("name version") that provides model `name`; "" for a model registered in-process."""
        return self._plugins.get(self._aliases.get(name, name), "")

    def aliases(self, name: str) -> list[str]:
        return [alias for alias, target in self._aliases.items() if target == name]

    def __getitem__(self, name: str) -> _Model:
        return self._models[self._aliases.get(name, name)]

    def __setitem__(self, name: str, cls: _Model) -> None:
        self.register(name, cls)

    def __delitem__(self, name: str) -> None:
        del self._models[name]
        self._plugins.pop(name, None)
        if name in self._own_configs:
            self._own_configs.discard(name)
            MODEL_CONFIGS.pop(name, None)
        self._aliases = {alias: target for alias, target in self._aliases.items() if target != name}

    def __iter__(self) -> Iterator[str]:
        return iter(self._models)

    def __len__(self) -> int:
        return len(self._models)


MODELS = Registry()


@overload
def register_model(name: _Model, /) -> _Model: ...
@overload
def register_model(name: str, cls: _Model, /, *, aliases: Iterable[str] = ()) -> _Model: ...
@overload
def register_model(name: str, /, *, aliases: Iterable[str] = ()) -> Callable[[_Model], _Model]: ...


def register_model(name: Any, cls: Any = None, /, *, aliases: Iterable[str] = ()) -> Any:
    """Register a model class and return it: `@register_model` on a built-in model's class (the name is its
    config's, from capsnet.configs), `register_model(NAME, Class)`, or `@register_model(NAME)`."""
    if isinstance(name, type):  # @register_model
        known = config_name(getattr(name, "config_class", None))
        if known is None:
            raise ValueError(f"{name.__name__}: its config is not a built-in one; use register_model(NAME, Class)")
        return MODELS.register(known, name, aliases=aliases)
    if cls is None:
        return lambda c: MODELS.register(name, c, aliases=aliases)
    return MODELS.register(name, cls, aliases=aliases)


def model_class(name: str) -> _Model:
    """The model class registered under `name` or one of its aliases; ConfigError naming the known ones otherwise."""
    return MODELS[MODELS.canonical(name)]


__all__ = ["MODELS", "Registry", "model_class", "register_model"]
