"""Building a routing layer by name, from its record in the routing registry (capsnet.configs.routings).

`build_routing(NAME, in_caps=, out_caps=, in_d=, out_d=, iterations=, **options)` imports the layer class or
factory the record names, calls it with those keywords (and the options its record lists), and checks that what it
returns is a routing layer: an nn.Module that follows `capsnet.routing.base.RoutingLayer` with the sizes
asked for. A plugin's layer that does not is a ConfigError naming the plugin.

The factories below adapt the built-in layers whose constructors take other arguments to that call.
"""

from __future__ import annotations

import importlib
from typing import Any

from torch import nn

from ..configs.routings import LAYER_ARGUMENTS, RoutingRecord, routing_record
from ..errors import ConfigError
from .base import RoutingLayer
from .dynamic import default_weight_std
from .self_attention import SelfAttentionRouter
from .self_routing import SelfRoutingFC


def layer_factory(record: RoutingRecord) -> Any:
    """The class or factory `record.layer` ("module:attribute") names, imported."""
    if record.layer is None:
        raise ConfigError(f"routing {record.name!r} has no fully connected layer")
    module, _, attribute = record.layer.partition(":")
    try:
        target: Any = importlib.import_module(module)
        for part in attribute.split("."):
            target = getattr(target, part)
    except Exception as e:  # a plugin's module failing to import is the plugin's failure
        where = f"plugin {record.name!r} ({record.plugin})" if record.plugin else f"routing {record.name!r}"
        raise ConfigError(f"{where}: {record.layer} failed to import: {type(e).__name__}: {e}") from None
    return target


def build_routing(
    name: str, *, in_caps: int, out_caps: int, in_d: int, out_d: int, iterations: int, **options: Any
) -> nn.Module:
    """The routing layer `name` from in_caps capsules of in_d dimensions to out_caps of out_d. `options` are the
    record's (e.g. dynamic routing's `leaky`); the default of each is the layer's."""
    record = routing_record(name)
    unknown = sorted(set(options) - set(record.options.values()))
    if unknown:
        raise ConfigError(f"routing {name!r} takes no option {', '.join(unknown)}")
    sizes = {"in_caps": in_caps, "out_caps": out_caps, "in_d": in_d, "out_d": out_d, "iterations": iterations}
    assert tuple(sizes) == LAYER_ARGUMENTS
    where = f"routing plugin {name!r} ({record.plugin})" if record.plugin else f"routing {name!r}"
    try:
        layer = layer_factory(record)(**sizes, **options)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{where}: cannot build a layer {in_caps}x{in_d} -> {out_caps}x{out_d} ({e})") from None
    check_layer(layer, where, sizes)
    return layer


def check_layer(layer: Any, where: str, sizes: dict[str, int]) -> None:
    """ConfigError unless `layer` is an nn.Module routing layer of the sizes asked for."""
    contract = "an nn.Module with in_caps, in_d, out_caps, out_d and forward(u, a=None, *, return_weights=False)"
    if not isinstance(layer, nn.Module) or not isinstance(layer, RoutingLayer):
        raise ConfigError(f"{where}: returned a {type(layer).__name__}, not a routing layer ({contract})")
    got = {k: getattr(layer, k) for k in ("in_caps", "out_caps", "in_d", "out_d")}
    if any(got[k] != sizes[k] for k in got):
        raise ConfigError(f"{where}: asked for {sizes}, built a layer of {got}")


def self_attention_layer(
    *, in_caps: int, out_caps: int, in_d: int, out_d: int, iterations: int = 1, weight_std: float | None = None
) -> SelfAttentionRouter:
    """Efficient-CapsNet's routing in CapsNet: W starts as Router's does (the fan-in rule of
    `default_weight_std`: s_j sums in_caps votes, 1152 in CapsNet against Efficient-CapsNet's 16).
    It does not iterate: `iterations` is ignored."""
    std = default_weight_std(in_caps) if weight_std is None else weight_std
    return SelfAttentionRouter(in_caps, out_caps, in_d, out_d, weight_std=std)


def self_routing_layer(*, in_caps: int, out_caps: int, in_d: int, out_d: int, iterations: int = 1) -> SelfRoutingFC:
    """Self-routing's fully connected layer. It does not iterate: `iterations` is ignored."""
    return SelfRoutingFC(in_caps, out_caps, in_d, out_d)


__all__ = ["build_routing", "check_layer", "layer_factory", "self_attention_layer", "self_routing_layer"]
