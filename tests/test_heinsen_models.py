"""Heinsen's routings in models: CapsNet with `--routing heinsen` / `heinsen-vector`, and the authors' smallNORB
model `heinsen-capsnet` (its size, its recipe, training from the command line, reloading)."""

import pytest
import torch
from helpers import SMALL_FLAGS

from capsnet.cli import main
from capsnet.configs.heinsen_capsnet import HeinsenCapsNetConfig
from capsnet.configs.routings import routing_record
from capsnet.data.datasets import load_dataset
from capsnet.data.split import Split
from capsnet.errors import ConfigError
from capsnet.models.capsnet import CapsNet
from capsnet.models.heinsen_capsnet import HeinsenCapsNet
from capsnet.models.pretrained import load_pretrained
from capsnet.models.registry import MODELS
from capsnet.routing.heinsen import HeinsenRouting
from capsnet.routing.heinsen_vector import HeinsenVectorRouting
from capsnet.training.evaluate import evaluate


def n_params(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


QUICK = ["--train-subset", "32", "--test-subset", "32", "--epochs", "1", "--batch-size", "16", "--device", "cpu",
         "--no-progress", "--no-tensorboard"]  # fmt: skip


def test_the_authors_smallnorb_model_has_their_size_and_recipe():
    model = HeinsenCapsNet()
    assert n_params(model) == 271_688  # their SmallNORBClassifier(n_objs=5, n_parts=64, d_chns=64)
    cfg = model.config
    assert (cfg.in_channels, cfg.image_size, cfg.padding, cfg.grid_side(0), cfg.n_children) == (2, 96, 0, 9, 5184)
    first, second = model.routings
    assert isinstance(first, HeinsenRouting) and first.in_caps == -1 and first.weight.shape == (1, 64, 4, 4)
    assert (second.in_caps, second.out_caps, second.rows, second.iterations) == (64, 5, 4, 3)
    assert HeinsenCapsNet.default_lr == 5e-4 and HeinsenCapsNet.default_batch_size == 20
    assert HeinsenCapsNet.default_lr_decay**50 == pytest.approx(1e-5 / 5e-4)
    assert HeinsenCapsNet.data_recipes["smallnorb"] == {"augment": "shift=16", "image_size": "96"}
    assert MODELS["heinsen-capsnet"] is HeinsenCapsNet and routing_record("heinsen").models == ("heinsen-capsnet",)


def test_small_images_get_padded_convolutions_and_too_small_ones_are_refused():
    assert HeinsenCapsNetConfig(image_size=29).padding == 0
    assert HeinsenCapsNetConfig(image_size=28).padding == 1  # (28: one pixel short of the authors' stem)
    assert HeinsenCapsNetConfig(image_size=28).n_children == 64 * 4 * 4
    with pytest.raises(ConfigError, match="too small"):
        HeinsenCapsNetConfig(image_size=28, conv_padding=0)
    with pytest.raises(ConfigError, match="conv_padding must be 0 or 1"):
        HeinsenCapsNetConfig(conv_padding=2)


def test_heinsen_capsnet_trains_one_step_and_every_parameter_learns():
    torch.manual_seed(0)
    model = HeinsenCapsNet(in_channels=1, image_size=28, n_classes=10, conv_channels=8, n_parts=4).train()
    images, labels = torch.rand(4, 1, 28, 28), torch.tensor([0, 1, 2, 3])
    out = model(images, labels, return_coupling=True)
    assert out.logits.shape == (4, 10) and ((out.lengths > 0) & (out.lengths < 1)).all()
    assert out.capsules.shape == (4, 10, 16) and torch.equal(out.predictions, out.logits.argmax(1))
    torch.testing.assert_close(out.coupling.sum(-1), torch.ones(4, 4))
    total, parts = model.loss(out, images, labels)
    total.backward()
    torch.testing.assert_close(total, torch.nn.functional.cross_entropy(out.logits, labels))
    assert set(parts) == {"cross_entropy", "total"}
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    with pytest.raises(ValueError, match=r"\[B, 1, 28, 28\]"):
        model(torch.rand(2, 1, 32, 32))


@pytest.mark.parametrize("routing,layer", [("heinsen", HeinsenRouting), ("heinsen-vector", HeinsenVectorRouting)])
def test_capsnet_builds_each_heinsen_routing_with_its_iterations(routing, layer):
    model = CapsNet(routing=routing)
    assert type(model.class_caps) is layer and model.class_caps.in_caps == 1152
    assert model.config.routing_iterations == {"heinsen": 3, "heinsen-vector": 2}[routing]
    extra = {"heinsen": 1152 * 10 * (8 * 16 + 16 + 2) - 1152 * 10 * 8 * 16,  # B, β^use, β^ign beside W
             "heinsen-vector": -1152 * 10 * 8 * 16 + 1152 * 8 + 1152 + 10 * 8 + 8 * 16 + 10 * 16 + 16 * 8 + 10 * 8
             + 10 * 8 + 1152 * 10 * 4 + 17}[routing]  # fmt: skip  # (W_A, b_A, F, G, W_S, B_S, β's, classifier)
    assert n_params(model) == 8_215_568 + extra


@pytest.mark.slow
@pytest.mark.parametrize("routing", ["heinsen", "heinsen-vector"])
def test_cli_trains_capsnet_with_a_heinsen_routing_and_reloads_it(tmp_path, routing):
    out = tmp_path / "run"
    assert main(["train", "--routing", routing, "--out", str(out), *QUICK, *SMALL_FLAGS]) == 0
    model = load_pretrained(out / "best")
    assert model.config.routing == routing and type(model.class_caps).__name__.startswith("Heinsen")
    x = torch.rand(2, 1, 28, 28)
    model.eval()
    assert torch.isfinite(model(x).lengths).all()


@pytest.mark.slow
def test_cli_trains_evaluates_and_reloads_heinsen_capsnet(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "--model", "heinsen-capsnet", "--out", str(out), *QUICK, "--conv-channels", "8",
                 "--n-parts", "4"]) == 0  # fmt: skip
    assert "done: best/ is epoch 1" in capsys.readouterr().out
    model = load_pretrained(out / "best")
    assert type(model) is HeinsenCapsNet and model.config.padding == 1 and model.config.in_channels == 1
    test = load_dataset("mnist-sample").test
    assert evaluate(model, Split(test.images[:32], test.labels[:32]))["n"] == 32
