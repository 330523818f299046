"""Efficient-CapsNet as its authors' code builds it (docs/fidelity.md): block order, Keras ε, momentum and
initialisers, the length ε, the smallNORB Generator and the MultiMNIST preset, the older layout of saved folders,
and the authors' input pipelines (÷ 256 on MNIST; smallNORB standardized per channel, 96 → 64, 48×48 crops)."""

import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from keras_reference import resize_bilinear

from capsnet import load_pretrained
from capsnet.data import Split, standins
from capsnet.data.imageaug import DEFAULTS, AugmentSpec, resolve_augment
from capsnet.data.scaling import channel_stats
from capsnet.data.smallnorb import read_matrix
from capsnet.errors import ConfigError, DatasetError
from capsnet.inference import predict
from capsnet.models.efficient_capsnet import EfficientCapsNet, EfficientCapsNetConfig
from capsnet.models.recipe import InputRecipe, recipe_of
from capsnet.nn.keras_init import TRUNCATION_STD, keras_fans
from capsnet.training.classification import ClassificationTask
from capsnet.training.config import TrainConfig
from capsnet.training.evaluator import evaluate


def n_params(m: torch.nn.Module) -> int:
    return sum(p.numel() for p in m.parameters())


# ------------------------------------------------------------------------------------------ the backbone
@pytest.mark.parametrize("order", ["conv-act-norm", "conv-norm-act"])
@pytest.mark.parametrize("norm", ["batch", "instance"])
def test_block_order_eps_and_momentum(order, norm):
    model = EfficientCapsNet(backbone_order=order, backbone_norm=norm).eval()
    kinds = [type(m).__name__ for m in model.backbone][:3]
    expected = ["Conv2d", "ReLU", "BatchNorm2d" if norm == "batch" else "InstanceNorm2d"]
    assert kinds == (expected if order == "conv-act-norm" else [expected[0], expected[2], expected[1]])
    norms = [m for m in model.backbone if "Norm" in type(m).__name__]
    assert all(m.eps == 1e-3 for m in norms)  # Keras's ε
    if norm == "batch":
        assert all(m.momentum == 0.01 for m in norms)  # Keras momentum 0.99 is PyTorch's 0.01
        for m in norms:  # non-trivial running statistics, so that the order shows
            m.running_mean.uniform_(0.2, 0.8)
            m.running_var.uniform_(0.5, 2.0)
    # Literal transcription of one block with functional ops, in each order.
    x = torch.rand(2, 1, 28, 28)
    conv, nrm = model.backbone[0], norms[0]
    y = F.conv2d(x, conv.weight, conv.bias)

    def normalise(t):
        if norm == "batch":
            return F.batch_norm(t, nrm.running_mean, nrm.running_var, nrm.weight, nrm.bias, False, 0.0, 1e-3)
        mean, var = t.mean(dim=(2, 3), keepdim=True), t.var(dim=(2, 3), keepdim=True, unbiased=False)
        return (t - mean) / torch.sqrt(var + 1e-3) * nrm.weight.view(1, -1, 1, 1) + nrm.bias.view(1, -1, 1, 1)

    y = normalise(F.relu(y)) if order == "conv-act-norm" else F.relu(normalise(y))
    with torch.no_grad():
        torch.testing.assert_close(model.backbone[:3](x), y, atol=1e-5, rtol=1e-5)


def test_the_two_orders_differ():
    a = EfficientCapsNet().eval()
    for m in a.backbone:
        if isinstance(m, torch.nn.BatchNorm2d):  # (with zero means and unit variances BN commutes with ReLU)
            m.running_mean.uniform_(0.2, 0.8)
    b = EfficientCapsNet(backbone_order="conv-norm-act").eval()
    moved = {}
    for key, value in a.state_dict().items():  # norms at backbone.2, 5, ... in one order, at 1, 4, ... in the other
        part = key.split(".")
        if part[0] == "backbone" and int(part[1]) % 3 == 2:
            part[1] = str(int(part[1]) - 1)
        moved[".".join(part)] = value
    b.load_state_dict(moved, strict=True)
    x = torch.rand(4, 1, 28, 28)
    assert not torch.allclose(a(x).lengths, b(x).lengths, atol=1e-3)


def test_lengths_have_the_keras_epsilon():
    model = EfficientCapsNet().eval()
    out = model(torch.rand(2, 1, 28, 28))
    torch.testing.assert_close(out.lengths, torch.sqrt((out.capsules**2).sum(-1) + 1e-7))
    plain = EfficientCapsNet(length_eps=0.0).eval()
    plain.load_state_dict(model.state_dict())
    v = plain(torch.rand(2, 1, 28, 28))
    torch.testing.assert_close(v.lengths, v.capsules.norm(dim=-1))


# ----------------------------------------------------------------------------------------- initialisation
def test_keras_fans():
    assert keras_fans((5, 5, 1, 32)) == (25, 800)  # conv kernel [kh, kw, in, out]
    assert keras_fans((9, 9, 1, 128)) == (81, 81 * 128)  # the depthwise kernel: one input per group
    assert keras_fans((10, 16, 8, 16)) == (1280, 2560)  # FCCaps W [k, j, i, z]: receptive field k·j = 160
    assert keras_fans((160, 512)) == (160, 512)


def test_keras_initialisation_is_the_authors():
    torch.manual_seed(0)
    model = EfficientCapsNet(config=EfficientCapsNetConfig.for_smallnorb())
    convs = [m for m in model.backbone if isinstance(m, torch.nn.Conv2d)]
    for conv in convs:  # he_normal: truncated normal of std √(2 / fan_in) / 0.8796, cut at ±2 of that std
        fan_in = conv.weight[0].numel()
        bound = 2 * math.sqrt(2 / fan_in) / TRUNCATION_STD
        assert conv.weight.abs().max() <= bound and torch.all(conv.bias == 0)
        assert conv.weight.std().item() == pytest.approx(math.sqrt(2 / fan_in), rel=0.15)
    norms = [m for m in model.backbone if isinstance(m, torch.nn.InstanceNorm2d)]
    assert all(m.weight.abs().max() <= 0.05 and m.bias.abs().max() <= 0.05 for m in norms)  # random_uniform ±0.05
    limit = math.sqrt(6 / (64 + 64 * 128))  # glorot_uniform of the depthwise [8, 8, 1, 128] kernel
    assert model.primary.weight.abs().max() <= limit and torch.all(model.primary.bias == 0)
    w = model.class_caps.weight  # he_normal over Keras's fans of [5, 16, 8, 16]: fan_in 8·80 = 640
    assert w.std().item() == pytest.approx(math.sqrt(2 / 640), rel=0.05) and torch.all(model.class_caps.prior == 0)
    assert all(torch.all(c.bias == 0) for c in (*model.decoder.convs, model.decoder.out))
    mnist = EfficientCapsNet()
    assert all(torch.all(m.weight == 1) and torch.all(m.bias == 0) for m in mnist.backbone
               if isinstance(m, torch.nn.BatchNorm2d))  # fmt: skip
    linears = [m for m in mnist.decoder.net if isinstance(m, torch.nn.Linear)]
    assert linears[0].weight.std().item() == pytest.approx(math.sqrt(2 / 160), rel=0.05)  # he_normal
    assert linears[2].weight.std().item() == pytest.approx(math.sqrt(2 / (1024 + 784)), rel=0.05)  # glorot_normal


def test_pytorch_initialisation_keeps_the_layer_defaults():
    torch.manual_seed(0)
    model = EfficientCapsNet(init_style="pytorch")
    assert model.backbone[0].bias.abs().sum() > 0  # PyTorch's uniform biases
    assert model.class_caps.weight.std().item() == pytest.approx(math.sqrt(2 / 8), rel=0.05)
    custom = EfficientCapsNet(router_init_std=0.01)
    assert custom.class_caps.weight.std().item() == pytest.approx(0.01, rel=0.05)


# ---------------------------------------------------------------------------------------- presets
def test_smallnorb_preset_has_the_generator():
    cfg = EfficientCapsNetConfig.for_smallnorb()
    model = EfficientCapsNet(config=cfg).train()
    assert cfg.decoder_type == "conv" and n_params(model.decoder) == 229_570  # the authors' Generator
    x, y = torch.randn(3, 2, 48, 48), torch.tensor([0, 3, 4])
    out = model(x, y)
    assert out.reconstructions.shape == (3, 2, 48, 48)
    loss, _ = model.loss(out, x, y)
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    with pytest.raises(ConfigError, match="decoder_type conv"):
        EfficientCapsNet(decoder_type="conv")  # 28 is not 8·k − 16


def test_multimnist_preset_is_the_authors():
    cfg = EfficientCapsNetConfig.for_multimnist()
    model = EfficientCapsNet(config=cfg)
    assert (cfg.image_size, cfg.feature_size, cfg.primary_kernel, cfg.primary_stride) == (36, 6, 5, 2)
    assert n_params(model) - n_params(model.decoder) == 161_824 - 81 * 128 + 25 * 128  # 5×5 depthwise: 154,656
    assert cfg.recon_weight == pytest.approx(0.392 / 2) and cfg.input_divisor == 255
    from capsnet.experiments.multimnist import EFFICIENT_CAPSNET_SETTING, MultiMNISTTask

    digits = Split(torch.randint(0, 256, (40, 1, 28, 28), dtype=torch.uint8), torch.arange(40) % 10)
    setting = {**EFFICIENT_CAPSNET_SETTING, "pairs_per_digit": 1, "test_pairs_per_digit": 2}  # (small, for a test)
    assert (setting["max_shift"], setting["combine"], EFFICIENT_CAPSNET_SETTING["pairs_per_digit"]) == (6, "sum", 10)
    task = MultiMNISTTask(train=digits, test=digits, **setting)
    assert len(task.test_pairs[0]) == 80
    batch = next(task.batches(epoch=0, batch_size=8, seed=0, rank=0, world_size=1, device=torch.device("cpu"),
                              generator=torch.Generator()))  # fmt: skip
    model.train()
    out = task.forward(task.wrap(model), batch)
    loss, correct = task.loss(model, out, batch)
    loss.backward()
    assert torch.isfinite(loss) and 0 <= int(correct) <= 8
    assert task.model_fields()["input_divisor"] == 255.0


def test_primary_convolution_must_reach_one_by_one():
    with pytest.raises(ConfigError, match="into 1×1"):
        EfficientCapsNet(primary_kernel=5)  # 9×9 map, stride 1: 5×5 outputs
    with pytest.raises(ConfigError, match="norm_eps"):
        EfficientCapsNetConfig(norm_eps=0)


# --------------------------------------------------------------------------------------- older folders
def test_folders_saved_before_the_fidelity_keys_load_as_trained(tmp_path):
    """A save_pretrained folder of the earlier layout: conv → norm → activation, PyTorch's ε, momentum and
    initialisation, plain norms, ÷ 255; its config.json has none of the new keys."""
    old = {"backbone_order": "conv-norm-act", "norm_eps": 1e-5, "norm_momentum": 0.1, "init_style": "pytorch",
           "length_eps": 0.0, "input_divisor": 255.0}  # fmt: skip
    model = EfficientCapsNet(**old).eval()
    model.save_pretrained(tmp_path / "m")
    meta = json.loads((tmp_path / "m" / "config.json").read_text())
    new_keys = [*old, "primary_kernel", "primary_stride", "decoder_type", "channel_standardize", "channel_mean",
                "channel_std"]  # fmt: skip
    for key in new_keys:
        meta["config"].pop(key)
    for key in ("standardize", "class_names", "digits", "source_size"):  # it had no recorded data fields either
        meta["config"].pop(key)
    (tmp_path / "m" / "config.json").write_text(json.dumps(meta))
    loaded = load_pretrained(tmp_path / "m")  # strict: the norms sit at backbone.1, 4, 7, 10 as saved
    assert {k: getattr(loaded.config, k) for k in old} == old
    x = torch.rand(3, 1, 28, 28)
    assert torch.equal(loaded(x).lengths, model(x).lengths)
    assert next(m for m in loaded.backbone if isinstance(m, torch.nn.BatchNorm2d)).eps == 1e-5
    assert recipe_of(loaded).statistics() == ((0.0,), (255.0,))


# ------------------------------------------------------------------------------------- input pipelines
def test_recipes_per_data_format():
    recipes = EfficientCapsNet.data_recipes
    norb = resolve_augment("auto", "smallnorb", recipes=recipes)
    assert norb == AugmentSpec(crop=(48, 48), brightness=2.0, contrast=(0.5, 1.5), channel_standardize=True)
    assert resolve_augment("auto", "idx", shift=3, recipes=recipes) == AugmentSpec(shift=3, divisor=256.0)
    sabour = AugmentSpec(crop=(32, 32), brightness=63 / 255, contrast=(0.2, 1.8), standardize=True)  # official code
    assert resolve_augment("auto", "smallnorb") == DEFAULTS["smallnorb"] == sabour  # CapsNet, EM
    assert resolve_augment("auto", "cifar10", recipes=recipes) == DEFAULTS["cifar10"]
    assert resolve_augment("shift=2", "idx", recipes=recipes).divisor == 255  # an explicit --augment
    text = "crop=48x48,brightness=2,contrast=0.5:1.5,divisor=256,channel-standardize"
    assert str(AugmentSpec.parse(text)) == text and AugmentSpec.parse(str(norb)) == norb
    with pytest.raises(ConfigError, match="divisor must be > 0"):
        AugmentSpec.parse("divisor=0")


def test_standardized_batches_are_not_clipped():
    spec = AugmentSpec(crop=(4, 4), brightness=2.0, contrast=(0.5, 1.5), channel_standardize=True)
    x = torch.randn(64, 2, 6, 6) * 3
    y = spec(x, torch.Generator().manual_seed(0))
    assert y.min() < -1 and y.max() > 2  # no clamp to [0, 1]
    assert AugmentSpec(brightness=2.0)(x.clamp(0, 1), torch.Generator().manual_seed(0)).max() <= 1


def test_input_scaling():
    x01 = torch.randint(0, 256, (2, 2, 3, 3)).float() / 255
    assert torch.equal(InputRecipe().scale(x01), x01)
    torch.testing.assert_close(InputRecipe(divisor=256.0).scale(x01), x01 * 255 / 256)
    s = InputRecipe(channel_standardize=True, mean=(10.0, 20.0), std=(2.0, 4.0)).scale
    p = x01 * 255
    torch.testing.assert_close(s(x01), (p - torch.tensor([10.0, 20.0]).view(1, 2, 1, 1)) /
                               torch.tensor([2.0, 4.0]).view(1, 2, 1, 1), atol=1e-4, rtol=1e-5)  # fmt: skip
    with pytest.raises(DatasetError, match="2 mean values for images with 3 channels"):
        s(torch.rand(1, 3, 2, 2))


def test_mnist_recipe_divides_by_256():
    task = ClassificationTask.from_config(TrainConfig(model="efficient-capsnet", train_subset=32, test_subset=32))
    assert task.spec.divisor == 256 and task.model_fields()["input_divisor"] == 256.0
    batch = next(task.batches(epoch=0, batch_size=4, seed=0, rank=0, world_size=1, device=torch.device("cpu"),
                              generator=torch.Generator().manual_seed(0)))  # fmt: skip
    assert batch.images.max() <= 255 / 256
    other = ClassificationTask.from_config(TrainConfig(model="capsnet", train_subset=32, test_subset=32))
    assert other.spec.divisor == 255 and other.model_fields()["input_divisor"] == 255.0
    model = EfficientCapsNet(input_divisor=256.0).eval()  # evaluate feeds it p / 256
    split = Split(task.test.images[:8], task.test.labels[:8])
    with torch.no_grad():
        expected = model(split.images.float() / 256).predictions
    assert evaluate(model, split)["accuracy"] == (expected == split.labels).float().mean().item()


def test_smallnorb_reader_resizes_like_tensorflow(tmp_path):
    from capsnet.data import load_dataset

    folder = standins.write_smallnorb(tmp_path / "n", n_train=6, n_test=5, gz=False)
    dat = read_matrix(next(folder.glob("*testing-dat*")))  # [5, 2, 96, 96]
    ds = load_dataset(str(folder), image_size="64")
    assert tuple(ds.test.images.shape) == (5, 2, 64, 64)
    expected = np.round(resize_bilinear(dat.astype(np.float64), 64))  # tf.image.resize's bilinear (no antialias)
    assert np.abs(ds.test.images.numpy().astype(np.float64) - expected).max() <= 1  # float32 vs float64 rounding
    mean, std = ds.test.channel_stats
    np.testing.assert_allclose(mean, dat.mean(axis=(0, 2, 3)), rtol=1e-12)  # of the 96×96 originals
    np.testing.assert_allclose(std, dat.std(axis=(0, 2, 3)), rtol=1e-12)
    assert load_dataset(str(folder)).test.images.shape[-1] == 48  # the default stays 48 (2×2 block averages)
    with pytest.raises(DatasetError, match="smallNORB images are square"):
        load_dataset(str(folder), image_size="64x48")


def test_efficient_capsnet_smallnorb_recipe_end_to_end(tmp_path):
    """The authors' smallNORB pipeline: 64×64, standardized with the training split's statistics (of its 96×96
    originals), random 48×48 crops with brightness and contrast jitter; evaluate centre-crops the test split
    standardized with its own statistics. The capsnet and EM models keep Sabour's 48 → 32 crops."""
    folder = standins.write_smallnorb(tmp_path / "n", n_train=12, n_test=6, gz=False)
    task = ClassificationTask.from_config(TrainConfig(model="efficient-capsnet", dataset=str(folder)))
    fields = task.model_fields()
    assert (task.in_channels, task.image_size, task.source_size) == (2, 48, (64, 64))
    train = read_matrix(next(folder.glob("*training-dat*"))).astype(np.float64)
    np.testing.assert_allclose(fields["channel_mean"], train.mean(axis=(0, 2, 3)), rtol=1e-12)
    np.testing.assert_allclose(fields["channel_std"], train.std(axis=(0, 2, 3)), rtol=1e-12)
    assert fields["channel_standardize"] and task.spec.brightness == 2.0
    n = len(task.train)  # (11: one of the 12 is held out for validation, standardized as the training split)
    batch = next(task.batches(epoch=0, batch_size=n, seed=0, rank=0, world_size=1, device=torch.device("cpu"),
                              generator=torch.Generator().manual_seed(0)))  # fmt: skip
    assert batch.images.shape == (n, 2, 48, 48) and batch.images.min() < 0  # standardized, jittered, not clipped
    sabour = ClassificationTask.from_config(TrainConfig(model="capsnet", dataset=str(folder)))
    assert (sabour.image_size, sabour.source_size, sabour.spec) == (32, (48, 48), DEFAULTS["smallnorb"])

    cfg = EfficientCapsNetConfig.for_smallnorb(**{k: v for k, v in fields.items() if k != "standardize"})
    model = EfficientCapsNet(config=cfg).eval()
    test = task.test
    mean, std = channel_stats(test)  # the test split's own statistics, as the authors standardize their test set
    x = (test.images.double() - torch.tensor(mean).view(1, 2, 1, 1)) / torch.tensor(std).view(1, 2, 1, 1)
    with torch.no_grad():
        expected = model(x[:, :, 8:56, 8:56].float()).predictions
    assert evaluate(model, test)["accuracy"] == pytest.approx((expected == test.labels).double().mean().item())
    image = tmp_path / "pair.png"
    from PIL import Image

    Image.fromarray(np.zeros((64, 64), np.uint8)).save(image)
    nostats = EfficientCapsNet(config=EfficientCapsNetConfig.for_smallnorb(channel_standardize=True, digits=False))
    with pytest.raises(DatasetError, match="does not record"):  # single images need the training statistics
        predict(nostats, [image])


@pytest.mark.slow
def test_cli_trains_the_smallnorb_preset_and_evaluates_it(tmp_path, capsys):
    from capsnet.cli import main

    folder = standins.write_smallnorb(tmp_path / "n", n_train=16, n_test=8, gz=False)
    preset = ["--backbone-kernels", "7", "3", "3", "3", "--backbone-strides", "2", "1", "1", "2", "--backbone-norm",
              "instance", "--backbone-activation", "leaky-relu", "--decoder-type", "conv"]  # fmt: skip
    run = tmp_path / "run"
    argv = ["train", "--model", "efficient-capsnet", "--dataset", str(folder), "--epochs", "1", "--batch-size", "8",
            "--no-progress", "--no-tensorboard", "--out", str(run), *preset]  # fmt: skip
    assert main(argv) == 0
    model = load_pretrained(run / "last")
    assert model.config == EfficientCapsNetConfig.for_smallnorb(**{
        k: getattr(model.config, k) for k in ("class_names", "digits", "source_size", "channel_standardize",
                                              "channel_mean", "channel_std")})  # fmt: skip
    assert model.config.source_size == (64, 64) and model.config.channel_standardize
    capsys.readouterr()
    assert main(["evaluate", "--checkpoint", str(run), "--dataset", str(folder), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["n"] == 8
