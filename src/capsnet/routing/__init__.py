"""Routing algorithms between capsule layers, one module each, with their fast paths and kernels beside them.

Every fully connected routing layer follows :class:`capsnet.routing.base.RoutingLayer`: `layer(u, a=None, *,
return_weights=False)` maps u [B, n_in, d_in] to [B, n_out, d_out], or to a :class:`RoutingOutput` (capsules,
weights, activations). The routing registry (:data:`ROUTINGS`, :mod:`capsnet.configs.routings`) has one record per
routing, and :func:`capsnet.routing.registry.build_routing` builds a layer by name. Where a layer has a
C++ CPU kernel, :func:`set_backend` ("auto", "cpp" or "torch"; :mod:`capsnet.routing.backend`) chooses whether it
runs, globally, per model or per layer (`layer.backend`).

May import: capsnet.nn and the foundation modules (errors, fileio, config); never models, data or above.
"""

from ..configs.routings import ROUTINGS
from .backend import BACKENDS, get_backend, set_backend, use_backend
from .base import RoutingLayer, RoutingOutput, weight_spread
from .cluster import ClusterRoutingFC, cluster_route
from .cluster_conv import ClusterRoutingConv
from .dynamic import Router, RoutingResult, default_weight_std, dynamic_routing, route_votes
from .dynamic_fast import fast_dynamic_routing
from .em import EMResult, em_routing
from .em_fc import EMRoutingFC
from .heinsen import HeinsenRouting, generative_routing
from .heinsen_vector import HeinsenVectorRouting
from .inverted_attention import InvertedAttentionConv, InvertedAttentionFC, concurrent_routing
from .matrix_capsules import ClassCaps, ConvCaps, PrimaryMatrixCaps
from .self_attention import SelfAttentionRouter, self_attention_routing
from .self_routing import SelfRoutingConv, SelfRoutingFC

__all__ = [
    "BACKENDS",
    "ROUTINGS",
    "ClassCaps",
    "ClusterRoutingConv",
    "ClusterRoutingFC",
    "ConvCaps",
    "EMResult",
    "EMRoutingFC",
    "HeinsenRouting",
    "HeinsenVectorRouting",
    "InvertedAttentionConv",
    "InvertedAttentionFC",
    "PrimaryMatrixCaps",
    "Router",
    "RoutingLayer",
    "RoutingOutput",
    "RoutingResult",
    "SelfAttentionRouter",
    "SelfRoutingConv",
    "SelfRoutingFC",
    "cluster_route",
    "concurrent_routing",
    "default_weight_std",
    "dynamic_routing",
    "em_routing",
    "fast_dynamic_routing",
    "generative_routing",
    "get_backend",
    "route_votes",
    "self_attention_routing",
    "set_backend",
    "use_backend",
    "weight_spread",
]
