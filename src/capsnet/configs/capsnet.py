"""The config of the capsnet model: its fields, paper defaults and checks.

Torch-free, so that `capsnet train --help` builds its flags without importing torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from ..errors import ConfigError
from .base import (
    RecordedData,
    check_loss_options,
    conv_output_size,
    image_hw,
    register_config,
)
from .routings import DEFAULT_ROUTING, ROUTINGS, RoutingRecord, routing_help, routing_record


@dataclass
class CapsNetConfig(RecordedData):
    """Hyper-parameters of `CapsNet`; the defaults are the paper's MNIST model."""

    in_channels: int = field(default=1, metadata={"help": "input image channels"})
    image_size: int | tuple[int, ...] = field(
        default=28, metadata={"help": "input image side, or [height, width] for non-square images"}
    )
    n_classes: int = field(default=10, metadata={"help": "number of classes (class capsules), at least 2"})
    conv_channels: int = field(default=256, metadata={"help": "channels of the first 9x9 convolution"})
    kernel_size: int = field(default=9, metadata={"help": "kernel of both convolutions"})
    padding: Literal["valid", "same"] = field(
        default="valid",
        metadata={
            "help": "padding of both convolutions: valid (the paper's MNIST model) or same (zero padding "
            "kernel//2; the official code's CIFAR-10 setup, github.com/Sarasra/models research/capsules)"
        },
    )
    conv1_stride: int = field(
        default=1,
        metadata={
            "help": "stride of the first convolution (paper: 1); 2 or more shrinks large images' "
            "primary capsule grid, and with it the routing's memory and time"
        },
    )
    primary_types: int = field(default=32, metadata={"help": "primary capsule types"})
    primary_dim: int = field(default=8, metadata={"help": "primary capsule dimension"})
    class_dim: int = field(default=16, metadata={"help": "class capsule dimension"})
    routing_iterations: int | None = field(
        default=None,
        metadata={
            "help": "routing iterations r (default: the routing's own, e.g. dynamic 3, inverted-attention 2; "
            "ignored by a routing that does not iterate)"
        },
    )
    routing: str = field(default=DEFAULT_ROUTING, metadata={"help": routing_help()})
    detach_votes: bool = field(
        default=False, metadata={"help": "stop gradients through the votes in all but the last routing iteration"}
    )
    leaky_routing: bool = field(
        default=False,
        metadata={
            "help": "the paper's §7 'none-of-the-above' routing: an extra zero logit in the softmax over the "
            "class capsules, its share dropped (the paper's CIFAR-10 model; dynamic routing only)"
        },
    )
    capsule_bias: bool = field(
        default=False,
        metadata={
            "help": "a learned bias per class capsule added before the squash (as the official code's "
            "capsule layers; dynamic routing only)"
        },
    )
    cluster_votes: int = field(
        default=8,
        metadata={"help": "votes K in each cluster of cluster routing (the authors' default 8; cluster routing only)"},
    )
    decoder: bool = field(default=True, metadata={"help": "add the reconstruction decoder"})
    decoder_hidden: tuple[int, ...] = field(default=(512, 1024), metadata={"help": "decoder hidden sizes"})
    decoder_mask: Literal["label", "prediction"] = field(
        default="label",
        metadata={"help": "capsule the decoder reconstructs in training: the true label (paper) or the prediction"},
    )
    recon_weight: float = field(default=0.0005, metadata={"help": "weight of the summed squared reconstruction error"})
    recon_reduction: Literal["sum", "mean"] = field(
        default="sum", metadata={"help": "per-image reduction of squared errors: sum (paper) or mean"}
    )
    router_init_std: float | None = field(
        default=None, metadata={"help": "initial std of W_ij (default: capsnet.routing.default_weight_std)"}
    )
    # The official TensorFlow code's choices (github.com/Sarasra/models, research/capsules; docs/fidelity.md).
    init: Literal["pytorch", "official"] = field(
        default="pytorch",
        metadata={
            "help": "initialisation: pytorch (PyTorch's defaults, W_ij std 1/sqrt(n_primary)) or official "
            "(the TensorFlow code's: truncated normal std 0.05 for conv1, 0.1 for the primary kernel, W_ij "
            "and the decoder; every bias 0.1)"
        },
    )
    primary_routing: bool = field(
        default=False,
        metadata={
            "help": "the official code's one-iteration routing of the primary capsules: the convolution's "
            "output (not its bias) times 1/primary_types (1/(primary_types+1) with leaky routing)"
        },
    )
    # The official code's reduction is the default: no worse on the sample (docs/benchmarks.md), and it is what
    # produced the published figures; under Adam only its ratio to the reconstruction term matters.
    margin_reduction: Literal["sum", "half-mean"] = field(
        default="half-mean",
        metadata={
            "help": "margin loss: half-mean (the official code's: ½ L_k averaged over the batch and the "
            "classes, Eq. 4 / 2n, so the reconstruction term weighs 2n times more than with sum) or sum "
            "over the classes, averaged over the batch (Eq. 4 as printed)"
        },
    )
    # Layouts of other implementations, for their converted weights (capsnet.models.converters).
    primary_grouping: Literal["types", "flat"] = field(
        default="types",
        metadata={
            "help": "primary capsules: one per type and location (paper) or flat (D consecutive values of the "
            "flattened conv map, XifengGuo/CapsNet-Pytorch's layout)"
        },
    )
    coupling: Literal["outputs", "inputs"] = field(
        default="outputs",
        metadata={
            "help": "axis of the coupling softmax (Eq. 3): outputs (paper) or inputs (gram-ai/"
            "capsule-networks' computation; dynamic routing only)"
        },
    )

    def __post_init__(self) -> None:
        record = routing_record(self.routing)  # (a plugin's routing is loaded here)
        if self.routing_iterations is None:
            self.routing_iterations = record.iterations or 1
        ints = (
            "in_channels",
            "conv_channels",
            "kernel_size",
            "primary_types",
            "primary_dim",
            "class_dim",
            "routing_iterations",
            "conv1_stride",
        )
        for name in ints:
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.cluster_votes < 2:
            raise ConfigError(f"cluster_votes must be >= 2 (one vote has no spread), got {self.cluster_votes}")
        if self.n_classes < 2:
            raise ConfigError(f"n_classes must be >= 2, got {self.n_classes}")
        if not isinstance(self.image_size, int):
            self.image_size = tuple(self.image_size)
            if len(self.image_size) != 2:
                raise ConfigError(f"image_size must be a side or [height, width], got {list(self.image_size)}")
        if min(image_hw(self.image_size)) < 1:
            raise ConfigError(f"image_size must be >= 1, got {self.image_size}")
        self.decoder_hidden = tuple(self.decoder_hidden)
        check_loss_options(self)
        self._check_recorded(self.n_classes)
        self._check_routing_options(record)
        if self.coupling == "inputs" and self.leaky_routing:
            raise ConfigError("leaky routing is a softmax over the outputs: it needs coupling='outputs'")
        if min(self.primary_hw) < 1:
            k, (h, w) = self.kernel_size, image_hw(self.image_size)
            raise ConfigError(
                f"images of {h}x{w} are too small for two {k}x{k} {self.padding} convolutions "
                f"(conv1 stride {self.conv1_stride}, primary stride 2)"
            )

    def _check_routing_options(self, record: RoutingRecord) -> None:
        """ConfigError for a routing option (a field some routing's record lists) that `record`'s routing does not
        take, set to other than its default; or a class capsule size the routing cannot route to."""
        fields = self.__dataclass_fields__
        given = [name for name in routing_options() if getattr(self, name) != fields[name].default]
        foreign = [name for name in given if name not in record.options]
        if foreign:
            takers = [r.name for r in ROUTINGS.values() if all(name in r.options for name in foreign)]
            whose = f"options of {', '.join(takers)} routing (routing='{takers[0]}')" if takers else "not options"
            raise ConfigError(f"{', '.join(foreign)}: {whose}, not of routing {self.routing!r}")
        if record.out_dims and self.class_dim not in record.out_dims:
            raise ConfigError(
                f"routing {self.routing!r} routes to class capsules of "
                f"{' or '.join(map(str, record.out_dims))} dimensions: --class-dim "
                f"{record.out_dims[0]}, not {self.class_dim}"
            )

    @property
    def primary_hw(self) -> tuple[int, int]:
        """(H', W') of the primary capsule grid: 28 → conv 9 → 20 → conv 9 stride 2 → 6 (valid padding)."""
        k = self.kernel_size
        pad = k // 2 if self.padding == "same" else 0
        return tuple(  # type: ignore[return-value]
            conv_output_size(conv_output_size(side, k, self.conv1_stride, pad), k, 2, pad)
            for side in image_hw(self.image_size)
        )

    @property
    def primary_grid(self) -> int:
        """Side of a square primary capsule grid (6 for MNIST); the height for a non-square one (see primary_hw)."""
        return self.primary_hw[0]

    @property
    def n_primary(self) -> int:
        h, w = self.primary_hw
        return self.primary_types * h * w


def routing_options() -> list[str]:
    """The CapsNetConfig fields that some routing takes and others do not (the built-in records' options)."""
    return list(dict.fromkeys(name for record in ROUTINGS.values() for name in record.options))


register_config("capsnet", CapsNetConfig)
