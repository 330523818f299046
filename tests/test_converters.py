"""Converters of other implementations' PyTorch weights (capsnet.models.converters).

Each test builds a state dict with the key names and shapes the implementation's own code creates (read from its
source: XifengGuo/CapsNet-Pytorch capsulelayers.py / capsulenet.py, gram-ai/capsule-networks capsule_network.py,
apple/ml-capsules-inverted-attention-routing src/layers.py / src/capsule_model.py), saves it as their training
scripts do, converts it, and checks the capsnet model against an independent float64 transcription of that
implementation's forward pass, written here from those facts: the layouts that differ (flat primary capsules,
per-dimension primary convolutions, the coupling softmax over the inputs, transposed poses, the window expansion).
"""

import itertools
import math

import pytest
import torch
import torch.nn.functional as F

from capsnet.errors import CheckpointError
from capsnet.models import load_pretrained
from capsnet.models.converters import CONVERTERS
from capsnet.models.converters.common import load_state_dict

# ------------------------------------------------------------------ the dynamic-routing CapsNets (MNIST)
C1, TYPES, PD, CLASSES, CD, HID = 12, 3, 8, 10, 16, (24, 40)  # small widths; the MNIST geometry (28 → 20 → 6)


def rand(*shape, scale=0.1):
    """float32 tensors, as their checkpoints hold (the transcriptions compute in float64 from the same values)."""
    return torch.randn(*shape) * scale


def as_double(state):
    return {k: v.double() if v.is_floating_point() else v for k, v in state.items()}


def squash_eps_outside(s):
    """Their squash: |s|² / (1 + |s|²) / (|s| + 1e-8) · s (XifengGuo); without the ε (gram-ai) for s ≠ 0."""
    n = s.norm(dim=-1, keepdim=True)
    return n**2 / (1 + n**2) / (n + 1e-8) * s


def decoder(state, x):
    h = F.relu(F.linear(x, state["decoder.0.weight"], state["decoder.0.bias"]))
    h = F.relu(F.linear(h, state["decoder.2.weight"], state["decoder.2.bias"]))
    return torch.sigmoid(F.linear(h, state["decoder.4.weight"], state["decoder.4.bias"]))


def decoder_tensors():
    sizes = [CLASSES * CD, *HID, 784]
    out = {}
    for i, (a, b) in enumerate(itertools.pairwise(sizes)):
        out[f"decoder.{2 * i}.weight"], out[f"decoder.{2 * i}.bias"] = rand(b, a), rand(b)
    return out


def xifengguo_state():
    return {
        "conv1.weight": rand(C1, 1, 9, 9), "conv1.bias": rand(C1),
        "primarycaps.conv2d.weight": rand(TYPES * PD, C1, 9, 9), "primarycaps.conv2d.bias": rand(TYPES * PD),
        "digitcaps.weight": rand(CLASSES, TYPES * 36, CD, PD, scale=0.3),
        **decoder_tensors(),
    }  # fmt: skip


def xifengguo_forward(state, x, routings=3):
    """Their CapsuleNet in eval mode: returns (capsules [B, J, 16], lengths, reconstructions [B, 784])."""
    state = as_double(state)
    h = F.relu(F.conv2d(x, state["conv1.weight"], state["conv1.bias"]))
    p = F.conv2d(h, state["primarycaps.conv2d.weight"], state["primarycaps.conv2d.bias"], stride=2)
    u = squash_eps_outside(p.reshape(x.shape[0], -1, PD))  # `view(B, -1, 8)` of the NCHW map
    w = state["digitcaps.weight"]  # [J, I, 16, 8]
    x_hat = torch.einsum("jiab,nib->njia", w, u)  # W_ji u_i  [B, J, I, 16]
    b = torch.zeros(x.shape[0], w.shape[0], w.shape[1], dtype=x.dtype)
    for r in range(routings):
        c = b.softmax(dim=1)  # over the output capsules
        v = squash_eps_outside((c[..., None] * x_hat).sum(dim=2))  # [B, J, 16]
        if r < routings - 1:
            b = b + (v[:, :, None] * x_hat).sum(-1)
    lengths = v.norm(dim=-1)
    mask = F.one_hot(lengths.argmax(1), w.shape[0]).to(x.dtype)
    return v, lengths, decoder(state, (v * mask[..., None]).flatten(1))


def gram_state():
    state = {"conv1.weight": rand(C1, 1, 9, 9), "conv1.bias": rand(C1)}
    for d in range(PD):
        state[f"primary_capsules.capsules.{d}.weight"] = rand(TYPES, C1, 9, 9)
        state[f"primary_capsules.capsules.{d}.bias"] = rand(TYPES)
    state["digit_capsules.route_weights"] = rand(CLASSES, TYPES * 36, PD, CD, scale=1.0)
    return {**state, **decoder_tensors()}


def gram_forward(state, x, iterations=3):
    """Their CapsuleNet in eval mode: (capsules, |v|, their softmaxed class scores, reconstructions)."""
    state = as_double(state)
    h = F.relu(F.conv2d(x, state["conv1.weight"], state["conv1.bias"]))
    comps = [
        F.conv2d(h, state[f"primary_capsules.capsules.{d}.weight"], state[f"primary_capsules.capsules.{d}.bias"],
                 stride=2).reshape(x.shape[0], -1, 1)
        for d in range(PD)
    ]  # fmt: skip
    u = squash_eps_outside(torch.cat(comps, dim=-1))  # [B, 32·6·6, 8]: capsule (type, row, col), component d
    w = state["digit_capsules.route_weights"]  # [J, I, 8, 16]
    priors = torch.einsum("nia,jiab->jnib", u, w)  # [J, B, I, 16]
    logits = torch.zeros(priors.shape[:3], dtype=x.dtype)
    for i in range(iterations):
        probs = logits.softmax(dim=2)  # over the input capsules i
        v = squash_eps_outside((probs[..., None] * priors).sum(dim=2))  # [J, B, 16]
        if i != iterations - 1:
            logits = logits + (priors * v[:, :, None]).sum(-1)
    v = v.transpose(0, 1)  # [B, J, 16]
    lengths = v.norm(dim=-1)
    classes = lengths.softmax(dim=-1)
    mask = F.one_hot(classes.argmax(1), w.shape[0]).to(x.dtype)
    return v, lengths, classes, decoder(state, (v * mask[..., None]).flatten(1))


def images(n=3, channels=1, side=28, seed=0):
    return torch.rand(n, channels, side, side, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def check_capsnet(model, v, lengths, recon, x):
    out = model(x)
    torch.testing.assert_close(out.capsules, v, atol=1e-7, rtol=1e-5)
    torch.testing.assert_close(out.lengths, lengths, atol=1e-7, rtol=1e-5)
    assert torch.equal(out.predictions, lengths.argmax(1))
    torch.testing.assert_close(out.reconstructions.flatten(1), recon, atol=1e-7, rtol=1e-5)


def test_xifengguo_state_dict_converts_to_a_capsnet_that_computes_their_forward(tmp_path):
    torch.manual_seed(0)
    state = xifengguo_state()
    torch.save(state, tmp_path / "trained_model.pkl")  # their capsulenet.py: torch.save(model.state_dict(), ...)
    model = CONVERTERS["xifengguo-capsnet"].load(tmp_path / "trained_model.pkl").double()
    cfg = model.config
    assert (cfg.primary_grouping, cfg.detach_votes, cfg.n_primary, cfg.decoder_hidden) == ("flat", True, 108, HID)
    x = images()
    check_capsnet(model, *xifengguo_forward(state, x), x)
    # the paper's grouping (one capsule per type and location) would compute something else
    model.primary.grouping = "types"
    assert not torch.allclose(model(x).lengths, xifengguo_forward(state, x)[1], atol=1e-3)


def test_gram_ai_state_dict_converts_to_a_capsnet_that_computes_their_forward(tmp_path):
    torch.manual_seed(1)
    state = gram_state()
    torch.save(state, tmp_path / "epoch_327.pt")
    model = CONVERTERS["gram-ai-capsnet"].load(tmp_path / "epoch_327.pt").double()
    assert model.config.coupling == "inputs"
    x = images(seed=1)
    v, lengths, classes, recon = gram_forward(state, x)
    check_capsnet(model, v, lengths, recon, x)
    torch.testing.assert_close(model(x).lengths.softmax(-1), classes)  # their class scores
    model.class_caps.coupling = "outputs"  # the paper's softmax over the classes computes something else
    assert not torch.allclose(model(x).lengths, lengths, atol=1e-3)


@pytest.mark.parametrize("fmt,make", [("xifengguo-capsnet", xifengguo_state), ("gram-ai-capsnet", gram_state)])
def test_converted_capsnets_save_and_load_as_capsnet_folders(tmp_path, fmt, make):
    torch.save(make(), tmp_path / "w.pt")
    model = CONVERTERS[fmt].load(tmp_path / "w.pt", routing_iterations=2)
    assert model.config.routing_iterations == 2
    model.save_pretrained(tmp_path / "out")
    again = load_pretrained(tmp_path / "out")
    x = images(2).float()
    torch.testing.assert_close(again(x).lengths, model(x).lengths)


# ------------------------------------------------------------------ inverted attention (Tsai et al.)
D, S = 16, 4  # 4×4 matrix poses
MEAN, STD = (0.4914, 0.4822, 0.4465), (0.2023, 0.1994, 0.2010)


def apple_state(*, resnet=False, stem=8, types=(2, 3, 2), n_classes=4, grid=5):
    """Their CapsModel's state dict for their CIFAR config with small widths: backbone, pc_layer, LayerNorm, two
    CONV capsule layers (w [3, 3, n, 4, 4, m]) and the FC class capsules (w [n·grid², 4, 4, classes])."""
    state = {}
    if resnet:
        state["pre_caps.pre_caps.0.weight"] = rand(64, 3, 3, 3, scale=0.2)
        state.update(batchnorm("pre_caps.pre_caps.1", 64))
        c_in = 64
        for stage, (c_out, n) in enumerate(((64, 3), (stem, 4))):
            for k in range(n):
                p = f"pre_caps.pre_caps.{3 + stage}.{k}"
                state[f"{p}.conv1.weight"] = rand(c_out, c_in, 3, 3, scale=0.05)
                state[f"{p}.conv2.weight"] = rand(c_out, c_out, 3, 3, scale=0.05)
                state.update({**batchnorm(f"{p}.bn1", c_out), **batchnorm(f"{p}.bn2", c_out)})
                if stage == 1 and k == 0:
                    state[f"{p}.shortcut.0.weight"] = rand(c_out, c_in, 1, 1, scale=0.1)
                    state.update(batchnorm(f"{p}.shortcut.1", c_out))
                c_in = c_out
    else:
        state["pre_caps.pre_caps.0.weight"] = rand(stem, 3, 3, 3, scale=0.3)
        state["pre_caps.pre_caps.0.bias"] = rand(stem)
    state["pc_layer.weight"] = rand(types[0] * D, stem, 1, 1, scale=0.5)
    state.update(layernorm("nonlinear_act"))
    for i, (a, b) in enumerate(itertools.pairwise(types)):
        state[f"capsule_layers.{i}.w"] = rand(3, 3, a, S, S, b, scale=0.3)
        state.update(layernorm(f"capsule_layers.{i}.nonlinear_act"))
    fc = len(types) - 1
    state[f"capsule_layers.{fc}.w"] = rand(types[-1] * grid * grid, S, S, n_classes, scale=0.3)
    state.update(layernorm(f"capsule_layers.{fc}.nonlinear_act"))
    state["final_fc.weight"], state["final_fc.bias"] = rand(1, D, scale=0.5), rand(1)
    return state


def batchnorm(prefix, c):
    return {f"{prefix}.weight": 1 + rand(c), f"{prefix}.bias": rand(c), f"{prefix}.running_mean": rand(c),
            f"{prefix}.running_var": 1 + rand(c).abs(), f"{prefix}.num_batches_tracked": torch.tensor(100)}  # fmt: skip


def layernorm(prefix):
    return {f"{prefix}.weight": 1 + rand(D), f"{prefix}.bias": rand(D)}


def their_windows(u, stride, released):
    """Their CapsuleCONV.input_expansion of u [B, n, H, W, d] -> [B, n, 3, 3, H', W', d]. Released: the windows
    stacked on the last axis ([.., d, L]) and `view`ed as [.., H', W', d]; otherwise the true windows."""
    b, n, h, w, d = u.shape
    ho, wo = (h - 3) // stride + 1, (w - 3) // stride + 1
    wins = [u[:, :, stride * i : stride * i + 3, stride * j : stride * j + 3, :] for i in range(ho) for j in range(wo)]
    if released:
        return torch.stack(wins, dim=-1).reshape(b, n, 3, 3, ho, wo, d)
    return torch.stack(wins, dim=4).reshape(b, n, 3, 3, ho, wo, d)


def their_conv(state, i, x, stride, parent, released):
    """Their CapsuleCONV forward (matrix poses, votes P·W) on x [B, n, H, W, 16]; parent [B, m, H', W', 16] or None."""
    w = state[f"capsule_layers.{i}.w"]  # [k, l, n, x, d, m]
    p = their_windows(x, stride, released)
    p = p.reshape(*p.shape[:6], S, S)  # [b, n, k, l, h, w, a, x]
    votes = torch.einsum("bnklhwax,klnxdm->bnklmhwad", p, w)
    if parent is None:
        r = torch.full(votes.shape[:7], 1.0 / w.shape[-1], dtype=x.dtype)
    else:
        q = parent.reshape(*parent.shape[:4], S, S)
        a = torch.einsum("bnklmhwad,bmhwad->bnklmhw", votes, q) / math.sqrt(D)
        r = a.softmax(dim=4)
        r = r / (r.sum(dim=4, keepdim=True) + 1e-10)
    s = torch.einsum("bnklmhw,bnklmhwad->bmhwad", r, votes).flatten(-2)
    return F.layer_norm(s, (D,), state[f"capsule_layers.{i}.nonlinear_act.weight"],
                        state[f"capsule_layers.{i}.nonlinear_act.bias"])  # fmt: skip


def their_fc(state, i, x, parent):
    """Their CapsuleFC forward on x [B, n, H, W, 16] (flattened type-major) -> [B, m, 16]."""
    x = x.permute(0, 4, 1, 2, 3).reshape(x.shape[0], D, -1).transpose(1, 2)
    w = state[f"capsule_layers.{i}.w"]  # [n, x, d, m]
    votes = torch.einsum("bnax,nxdm->bnmad", x.reshape(*x.shape[:2], S, S), w)
    if parent is None:
        r = torch.full(votes.shape[:3], 1.0 / w.shape[-1], dtype=x.dtype)
    else:
        a = torch.einsum("bnmad,bmad->bnm", votes, parent.reshape(*parent.shape[:2], S, S)) / math.sqrt(D)
        r = a.softmax(dim=2)
        r = r / (r.sum(dim=2, keepdim=True) + 1e-10)
    s = torch.einsum("bnm,bnmad->bmad", r, votes).flatten(-2)
    return F.layer_norm(s, (D,), state[f"capsule_layers.{i}.nonlinear_act.weight"],
                        state[f"capsule_layers.{i}.nonlinear_act.bias"])  # fmt: skip


def their_resnet(state, x):
    def bn(p, h):
        return F.batch_norm(h, state[f"{p}.running_mean"], state[f"{p}.running_var"], state[f"{p}.weight"],
                            state[f"{p}.bias"], training=False)  # fmt: skip

    h = F.relu(bn("pre_caps.pre_caps.1", F.conv2d(x, state["pre_caps.pre_caps.0.weight"], padding=1)))
    for stage, n in ((3, 3), (4, 4)):
        for k in range(n):
            p, stride = f"pre_caps.pre_caps.{stage}.{k}", 2 if (stage, k) == (4, 0) else 1
            out = F.relu(bn(f"{p}.bn1", F.conv2d(h, state[f"{p}.conv1.weight"], stride=stride, padding=1)))
            out = bn(f"{p}.bn2", F.conv2d(out, state[f"{p}.conv2.weight"], padding=1))
            short = h
            if f"{p}.shortcut.0.weight" in state:
                short = bn(f"{p}.shortcut.1", F.conv2d(h, state[f"{p}.shortcut.0.weight"], stride=stride))
            h = F.relu(out + short)
    return h


def apple_forward(state, x, *, strides=(2, 1), iterations=2, released=True, resnet=False):
    """Their CapsModel (concurrent routing, eval): class poses [B, classes, 16] and logits [B, classes]."""
    state = as_double(state)
    mean, std = (torch.tensor(v).to(x.dtype).view(1, 3, 1, 1) for v in (MEAN, STD))  # as a float32 model holds them
    x = (x - mean) / std
    if resnet:
        c = their_resnet(state, x)
    else:
        c = F.relu(F.conv2d(x, state["pre_caps.pre_caps.0.weight"], state["pre_caps.pre_caps.0.bias"], 2, 1))
    u = F.conv2d(c, state["pc_layer.weight"]).permute(0, 2, 3, 1)
    u = u.reshape(*u.shape[:3], -1, D).permute(0, 3, 1, 2, 4)  # [B, types, H, W, 16]
    u = F.layer_norm(u, (D,), state["nonlinear_act.weight"], state["nonlinear_act.bias"])
    n_conv = len(strides)

    def layer(i, inp, parent):
        if i < n_conv:
            return their_conv(state, i, inp, strides[i], parent, released)
        return their_fc(state, i, inp, parent)

    values = [u]
    for i in range(n_conv + 1):
        values.append(layer(i, values[-1], None))
    for _ in range(iterations - 1):
        values = [u] + [layer(i, values[i], values[i + 1]) for i in range(n_conv + 1)]
    out = values[-1]
    return out, F.linear(out, state["final_fc.weight"], state["final_fc.bias"]).squeeze(-1)


TRANSPOSE = torch.arange(D).view(S, S).t().reshape(-1)  # capsnet's pose = the transpose of theirs


@pytest.mark.parametrize("released", [True, False])
def test_inverted_attention_checkpoint_converts_with_the_pose_transposition(tmp_path, released):
    torch.manual_seed(2)
    state = apple_state()
    net = {f"module.{k}": v for k, v in state.items()}  # DataParallel's prefix
    torch.save({"net": net, "acc": 85.1, "epoch": 349}, tmp_path / "ckpt.pth")  # their main_capsule.py's checkpoint
    windows = "released" if released else "true"
    model = CONVERTERS["inverted-attention"].load(tmp_path / "ckpt.pth", conv_windows=windows).double()
    cfg = model.config
    assert (cfg.scale, cfg.backbone, cfg.input_mean, cfg.conv_windows) == (0.25, "simple", MEAN, windows)
    x = images(3, channels=3, side=32, seed=3)
    poses, logits = apple_forward(state, x, released=released)
    out = model(x)
    torch.testing.assert_close(out.capsules, poses[..., TRANSPOSE], atol=1e-9, rtol=1e-7)
    torch.testing.assert_close(out.lengths, logits.softmax(dim=1), atol=1e-9, rtol=1e-7)
    # the other window layout computes something else: their expansion mixes locations
    other = apple_forward(state, x, released=not released)[1]
    assert not torch.allclose(out.lengths, other.softmax(dim=1), atol=1e-4)


def test_inverted_attention_resnet_checkpoint_converts(tmp_path):
    torch.manual_seed(3)
    state = apple_state(resnet=True, stem=16)
    torch.save(state, tmp_path / "net.pth")
    model = CONVERTERS["inverted-attention"].load(tmp_path / "net.pth").double()
    assert model.config.backbone == "resnet"
    x = images(2, channels=3, side=32, seed=4)
    poses, logits = apple_forward(state, x, resnet=True)
    out = model(x)
    torch.testing.assert_close(out.capsules, poses[..., TRANSPOSE], atol=1e-9, rtol=1e-7)
    torch.testing.assert_close(out.lengths, logits.softmax(dim=1), atol=1e-9, rtol=1e-7)
    model.float().save_pretrained(tmp_path / "out")
    torch.testing.assert_close(load_pretrained(tmp_path / "out")(x.float()).lengths, out.lengths.float())


def test_inverted_attention_options_the_weights_do_not_record(tmp_path):
    torch.save(apple_state(types=(2, 3), grid=7), tmp_path / "one.pth")  # one conv capsule layer: give its stride
    with pytest.raises(CheckpointError, match="give their strides"):
        CONVERTERS["inverted-attention"].load(tmp_path / "one.pth")
    model = CONVERTERS["inverted-attention"].load(tmp_path / "one.pth", capsule_strides=(2,), routing_iterations=3)
    assert (model.config.capsule_strides, model.config.routing_iterations) == ((2,), 3)
    with pytest.raises(CheckpointError, match="input capsules where 28x28 images"):
        CONVERTERS["inverted-attention"].load(tmp_path / "one.pth", capsule_strides=(2,), image_size=28)
    cifar100 = apple_state(types=(2, 3), grid=7)  # their CIFAR-100 configuration: an FC capsule layer of 20 first
    cifar100["capsule_layers.1.w"], cifar100["capsule_layers.2.w"] = rand(2 * 49, S, S, 20), rand(20, S, S, 4)
    cifar100.update(layernorm("capsule_layers.2.nonlinear_act"))
    torch.save(cifar100, tmp_path / "c100.pth")
    with pytest.raises(CheckpointError, match=r"'capsule_layers\.1' is a fully connected capsule layer"):
        CONVERTERS["inverted-attention"].load(tmp_path / "c100.pth", capsule_strides=(2,))


# ------------------------------------------------------------------ the registry and bad files
def test_every_converter_is_registered_with_a_description():
    assert set(CONVERTERS) == {"efficient-capsnet", "xifengguo-capsnet", "gram-ai-capsnet", "inverted-attention",
                               "heinsen-capsnet"}  # fmt: skip
    for conv in CONVERTERS.values():
        assert conv.description and "\n" not in conv.description and callable(conv.load)


class NotATensor:  # module level, so that torch.save can pickle it
    pass


BAD_FILES = {
    "not-torch": (lambda p: p.write_bytes(b"\x00garbage" * 10), "not a PyTorch checkpoint"),
    "object": (lambda p: torch.save({"conv1.weight": NotATensor()}, p), "not a PyTorch checkpoint"),
    "tensor": (lambda p: torch.save(torch.zeros(3), p), "not a state dict"),
    "list": (lambda p: torch.save({"conv1.weight": [1, 2]}, p), "'conv1.weight' is a list, not a tensor"),
}


TORCH_FORMATS = (
    "gram-ai-capsnet",
    "inverted-attention",
    "xifengguo-capsnet",
    "heinsen-capsnet",
)  # (efficient-capsnet: Keras .h5 files)


@pytest.mark.parametrize("fmt", TORCH_FORMATS)
@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_a_file_that_is_not_a_state_dict_is_one_checkpoint_error(tmp_path, fmt, case):
    write, message = BAD_FILES[case]
    write(tmp_path / "w.pt")
    with pytest.raises(CheckpointError, match=message) as e:
        CONVERTERS[fmt].load(tmp_path / "w.pt")
    assert "\n" not in str(e.value)
    with pytest.raises(CheckpointError, match="no such file"):
        CONVERTERS[fmt].load(tmp_path / "absent.pt")


def heinsen_state() -> dict[str, torch.Tensor]:
    """A state dict in glassroom/heinsen_routing's SmallNORBClassifier layout (routings' W, B, CONST_one)."""
    from capsnet.models.heinsen_capsnet import HeinsenCapsNet

    state = {}
    for key, value in HeinsenCapsNet(conv_channels=8, n_parts=4).state_dict().items():
        if key.startswith("routings."):
            key = key.replace(".weight", ".W").replace(".bias", ".B")
        state[key] = value
    return state | {"routings.0.CONST_one": torch.tensor(1.0), "routings.1.CONST_one": torch.tensor(1.0)}


STATES = {"xifengguo-capsnet": xifengguo_state, "gram-ai-capsnet": gram_state, "inverted-attention": apple_state,
          "heinsen-capsnet": heinsen_state}  # fmt: skip
EDITS = {  # (format, key, what to do, the message)
    "xifengguo missing": ("xifengguo-capsnet", "conv1.bias", "drop", "missing tensor 'conv1.bias'"),
    "xifengguo shape": ("xifengguo-capsnet", "primarycaps.conv2d.bias", "shrink", "'primarycaps.conv2d.bias' has"),
    "xifengguo caps": ("xifengguo-capsnet", "digitcaps.weight", "fewer", "'digitcaps.weight' has shape"),
    "xifengguo extra": ("xifengguo-capsnet", "decoder.6.weight", "add", "unexpected tensor 'decoder.6.weight'"),
    "gram missing": ("gram-ai-capsnet", "primary_capsules.capsules.3.bias", "drop", "'primary_capsules.capsules.3."),
    "gram shape": ("gram-ai-capsnet", "decoder.2.bias", "shrink", "'decoder.2.bias' has shape"),
    "gram first": ("gram-ai-capsnet", "primary_capsules.capsules.0.weight", "drop", "capsules.0.weight"),
    "apple missing": ("inverted-attention", "final_fc.bias", "drop", "missing tensor 'final_fc.bias'"),
    "apple shape": ("inverted-attention", "capsule_layers.1.nonlinear_act.bias", "shrink", "nonlinear_act.bias' has"),
    "apple extra": ("inverted-attention", "pre_caps.pre_caps.2.weight", "add", "unexpected tensor"),
    "apple fc": ("inverted-attention", "capsule_layers.2.w", "fewer", "'capsule_layers.2.w' has"),
    "heinsen missing": ("heinsen-capsnet", "routings.1.beta_ign", "drop", "missing tensor 'routings.1.beta_ign'"),
    "heinsen shape": ("heinsen-capsnet", "compute_mu.1.bias", "shrink", "'compute_mu.1.bias' has shape"),
    "heinsen extra": ("heinsen-capsnet", "routings.2.W", "add", "unexpected tensor 'routings.2.W'"),
}


@pytest.mark.parametrize("case", sorted(EDITS))
def test_a_missing_or_wrongly_shaped_tensor_is_one_line_naming_it(tmp_path, case):
    fmt, key, edit, message = EDITS[case]
    state = STATES[fmt]()
    if edit == "drop":
        del state[key]
    elif edit == "shrink":
        state[key] = state[key][:-1]
    elif edit == "fewer":
        state[key] = state[key][:, :-1] if fmt == "xifengguo-capsnet" else state[key][:-1]
    else:
        state[key] = torch.zeros(2)
    torch.save(state, tmp_path / "w.pt")
    with pytest.raises(CheckpointError, match=message) as e:
        CONVERTERS[fmt].load(tmp_path / "w.pt")
    assert "\n" not in str(e.value) and str(tmp_path / "w.pt") in str(e.value)


def test_load_state_dict_reads_nested_and_prefixed_checkpoints_with_weights_only(tmp_path):
    t = {"a.weight": torch.ones(2)}
    torch.save({"state_dict": {"module.a.weight": torch.ones(2)}, "epoch": 3}, tmp_path / "n.pt")
    assert load_state_dict(tmp_path / "n.pt").keys() == t.keys()
    with pytest.raises(CheckpointError, match="weights_only"):  # a pickled callable is refused, never run
        torch.save({"a.weight": torch.ones(2), "hook": print}, tmp_path / "p.pt")
        load_state_dict(tmp_path / "p.pt")
