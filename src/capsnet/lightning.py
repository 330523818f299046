"""A capsnet model in a Lightning `Trainer`: `CapsuleModule` wraps any registered model with its own loss,
its input recipe and its metrics (the `lightning` extra).

    module = CapsuleModule(capsnet.create_model("capsnet"), augment="shift=2")   # the paper's MNIST shift
    lightning.Trainer(max_epochs=10).fit(module, train_loader, val_loader)       # batches of (raw images, labels)
    module = CapsuleModule.load_from_checkpoint("epoch=9.ckpt")                  # the model rebuilt from its config
    module.model.save_pretrained("weights/")                                     # capsnet's own format

Batches are (images, labels): raw images [B, C, H, W] (uint8, or floats in [0, 1]) of the size the model records,
and class indices [B]. Each step turns the images into the model's input by the recipe its config records
(capsnet.models.recipe: centre crop, values), the training step after the random augmentation `augment` (an
AugmentSpec text: "shift=2"; none by default), and minimises `model.loss` (the margin loss and reconstruction of
CapsNet, cross-entropy of the baseline, ...). It logs {train,val,test}_loss, _acc and the loss's parts.

The optimizer is Adam at the model's `default_lr`, decayed per epoch by `lr_decay` (default: the model's own
`default_lr_decay` where its paper gives one, else none). The checkpoint's hyperparameters are the model's
`model_type` and config, so `load_from_checkpoint` needs nothing else. A model with a data-dependent
initialisation (EMCapsNet's β_a) gets it from `capsnet train` or `capsnet.fit`, not here.

May import: training and below (a layer beside experiments and viz); Lightning itself, which is the extra.
"""

from __future__ import annotations

from typing import Any

import torch

from .config import from_dict, to_dict
from .data.imageaug import AugmentSpec
from .errors import ConfigError
from .models.pretrained import Pretrained
from .models.recipe import model_input, recipe_of
from .models.registry import model_class
from .pixels import to_float

try:
    import lightning
except ImportError:
    raise ImportError("capsnet.lightning needs Lightning: pip install 'capsnet[lightning]'") from None


class CapsuleModule(lightning.LightningModule):
    """A LightningModule that trains `model` (any registered capsnet model) with its own loss (see the module
    docstring). `model_type` and `config` rebuild the model instead (what `load_from_checkpoint` passes)."""

    def __init__(
        self,
        model: Pretrained | None = None,
        *,
        lr: float | None = None,
        lr_decay: float | None = None,
        augment: str | None = None,
        model_type: str | None = None,
        config: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        if model is None:
            if model_type is None or config is None:
                raise ConfigError("CapsuleModule: give a capsnet model (or model_type= and config=)")
            cls = model_class(model_type)
            model = cls(config=from_dict(cls.config_class, config, what=f"CapsuleModule({model_type!r})"))
        if not isinstance(model, Pretrained) or not callable(getattr(model, "loss", None)):
            raise ConfigError(f"CapsuleModule: {type(model).__name__} is not a capsnet model (a registered one)")
        self.model = model
        self.lr = float(lr if lr is not None else type(model).lr_for(model.config))  # the model's own for its size
        self.lr_decay = float(lr_decay if lr_decay is not None else getattr(type(model), "default_lr_decay", 1.0))
        self.augment = AugmentSpec.parse(augment) if augment else None
        if not (self.lr > 0 and 0 < self.lr_decay <= 1):
            raise ConfigError(f"CapsuleModule: lr {self.lr:g} must be > 0 and lr_decay {self.lr_decay:g} in (0, 1]")
        self.save_hyperparameters(
            {
                "model_type": model.model_type,
                "config": to_dict(model.config),
                "lr": self.lr,
                "lr_decay": self.lr_decay,
                "augment": augment,
            }
        )

    def forward(self, images: torch.Tensor) -> Any:
        """The model's output for raw images [B, C, H, W] (its input recipe applied)."""
        return self.model(model_input(self.model, images))

    def inputs(self, images: torch.Tensor, *, train: bool) -> torch.Tensor:
        """The model's input [B, C, h, w] for raw images: the recipe's values, then in training the augmentation
        (its random crops from the recipe's source size), else the recipe's centre crop."""
        if train and self.augment is not None:
            return self.augment(recipe_of(self.model).scale(to_float(images)))
        return model_input(self.model, images)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        images, labels = batch
        x = self.inputs(images, train=True)
        out = self.model(x, labels)  # (labels: the decoder reconstructs the true class in training, §4.1)
        return self._score("train", out, x, labels)

    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self._evaluate("val", batch)

    def test_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self._evaluate("test", batch)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        """The predicted classes [B] of a batch of raw images (or of (images, labels))."""
        images = batch[0] if isinstance(batch, (tuple, list)) else batch
        return self(images).predictions

    def _evaluate(self, stage: str, batch: Any) -> torch.Tensor:
        images, labels = batch
        x = self.inputs(images, train=False)
        return self._score(stage, self.model(x), x, labels)

    def _score(self, stage: str, out: Any, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The model's loss (Eq. 4 + reconstruction for CapsNet), logged with the accuracy and the loss's parts."""
        loss, parts = self.model.loss(out, x, labels)  # type: ignore[operator]
        n, sync = len(labels), stage != "train"
        self.log(f"{stage}_loss", loss, prog_bar=True, batch_size=n, sync_dist=sync)
        self.log(
            f"{stage}_acc", (out.predictions == labels).float().mean(), prog_bar=True, batch_size=n, sync_dist=sync
        )
        for name, value in (parts or {}).items():
            if isinstance(value, torch.Tensor) and value.numel() == 1:
                self.log(f"{stage}_{name}", value, batch_size=n, sync_dist=sync)
        return loss

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.Adam(self.model.parameters(), lr=self.lr)
        if self.lr_decay == 1.0:
            return optimizer
        schedule = torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=self.lr_decay)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "epoch"}}


__all__ = ["CapsuleModule"]
