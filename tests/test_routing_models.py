"""Issue 14's models and CapsNet's routing options: parameter counts, training from the CLI, save/load, errors."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import SMALL_FLAGS, small_config
from PIL import Image

from capsnet import CapsNet, load_pretrained
from capsnet.cli import main
from capsnet.configs.routings import fully_connected
from capsnet.data import Split, load_dataset
from capsnet.errors import CheckpointError, ConfigError
from capsnet.models.efficient_capsnet import EfficientCapsNet, EfficientCapsNetConfig
from capsnet.models.inverted_attention_capsnet import InvertedAttentionCapsNet
from capsnet.models.registry import MODELS
from capsnet.models.self_routing_capsnet import SelfRoutingCapsNet
from capsnet.training.evaluator import evaluate

ROUTINGS = fully_connected()  # every --routing option of the registry, "dynamic" first


def routing_config(routing: str):
    """The small CapsNet with `routing` (EM routes to 16 pose entries: class capsules of 16 dimensions)."""
    return small_config(routing=routing, **({"class_dim": 16} if routing == "em" else {}))


def routing_flags(routing: str) -> list[str]:
    return [*SMALL_FLAGS[: SMALL_FLAGS.index("--class-dim")], "--class-dim", "16" if routing == "em" else "6",
            *SMALL_FLAGS[SMALL_FLAGS.index("--class-dim") + 2 :]]  # fmt: skip


# Small settings for the models whose paper configurations take seconds per CPU step.
SMALL = {
    "efficient-capsnet": [],
    "inverted-attention-capsnet": ["--stem-channels", "16", "--primary-types", "4", "--capsule-types", "4", "4"],
    "self-routing-capsnet": ["--resnet-widths", "8", "16", "--resnet-blocks", "1", "--primary-types", "4",
                             "--capsule-types", "4", "--capsule-strides", "2"],
    "hvc-capsnet": ["--channels", "4", "4", "6", "6", "6", "8", "8", "8", "8"],
    "deepcaps": ["--conv-channels", "8", "--cell-types", "4", "4", "4", "4", "--cell-dims", "2", "4", "4", "4",
                 "--class-dim", "8", "--decoder-channels", "8", "4", "4"],
    "heinsen-capsnet": ["--conv-channels", "8", "--n-parts", "4"],
    "vb-capsnet": ["--conv-channels", "8", "--primary-types", "4", "--caps1-types", "4", "--caps2-types", "4"],
}  # fmt: skip
QUICK = ["--train-subset", "32", "--test-subset", "32", "--epochs", "1", "--batch-size", "16", "--device", "cpu",
         "--no-progress", "--no-tensorboard"]  # fmt: skip


def _colourful(png: Path) -> float:
    """The fraction of a figure's pixels in colour (a colour map's), not grey: text, axes and the input image are
    grey, so a blank figure, or one of text only, gives 0."""
    x = np.asarray(Image.open(png).convert("RGB")).astype(int)
    return float(((x.max(-1) - x.min(-1)) > 40).mean())


def n_params(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


# ------------------------------------------------------------------------------------------ parameter counts
def test_efficient_capsnet_has_the_papers_161824_parameters():
    model = EfficientCapsNet()
    # conv+BN: (832+64) + (18,496+128) + (36,928+128) + (73,856+256); depthwise 10,496; W 20,480; prior b 160
    assert n_params(model) - n_params(model.decoder) == 161_824
    assert n_params(model.decoder) == 160 * 512 + 512 + 512 * 1024 + 1024 + 1024 * 784 + 784  # 1,411,344


def test_efficient_capsnet_smallnorb_variant():
    cfg = EfficientCapsNetConfig.for_smallnorb()
    model = EfficientCapsNet(config=cfg)
    # conv 7×7×2×32 + 32 = 3,168 (+64 instance norm); convs 2-4 as on MNIST (111,168 + 512 norm);
    # depthwise 8×8×128 + 128 = 8,320; W 16·5·8·16 = 10,240; prior 80
    assert (cfg.feature_size, cfg.n_classes, cfg.in_channels) == (8, 5, 2)
    assert n_params(model) - n_params(model.decoder) == 151_664
    out = model(torch.rand(2, 2, 48, 48))
    assert out.lengths.shape == (2, 5)


def test_inverted_attention_capsnet_parameters_on_cifar():
    # The authors' CIFAR-10 configuration with the simple backbone (apple/ml-capsules-inverted-attention-routing:
    # configs/resnet_backbone_CIFAR10.json, src/layers.py, src/capsule_model.py; they count every parameter, the
    # LayerNorms' γ and β included). The paper's Table 1 could not be read for this check.
    # backbone 3×3 conv 3 → 128 with bias: 3·9·128 + 128 = 3,584; primary 1×1 conv 128 → 32·16, no bias: 65,536
    # + LayerNorm(16) 32; conv caps 3×3, 32 → 32 types, 4×4 W: 9·32·32·16 = 147,456 + LayerNorm 32, twice;
    # class caps 32·5·5 = 800 → 10, 4×4 W: 128,000 + LayerNorm 32; classifier Linear(16, 1) 17
    model = InvertedAttentionCapsNet()
    assert [n_params(layer) for layer in model.capsules] == [147_488, 147_488, 128_032]
    assert n_params(model) == 492_177


def test_inverted_attention_capsnet_agreement_scale_reaches_every_layer():
    """0.25 = 1/√16, the authors' code, by default; 1 (Eq. 2 as the paper writes it) as an option. It scales every
    layer's agreement, which changes the routing from the second pass on (the first is uniform either way)."""
    small = {"in_channels": 1, "image_size": 28, "stem_channels": 16, "primary_types": 4, "capsule_types": (4, 4)}
    torch.manual_seed(0)
    paper = InvertedAttentionCapsNet(**small, agreement_scale=1.0).eval()
    torch.manual_seed(0)
    authors = InvertedAttentionCapsNet(**small).eval()
    assert [layer.scale for layer in paper.capsules] == [1.0] * 3
    assert [layer.scale for layer in authors.capsules] == [0.25] * 3
    x = torch.rand(2, 1, 28, 28)
    assert not torch.allclose(paper(x).lengths, authors(x).lengths, atol=1e-4)
    with torch.no_grad():
        for layer in (*paper.capsules, *authors.capsules):
            layer.iterations = 1
        paper.config.routing_iterations = authors.config.routing_iterations = 1
        torch.testing.assert_close(paper(x).lengths, authors(x).lengths)


def test_self_routing_capsnet_parameters_on_cifar():
    # The authors' CIFAR-10 model (coder3000/SR-CapsNet: models/resnet.py, `resnet_self_routing` with config.py's
    # defaults: 16 planes, 32 capsule types, 16-D poses, depth 1). The paper's own table could not be read here.
    model = SelfRoutingCapsNet()
    # ResNet-20 without its classifier; option-A shortcuts (zero-padded identity) have no parameters:
    # stem 3·9·16 + BN 32 = 464; stage 1 3 × (2 · 16·9·16 + 2 · 32) = 14,016;
    # stage 2 (16·9·32 + 32·9·32 + 2 · 64) + 2 × (2 · 32·9·32 + 2 · 64) = 13,952 + 37,120;
    # stage 3 (32·9·64 + 64·9·64 + 2 · 128) + 2 × (2 · 64·9·64 + 2 · 128) = 55,552 + 147,968: 269,072
    assert n_params(model.backbone) == 269_072
    # primary caps, 3×3 convolutions without bias + BatchNorm: poses 64·9·512 + 1,024, activations 64·9·32 + 64
    assert (n_params(model.primary_pose), n_params(model.primary_act)) == (295_936, 18_496)
    # class caps from all 32·8·8 = 2,048 primary capsules, activations only: W_route 2,048·16·10 + b 2,048·10
    assert len(model.capsules) == 0 and n_params(model.class_caps) == 327_680 + 20_480
    assert n_params(model) == 931_664


def test_self_routing_capsnet_earlier_layout_parameters():
    # capsnet's first layout (the saved_defaults, one conv capsule layer): ResNet-20 with 1×1 conv + BN shortcuts in
    # the first blocks of stages 2, 3: 269,072 + (512 + 64) + (2,048 + 128) = 271,824; primary poses 64·9·512 + 512
    # (biased, no BatchNorm) = 295,424, activations 64·9·32 + 32 + BN 64 = 18,528; conv caps 288 children → 32
    # types: 4×4 W 147,456 + W_route 288·16·32 = 147,456 + b 9,216; class caps 288 → 10: 46,080 + 2,880
    model = SelfRoutingCapsNet(**SelfRoutingCapsNet.saved_defaults, capsule_types=(32,), capsule_strides=(2,))
    assert n_params(model.backbone) == 271_824
    assert n_params(model) == 938_864


def test_self_routing_identity_shortcut_subsamples_and_zero_pads():
    from capsnet.models.self_routing_capsnet import _ZeroPadShortcut

    x = torch.randn(2, 16, 7, 7)
    y = _ZeroPadShortcut(16, 32, 2)(x)  # He et al.'s option A: [0 × 8, x[::2, ::2], 0 × 8] over the channels
    assert y.shape == (2, 32, 4, 4) and torch.equal(y[:, 8:24], x[:, :, ::2, ::2])
    assert not y[:, :8].any() and not y[:, 24:].any()
    with pytest.raises(ConfigError, match="must not decrease"):
        SelfRoutingCapsNet(resnet_widths=(32, 16))
    assert n_params(SelfRoutingCapsNet(resnet_widths=(32, 16), shortcut="projection").backbone) > 0


def test_self_routing_config_saved_before_its_paper_layout_still_loads(tmp_path):
    small = {"in_channels": 1, "image_size": 28, "resnet_widths": (8, 16), "resnet_blocks": 1, "primary_types": 4}
    old = SelfRoutingCapsNet(**small, capsule_types=(4,), capsule_strides=(2,), **SelfRoutingCapsNet.saved_defaults)
    old.eval().save_pretrained(tmp_path / "m")
    path = tmp_path / "m" / "config.json"
    meta = json.loads(path.read_text())
    for key in SelfRoutingCapsNet.saved_defaults:  # as written before these keys existed
        del meta["config"][key]
    path.write_text(json.dumps(meta))
    loaded = load_pretrained(tmp_path / "m")
    assert loaded.config == old.config and (loaded.config.shortcut, loaded.config.primary_batchnorm) == (
        "projection", False)  # fmt: skip
    x = torch.rand(2, 1, 28, 28)
    assert torch.equal(old(x).lengths, loaded(x).lengths)
    new = SelfRoutingCapsNet(**small).eval()  # a config saved now records the keys, so the paper layout reloads
    new.save_pretrained(tmp_path / "n")
    assert load_pretrained(tmp_path / "n").config == new.config


@pytest.mark.parametrize(
    "routing,extra", [("dynamic", 0), ("self-attention", 1152 * 10), ("inverted-attention", 32 + 17),
                      ("self-routing", 1152 * 8 * 10 + 1152 * 10)],
)  # fmt: skip
def test_capsnet_routing_options_parameter_counts(routing, extra):
    assert n_params(CapsNet(routing=routing)) == 8_215_568 + extra


# ------------------------------------------------------------------------------------- outputs and losses
@pytest.mark.parametrize("routing", ROUTINGS)
def test_capsnet_with_each_routing_trains_one_step(routing):
    model = CapsNet(config=routing_config(routing)).train()
    images, labels = torch.rand(4, 1, 28, 28), torch.tensor([0, 1, 2, 3])
    out = model(images, labels, return_coupling=True)
    assert out.lengths.shape == (4, 10) and ((out.lengths >= 0) & (out.lengths <= 1)).all()
    assert torch.allclose(out.coupling.sum(dim=2), torch.ones(4, model.config.n_primary), atol=1e-5)
    total, parts = model.loss(out, images, labels)
    total.backward()
    assert torch.isfinite(total) and "margin" in parts
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_capsnet_rejects_unknown_routing():
    with pytest.raises(ConfigError, match="unknown routing 'nope'; known: dynamic, self-attention"):
        CapsNet(routing="nope")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["efficient-capsnet", "inverted-attention-capsnet", "self-routing-capsnet"])
def test_models_return_capsnet_fields_and_a_loss(name):
    cls = MODELS[name]
    model = cls(in_channels=1, image_size=28).train()
    images, labels = torch.rand(3, 1, 28, 28), torch.tensor([1, 5, 9])
    out = model(images, labels, return_coupling=True)
    assert out._fields[:5] == ("capsules", "lengths", "predictions", "reconstructions", "coupling")
    assert out.lengths.shape == (3, 10) and out.predictions.shape == (3,)
    assert torch.allclose(out.coupling.sum(dim=2), torch.ones(out.coupling.shape[:2]), atol=1e-5)
    total, parts = model.loss(out, images, labels)
    assert total.dim() == 0 and "total" in parts
    total.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    assert cls.paper and cls.designed_for and cls.default_lr > 0
    with pytest.raises(ValueError, match=r"\[B, 1, 28, 28\]"):
        model(torch.rand(3, 1, 32, 32))


def test_efficient_capsnet_recipe_defaults():
    cfg = EfficientCapsNetConfig()
    assert (cfg.recon_weight, cfg.recon_reduction) == (0.392, "mean")
    assert EfficientCapsNet.default_lr == 5e-4 and EfficientCapsNet.default_lr_decay == 0.97
    from capsnet.training.config import TrainConfig

    assert TrainConfig(model="efficient-capsnet").decay_per_epoch == 0.97
    assert TrainConfig(model="efficient-capsnet", lr_decay=0.5).decay_per_epoch == 0.5
    assert TrainConfig(model="efficient-capsnet").learning_rate == 5e-4


# -------------------------------------------------------------------------------------------- save / load
@pytest.mark.slow
@pytest.mark.parametrize("name", ["efficient-capsnet", "inverted-attention-capsnet", "self-routing-capsnet"])
def test_save_load_round_trip_is_strict(tmp_path, name):
    model = MODELS[name](in_channels=1, image_size=28).eval()
    model.save_pretrained(tmp_path / "m")
    loaded = load_pretrained(tmp_path / "m")
    assert type(loaded) is type(model) and loaded.config == model.config
    x = torch.rand(2, 1, 28, 28)
    assert torch.equal(model(x).lengths, loaded(x).lengths)
    from safetensors.torch import load_file, save_file

    state = load_file(str(tmp_path / "m" / "model.safetensors"))
    state["extra"] = torch.zeros(1)
    save_file(state, str(tmp_path / "m" / "model.safetensors"))
    with pytest.raises(CheckpointError, match="do not match"):
        load_pretrained(tmp_path / "m")


@pytest.mark.parametrize("routing", ROUTINGS[1:])
def test_capsnet_routing_option_round_trip(tmp_path, routing):
    model = CapsNet(config=routing_config(routing)).eval()
    model.save_pretrained(tmp_path / "m")
    loaded = CapsNet.from_pretrained(tmp_path / "m")
    assert loaded.config.routing == routing
    x = torch.rand(2, 1, 28, 28)
    assert torch.equal(model(x).lengths, loaded(x).lengths)


# ------------------------------------------------------------------------------------------------- the CLI
@pytest.mark.slow
@pytest.mark.parametrize("name", list(SMALL))
def test_cli_trains_evaluates_and_predicts_each_model(tmp_path, capsys, name):
    out = tmp_path / "run"
    assert main(["train", "--model", name, "--out", str(out), *QUICK, *SMALL[name]]) == 0
    assert "done: best/ is epoch 1 (chosen on validation loss)" in capsys.readouterr().out
    model = load_pretrained(out / "best")
    assert type(model) is MODELS[name]
    test = load_dataset("mnist-sample").test
    assert evaluate(model, Split(test.images[:32], test.labels[:32]))["n"] == 32
    png = tmp_path / "digit.png"
    Image.fromarray(test.images[0, 0].numpy()).save(png)
    assert main(["predict", "--checkpoint", str(out), "--json", str(png)]) == 0
    assert '"class"' in capsys.readouterr().out
    figures = tmp_path / "figures"
    assert main(["visualize", "--checkpoint", str(out), "--out", str(figures), "--limit", "16", "--n", "4"]) == 0
    assert (figures / "routing.png").is_file() == (name != "hvc-capsnet")  # HVCs have no routing to draw
    assert _colourful(figures / "confusion.png") > 0.01  # the matrix's blue cells and scale (tests/test_visualize.py)
    if name != "hvc-capsnet":
        assert _colourful(figures / "routing.png") > 0.2  # the heat maps of the routing weights
    assert (figures / "reconstructions.png").is_file() == (name in ("efficient-capsnet", "deepcaps"))  # decoders
    if name == "efficient-capsnet":  # the whole 2,000-image sample: seconds for this model, minutes for the others
        assert main(["evaluate", "--checkpoint", str(out), "--json"]) == 0
        assert '"accuracy"' in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.parametrize("routing", ROUTINGS[1:])
def test_cli_trains_capsnet_with_each_routing(tmp_path, capsys, routing):
    out = tmp_path / "run"
    assert main(["train", "--routing", routing, "--out", str(out), *QUICK, *routing_flags(routing)]) == 0
    assert load_pretrained(out / "best").config.routing == routing


@pytest.mark.parametrize("name", ["inverted-attention-capsnet", "self-routing-capsnet"])
@pytest.mark.parametrize(
    "options,message",
    [
        ({"capsule_types": (8, 8), "capsule_strides": (2,)}, "one positive value per capsule layer"),
        ({"capsule_types": (0,), "capsule_strides": (1,)}, "one positive value per capsule layer"),
        ({"pose_dim": 8}, "pose_dim must be a square"),
        ({"image_size": 4, "capsule_types": (8, 8), "capsule_strides": (2, 2)}, "too small for the capsule layers"),
    ],
)
def test_capsule_layer_stacks_are_checked(name, options, message):
    with pytest.raises(ConfigError, match=message):
        MODELS[name].config_class(**options)


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--model", "efficient-capsnet", "--backbone-kernels", "5", "3"], "one positive value per convolution"),
        (["--model", "self-routing-capsnet", "--stem-channels", "8"], "not an option of --model self-routing"),
        (["--model", "inverted-attention-capsnet", "--pose-dim", "8"], "pose_dim must be a square"),
        (["--model", "inverted-attention-capsnet", "--agreement-scale", "0"], "agreement_scale must be > 0"),
        (["--routing", "attention"], "unknown routing 'attention'; known: dynamic"),
    ],
)
def test_cli_bad_options_give_one_line_and_exit_2(tmp_path, capsys, argv, message):
    try:
        code = main(["train", "--out", str(tmp_path / "run"), *QUICK, *argv])
    except SystemExit as e:  # argparse's own errors
        code = e.code
    err = capsys.readouterr().err
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SMALL))
def test_each_model_trains_under_ddp(tmp_path, capsys, name, one_rank_ddp):
    """`capsnet train` wraps each model in DDP and trains it (two steps: DDP refuses a parameter left without a
    gradient at the second), on a one-rank gloo group in this process; tests/test_distributed.py launches two."""
    flags = [*QUICK[: QUICK.index("--batch-size")], "--batch-size", "8", *QUICK[QUICK.index("--batch-size") + 2 :]]
    assert main(["train", "--model", name, "--out", str(tmp_path / "run"), *flags, *SMALL[name]]) == 0
    assert len(one_rank_ddp) == 1 and capsys.readouterr().out.count("done: best/ is epoch") == 1
    assert type(load_pretrained(tmp_path / "run" / "last")) is MODELS[name]


def test_capsnet_models_lists_every_registered_model(capsys):
    assert main(["models"]) == 0
    models, routings = capsys.readouterr().out.strip().split("\n\n")  # the models' table, then the routings'
    lines = models.splitlines()
    assert len(lines) == 1 + len(MODELS)
    assert [line.split()[0] for line in routings.splitlines()[1:-1]] == fully_connected()
    assert routings.splitlines()[-1].startswith("(3d: 3D dynamic routing") and "--model deepcaps" in routings
    table = {line.split()[0]: line for line in lines[1:]}
    assert set(table) == set(MODELS)
    assert "1,573,168" in table["efficient-capsnet"] and "161,824" in table["efficient-capsnet"]
    assert "Mazzia" in table["efficient-capsnet"] and "MNIST" in table["efficient-capsnet"]
    assert "8,215,568" in table["capsnet"] and "6,804,224" in table["capsnet"]
    assert "492,177" in table["inverted-attention-capsnet"] and "CIFAR-10" in table["inverted-attention-capsnet"]
    assert main(["models", "--json"]) == 0
    assert capsys.readouterr().out.count('"parameters"') == len(MODELS)


@pytest.mark.parametrize("routing", ROUTINGS)
def test_routing_figure_of_capsnet_with_each_routing(tmp_path, routing):
    from capsnet.viz.routing import plot_routing

    pytest.importorskip("matplotlib")
    model = CapsNet(config=routing_config(routing)).eval()
    path = plot_routing(model, torch.rand(1, 28, 28), 3, tmp_path / "routing.png")
    assert _colourful(path) > 0.2  # the heat maps of the routing weights (measured: 0.40-0.43 of the pixels)


def test_visualize_skips_routing_for_a_model_without_weights(tmp_path):
    from capsnet.models.baseline import BaselineCNN
    from capsnet.viz.figures import visualize

    pytest.importorskip("matplotlib")
    BaselineCNN(channels=(4,), hidden=(8,)).save_pretrained(tmp_path / "m")
    notes = []
    written = visualize(tmp_path / "m", tmp_path / "fig", dataset="mnist-sample", limit=8, log=notes.append)
    assert set(written) == {"confusion"}
    assert any("no routing weights" in n for n in notes)


@pytest.mark.slow
@pytest.mark.parametrize("routing", ROUTINGS[1:])
def test_capsnet_trains_under_ddp_with_each_routing(tmp_path, routing, one_rank_ddp):
    """As test_each_model_trains_under_ddp, for CapsNet with each routing but dynamic (the default, which
    tests/test_distributed.py trains on two processes)."""
    flags = [*QUICK[: QUICK.index("--batch-size")], "--batch-size", "8", *QUICK[QUICK.index("--batch-size") + 2 :]]
    assert main(["train", "--routing", routing, "--out", str(tmp_path / "run"), *flags, *routing_flags(routing)]) == 0
    assert len(one_rank_ddp) == 1 and load_pretrained(tmp_path / "run" / "last").config.routing == routing
