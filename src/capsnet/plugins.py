"""Plugins: routings and models that other installed distributions add through entry points.

A distribution adds a routing with an entry point in the group `capsnet.routings` (its name is the `--routing`
name; it names a layer class or factory) and a model with one in `capsnet.models` (its name is the `--model` name;
it names a model class, as `register_model` takes it). docs/plugins.md shows a whole plugin.

The entry points are read only when a name that capsnet does not define is looked up, or when every name is
listed (`capsnet models`, `capsnet compare`), never at start-up: `capsnet --help` reads none. The metadata is read
afresh each time (a distribution installed while a process runs is seen); what a plugin's module loads is kept.
A plugin that fails to import, or that two distributions declare, is a `PluginError`: one line naming it.

Torch-free: reading the names imports nothing; loading a plugin imports what the plugin imports.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .errors import ConfigError

if TYPE_CHECKING:
    from importlib import metadata

ROUTING_GROUP = "capsnet.routings"
MODEL_GROUP = "capsnet.models"


class PluginError(ConfigError):
    """A plugin that cannot be used: it fails to import, or two distributions declare its name."""


@dataclass(frozen=True)
class Plugin:
    """One entry point: its `name`, the `value` ("module:attribute") it names, and the distribution declaring it."""

    group: str
    name: str
    value: str
    distribution: str  # "name version"; "" where the metadata does not say

    def load(self) -> Any:
        """The object the entry point names, imported; PluginError naming the plugin if that fails."""
        try:
            return _entry_point(self).load()
        except Exception as e:  # whatever the plugin's import raises is the plugin's failure, not capsnet's
            raise PluginError(f"{self.describe()} failed to import: {type(e).__name__}: {e}") from None

    def describe(self) -> str:
        source = f", distribution {self.distribution}" if self.distribution else ""
        return f"plugin {self.name!r} (entry point {self.value} in group {self.group}{source})"


def _entry_point(plugin: Plugin) -> metadata.EntryPoint:
    from importlib import metadata  # (imported when a plugin is looked up: it is not light)

    return metadata.EntryPoint(name=plugin.name, value=plugin.value, group=plugin.group)


def plugins(group: str) -> dict[str, Plugin]:
    """The installed plugins of `group` by name (metadata only: nothing is imported). A name that two
    distributions declare with different values is a PluginError naming both."""
    from importlib import metadata  # (imported when a plugin is looked up: it is not light)

    found: dict[str, Plugin] = {}
    for ep in metadata.entry_points(group=group):
        dist = getattr(ep, "dist", None)
        plugin = Plugin(group, ep.name, ep.value, f"{dist.name} {dist.version}" if dist is not None else "")
        other = found.setdefault(ep.name, plugin)
        if other.value != plugin.value:
            raise PluginError(
                f"{group} plugin {ep.name!r} is declared twice: {other.value} "
                f"({other.distribution or '?'}) and {plugin.value} ({plugin.distribution or '?'}); "
                "uninstall one"
            )
    return found


def find(group: str, name: str) -> Plugin | None:
    """The installed plugin `name` of `group`, or None."""
    return plugins(group).get(name)


def names(group: str) -> list[str]:
    """The names the installed plugins of `group` declare, sorted (nothing is imported)."""
    return sorted(plugins(group))


def plugin_modules() -> dict[str, str]:
    """Top-level package -> the distribution ("name version") whose plugins (either group) live in it. (A name
    declared twice is left to the lookups that need it to report.)"""
    owners: dict[str, str] = {}
    for group in (ROUTING_GROUP, MODEL_GROUP):
        try:
            found = plugins(group).values()
        except PluginError:
            continue
        owners.update({p.value.split(":")[0].split(".")[0]: p.distribution or p.name for p in found})
    return owners


def missing(group: str, kind: str, name: str, known: list[str]) -> str:
    """The line for a `kind` ("routing", "model") `name` that is neither built in nor an installed plugin's."""
    return (
        f"unknown {kind} {name!r}; known: {', '.join(known)} (nor does any installed plugin declare it: entry "
        f"point group {group}; install the distribution that provides it)"
    )


__all__ = [
    "MODEL_GROUP",
    "ROUTING_GROUP",
    "Plugin",
    "PluginError",
    "find",
    "missing",
    "names",
    "plugin_modules",
    "plugins",
]
