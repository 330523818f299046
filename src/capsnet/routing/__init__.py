"""Routing algorithms between capsule layers, one module each, with their fast paths and kernels beside them.

May import: capsnet.nn and the foundation modules (errors, fileio, config); never models, data or above.
"""

from .dynamic import Router, RoutingResult, default_weight_std, dynamic_routing, route_votes
from .dynamic_fast import fast_dynamic_routing

__all__ = [
    "Router",
    "RoutingResult",
    "default_weight_std",
    "dynamic_routing",
    "fast_dynamic_routing",
    "route_votes",
]
