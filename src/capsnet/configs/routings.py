"""The one routing registry, torch-free: one record per routing between capsule layers, and the plugins'.

A record names the routing (`--routing NAME`), its layer (a lazy "module:attribute" reference to the class or
factory, so listing the names imports no torch), its paper and equations, whether it iterates and its default
iterations, whether it has activations, how a model reads class probabilities from it, its fast paths, and the
CapsNet options only it takes. Everything that lists or builds routings reads it: CapsNetConfig's validation,
`capsnet train --routing`'s help, CapsNet's class-capsule layer (capsnet.routing.registry builds it), `capsnet
compare`, `capsnet models` and docs/models.md's table (`routing_table`; a test compares them).

Adding a routing to capsnet is one record in ROUTINGS (docs/plugins.md). A routing of one's own, in another
distribution, is an entry point in the group `capsnet.routings` (capsnet.plugins): its record is made from the
attributes its class or factory declares (`plugin_record`), read when its name is first looked up.

May import: the foundation modules only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from ..errors import ConfigError
from ..plugins import ROUTING_GROUP, find, missing, names

# How a model reads each class's probability from the routing's output (CapsNet's margin loss needs it in [0, 1]):
#   length      |v_j|, the length of a squashed capsule
#   activation  a_j, the parent activation the routing returns
#   classifier  sigmoid(w·v_j + b), a linear classifier shared by the class capsules (Tsai et al.'s, whose
#               LayerNorm'd poses all have about the same length)
Probability = Literal["length", "activation", "classifier"]

# The factory keywords every routing layer takes (a plugin's entry point is called with exactly these).
LAYER_ARGUMENTS = ("in_caps", "out_caps", "in_d", "out_d", "iterations")


@dataclass(frozen=True)
class RoutingRecord:
    """One routing. `layer` is called as `layer(in_caps=, out_caps=, in_d=, out_d=, iterations=, **options)` and
    returns a layer that follows capsnet.routing.base.RoutingLayer; None where the routing has no fully connected
    form (it is then in the docs' table and its model, not a `--routing` option)."""

    name: str
    layer: str | None  # "module:attribute"
    method: str  # what the docs' table calls it
    paper: str
    equations: str = ""
    classes: tuple[str, ...] = ()  # its layer classes in capsnet.routing, for the docs' table
    iterations: int | None = None  # default routing iterations; None: it does not iterate
    activations: bool = False  # takes the children's activations a_i (CapsNet gives |u_i|) and returns the a_j
    probability: Probability = "length"
    fast_paths: tuple[str, ...] = ()  # "cpp" (fused C++ CPU kernel), "triton" (CUDA kernels), "gemm" (large GEMMs)
    # CapsNetConfig fields only this routing takes -> the factory's keyword for each
    options: dict[str, str] = field(default_factory=dict)
    out_dims: tuple[int, ...] = ()  # the output capsule sizes it can route to; () any
    models: tuple[str, ...] = ()  # registered models that are built on it (its authors' models)
    plugin: str = ""  # the distribution of a plugin's routing ("name version"); "" built in

    @property
    def iterates(self) -> bool:
        return self.iterations is not None


DEFAULT_ROUTING = "dynamic"  # CapsNetConfig.routing's default: the paper's

_WEIGHT_STD = {"router_init_std": "weight_std"}

ROUTINGS: dict[str, RoutingRecord] = {
    r.name: r
    for r in [
        RoutingRecord(
            name="dynamic",
            layer="capsnet.routing.dynamic:Router",
            method="dynamic routing",
            classes=("Router",),
            paper="Sabour, Frosst & Hinton, NeurIPS 2017",
            equations="û = W u; c = softmax_j(b); s_j = Σ_i c_ij û_j|i; v = squash(s); b += û·v; r iterations",
            iterations=3,
            fast_paths=("cpp", "triton", "gemm"),
            options={
                "detach_votes": "detach_votes",
                "leaky_routing": "leaky",
                "capsule_bias": "bias",
                "coupling": "coupling",
                **_WEIGHT_STD,
            },
        ),
        RoutingRecord(
            name="self-attention",
            layer="capsnet.routing.registry:self_attention_layer",
            method="self-attention routing",
            classes=("SelfAttentionRouter",),
            paper="Mazzia, Salvetti & Chiaberge, Sci. Rep. 2021 (Efficient-CapsNet)",
            equations="û = W u; A_j = Û_j Û_jᵀ/√d; c = softmax_j(Σ_k A_j[i, k]); s_j = Σ_i û_ij (c_ij + b_ij); "
            "v = (1 − e^{−|s|}) s/|s|",
            options=dict(_WEIGHT_STD),
            models=("efficient-capsnet",),
        ),
        RoutingRecord(
            name="inverted-attention",
            layer="capsnet.routing.inverted_attention:InvertedAttentionFC",
            method="inverted dot-product attention",
            classes=("InvertedAttentionFC", "InvertedAttentionConv"),
            paper="Tsai, Srivastava, Goh & Salakhutdinov, ICLR 2020",
            equations="v = W p; p_j ← 0; a_ij = p_jᵀ v_ij; r = softmax_j(a); p_j = LayerNorm(Σ_i r_ij v_ij); layers "
            "routed concurrently",
            iterations=2,
            probability="classifier",
            fast_paths=("cpp",),
            models=("inverted-attention-capsnet",),
        ),
        RoutingRecord(
            name="self-routing",
            layer="capsnet.routing.registry:self_routing_layer",
            method="self-routing",
            classes=("SelfRoutingFC", "SelfRoutingConv"),
            paper="Hahn, Pyeon & Kim, NeurIPS 2019",
            equations="c = softmax_j(W^route u_i), W^route = 0 at start; a_j = Σ_i c_ij a_i / Σ_i a_i; "
            "u_j = Σ_i c_ij a_i û_j|i / Σ_i c_ij a_i; no iterations",
            activations=True,
            probability="activation",
            fast_paths=("gemm",),
            models=("self-routing-capsnet",),
        ),
        RoutingRecord(
            name="em",
            layer="capsnet.routing.em_fc:EMRoutingFC",
            method="EM routing",
            classes=("EMRoutingFC", "ConvCaps", "ClassCaps"),
            paper="Hinton, Sabour & Frosst, ICLR 2018",
            equations="V_ij = W_ij u_i (4×4 poses: M_i W_ij); M-step: μ_j, σ²_j of the votes weighted by R_ij a_i, "
            "a_j = sigmoid(λ(β_a − Σ_h (β_u + log σ_jh) Σ_i R_ij a_i)); E-step: R_ij ∝ a_j N(V_ij; μ_j, σ²_j); "
            "r iterations",
            iterations=3,
            activations=True,
            probability="activation",
            options=dict(_WEIGHT_STD),
            out_dims=(16,),
            models=("em-capsnet",),
        ),
        RoutingRecord(
            name="heinsen",
            layer="capsnet.routing.heinsen:HeinsenRouting",
            method="Heinsen routing",
            classes=("HeinsenRouting",),
            paper="Heinsen, arXiv:1911.00792, 2019 (Routing Capsules in All Domains)",
            equations="V_ij = μ_i W_ij + B_ij; R_ij = softmax_j(log f(a_j) + log p_ij), 1/J at first; "
            "D^use = f(a_i) R, D^ign = f(a_i) − D^use; a_j = Σ_i β^use D^use − β^ign D^ign; "
            "μ_j, σ²_j of V weighted by D^use; "
            "r iterations",
            iterations=3,
            activations=True,
            probability="activation",
            models=("heinsen-capsnet",),
        ),
        RoutingRecord(
            name="heinsen-vector",
            layer="capsnet.routing.heinsen_vector:HeinsenVectorRouting",
            method="Heinsen vector routing",
            classes=("HeinsenVectorRouting",),
            paper="Heinsen, arXiv:2211.11754, 2022 (Routing Vectors in Sequences)",
            equations="a_i = W_A x_i; R_ij = softmax_j(log f(x_i · x̂_j W^S + B^S)), x̂_j = G(x_j), 1/J at first; "
            "φ = β^use f(a_i) R − β^ign f(a_i)(1 − R); x_j = Σ_i φ_ij F_j(x_i); N(x_j); any length, masks",
            iterations=2,
            probability="classifier",
        ),
        RoutingRecord(
            name="cluster",
            layer="capsnet.routing.cluster:ClusterRoutingFC",
            method="non-iterative cluster routing",
            classes=("ClusterRoutingFC", "ClusterRoutingConv"),
            paper="Zhao & Cheng, Neural Networks 2021",
            equations="V^k_ij = W^k_ij u_i + b^k_ij, k = 1..K; μ_ij, σ_ij mean and std of the K votes, per dimension; "
            "c_ij = softmax_i(−log σ_ij); v_j = LayerNorm(Σ_i c_ij μ_ij); no iterations",
            probability="classifier",
            fast_paths=("gemm",),
            options={"cluster_votes": "votes"},
            models=("cluster-capsnet",),
        ),
        RoutingRecord(
            name="variational-bayes",
            layer="capsnet.routing.vb_fc:VBRoutingFC",
            method="variational Bayes routing",
            classes=("VBRoutingFC", "VBConvCaps", "VBClassCaps"),
            paper="Ribeiro, Leontidis & Kollias, AAAI 2020",
            equations="V_ij = W_ij u_i (4×4 poses: M_i W_ij); q(π, μ, Λ): R_j = Σ_i R_ij a_i, "
            "α_j, κ_j, ν_j = prior + R_j, m_j = Σ_i R_ij a_i V_ij / κ_j, Ψ_j⁻¹ = Ψ0⁻¹ + scatter; "
            "q(z): R_ij ∝ exp(E[ln π_j] + ½E[ln|Λ_j|] − "
            "½E[(V_ij − μ_j)ᵀΛ_j(V_ij − μ_j)]); a_j = sigmoid(BN(β_a − E[π_j] H[q(μ_j, Λ_j)] − β_u)); "
            "r iterations",
            iterations=3,
            activations=True,
            probability="activation",
            options=dict(_WEIGHT_STD),
            models=("vb-capsnet",),
        ),
        RoutingRecord(
            name="3d",
            layer=None,
            method="3D dynamic routing",
            classes=("ConvCaps3D",),
            paper="Rajasegaran et al., CVPR 2019 (DeepCaps)",
            equations="V_i = W ∗ u_i (one 3D convolution shared by the input types); k_i = softmax_3D(b_i) over "
            "(types, H, W); S = Σ_i k_i V_i + β; v = squash_3D(S); b_i += V_i · v; r iterations",
            iterations=3,
            models=("deepcaps",),
        ),
    ]
}


def fully_connected() -> list[str]:
    """The built-in routings that route flat capsules [B, n, d] (the `--routing` options), in ROUTINGS' order."""
    return [name for name, record in ROUTINGS.items() if record.layer is not None]


def routing_names() -> list[str]:
    """Every `--routing` option: the built-in ones, then the installed plugins' (their metadata; none imported)."""
    built_in = fully_connected()
    return [*built_in, *(n for n in names(ROUTING_GROUP) if n not in ROUTINGS)]


def routing_record(name: str) -> RoutingRecord:
    """The record of routing `name`: a built-in one, else the installed plugin's, loaded now. ConfigError for a
    routing without a fully connected form, or a name that is neither (one line listing the known ones)."""
    record = ROUTINGS.get(name)
    if record is not None:
        if record.layer is None:
            raise ConfigError(
                f"routing {name!r} routes capsule grids and has no fully connected form: it is part "
                f"of --model {' / '.join(record.models)}; --routing takes {', '.join(routing_names())}"
            )
        return record
    plugin = find(ROUTING_GROUP, name) if isinstance(name, str) else None
    if plugin is None:
        raise ConfigError(missing(ROUTING_GROUP, "routing", str(name), routing_names()))
    return plugin_record(name, plugin.value, plugin.load(), plugin.distribution)


def plugin_record(name: str, value: str, layer: Any, distribution: str) -> RoutingRecord:
    """The record of a plugin's routing, from what its class or factory declares: `paper`, `equations`,
    `default_iterations` (None: it does not iterate), `activations`, `probability`, `fast_paths`."""
    activations = bool(getattr(layer, "activations", False))
    probability: Probability = getattr(layer, "probability", "activation" if activations else "length")
    if probability not in ("length", "activation", "classifier"):
        raise ConfigError(
            f"routing plugin {name!r}: probability must be length, activation or classifier, got {probability!r}"
        )
    iterations = getattr(layer, "default_iterations", None)
    return RoutingRecord(
        name=name,
        layer=value,
        method=name,
        paper=str(getattr(layer, "paper", "-")),
        equations=str(getattr(layer, "equations", "")),
        classes=(getattr(layer, "__name__", value),),
        iterations=None if iterations is None else int(iterations),
        activations=activations,
        probability=probability,
        fast_paths=tuple(getattr(layer, "fast_paths", ())),
        plugin=distribution or "a plugin",
    )


def routing_help() -> str:
    """`--routing`'s help: the built-in routings with their papers, and where the plugins' come from."""
    listed = "; ".join(f"{r.name} ({r.paper})" for r in ROUTINGS.values() if r.layer is not None)
    return (
        f"routing of the class capsules: {listed}; or an installed plugin's (entry point group {ROUTING_GROUP}; "
        f"`capsnet models` lists them) (default: {DEFAULT_ROUTING})"
    )


def routing_table() -> str:
    """docs/models.md's table of the built-in routings (Markdown), one row per record."""

    def cell(text: str) -> str:
        return text.replace("|", "\\|")

    rows = [
        "| method | paper | equations | iterations | activations | fast paths | flag |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in ROUTINGS.values():
        classes = ", ".join(f"`{c}`" for c in r.classes)
        flags = [f"`--routing {r.name}`" + (" (default)" if r.name == DEFAULT_ROUTING else "")] if r.layer else []
        flags += [f"`--model {m}`" for m in r.models]
        rows.append(
            f"| {r.method} ({classes}) | {r.paper} | {cell(r.equations)} | {r.iterations or 'none'} | "
            f"{'yes' if r.activations else 'no'} | {', '.join(r.fast_paths) or '-'} | {'; '.join(flags)} |"
        )
    return "\n".join(rows)


__all__ = [
    "DEFAULT_ROUTING",
    "LAYER_ARGUMENTS",
    "ROUTINGS",
    "Probability",
    "RoutingRecord",
    "fully_connected",
    "plugin_record",
    "routing_help",
    "routing_names",
    "routing_record",
    "routing_table",
]
