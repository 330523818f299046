"""The Efficient-CapsNet authors' Keras forward pass, transcribed in float64 NumPy (NHWC, as Keras computes), and
.h5 files written in the layout of their `Model.save_weights` files; capsnet's modules are not used here.

Sources of the facts: EscVM/Efficient-CapsNet, models/efficient_capsnet_graph_{mnist,smallnorb,multimnist}.py and
utils/layers.py (PrimaryCaps, FCCaps, Squash, Length, Mask), as described in the weights folder's README:
- MNIST / MultiMNIST blocks: Conv2D(activation="relu") then BatchNormalization (inference: moving statistics,
  ε = 1e-3); smallNORB: Conv2D, LeakyReLU (slope 0.3), InstanceNormalization (ε = 1e-3). All unpadded.
- PrimaryCaps: depthwise conv (groups = channels), reshape to [16, 8], squash (1 − 1/(e^n + ε)) s / (n + ε), 1e-20.
- FCCaps: u = einsum("...ji,kjiz->...kjz"); c = einsum("...ij,...kj->...i", u, u) / √16; softmax over k; c += b;
  s = Σ_j u c; squash. Length: √(Σ v² + 1e-7).
- Generators: MNIST Dense 512 relu, 1024 relu, H·W·C sigmoid, reshape; smallNORB Dense 64, reshape 8×8×1, three
  times (bilinear ×2 upsampling, 3×3 conv, leaky ReLU 0.2), 3×3 conv 2 with sigmoid. Input: the class capsules
  masked to the longest (test mode), flattened class-major.
"""

from __future__ import annotations

import numpy as np

# (first kernel, first stride) of the four blocks, depthwise kernel and stride, classes, input side and channels
VARIANTS = {
    "mnist": dict(kernels=(5, 3, 3, 3), strides=(1, 1, 1, 2), dw=(9, 1), classes=10, side=28, channels=1),
    "multimnist": dict(kernels=(5, 3, 3, 3), strides=(1, 1, 2, 2), dw=(5, 2), classes=10, side=36, channels=1),
    "smallnorb": dict(kernels=(7, 3, 3, 3), strides=(2, 1, 1, 2), dw=(8, 1), classes=5, side=48, channels=2),
}
WIDTHS = (32, 64, 64, 128)


def conv(x, kernel, bias, stride=1, depthwise=False):
    """Unpadded convolution of NHWC x with a Keras kernel [kh, kw, in (1 if depthwise), out]."""
    b, h, w, _ = x.shape
    kh, kw, _, out = kernel.shape
    ho, wo = (h - kh) // stride + 1, (w - kw) // stride + 1
    y = np.zeros((b, ho, wo, out))
    for i in range(kh):
        for j in range(kw):
            patch = x[:, i : i + stride * (ho - 1) + 1 : stride, j : j + stride * (wo - 1) + 1 : stride, :]
            y += patch * kernel[i, j, 0] if depthwise else patch @ kernel[i, j]
    return y + bias


def squash(s):
    n = np.sqrt((s * s).sum(-1, keepdims=True))
    return (1 - 1 / (np.exp(n) + 1e-20)) * s / (n + 1e-20)


def upsample2(x):
    """Bilinear ×2, half-pixel centres (source coordinate (o + ½)/2 − ½, clamped to the edges)."""
    for axis in (1, 2):
        n = x.shape[axis]
        src = np.clip((np.arange(2 * n) + 0.5) / 2 - 0.5, 0, n - 1)
        lo = np.floor(src).astype(int)
        hi = np.minimum(lo + 1, n - 1)
        t = (src - lo).reshape([-1 if a == axis else 1 for a in range(4)])
        x = np.take(x, lo, axis=axis) * (1 - t) + np.take(x, hi, axis=axis) * t
    return x


def resize_bilinear(x, size: int):
    """tf.image.resize(x, [size, size]) of NCHW float images: bilinear, half-pixel centres, no antialiasing."""
    for axis in (2, 3):
        n = x.shape[axis]
        src = np.clip((np.arange(size) + 0.5) * n / size - 0.5, 0, n - 1)
        lo = np.floor(src).astype(int)
        hi = np.minimum(lo + 1, n - 1)
        t = (src - lo).reshape([-1 if a == axis else 1 for a in range(4)])
        x = np.take(x, lo, axis=axis) * (1 - t) + np.take(x, hi, axis=axis) * t
    return x


def classifier(w: dict[str, np.ndarray], x: np.ndarray, variant: str) -> tuple[np.ndarray, np.ndarray]:
    """Class capsules [B, K, 16] and lengths [B, K] of float64 NHWC inputs x, weights `w` by "layer/param"."""
    v = VARIANTS[variant]
    h = x
    for k, stride in enumerate(v["strides"]):
        h = conv(h, w[f"conv{k}/kernel"], w[f"conv{k}/bias"], stride)
        if variant == "smallnorb":
            h = np.where(h > 0, h, 0.3 * h)
            mean, var = h.mean(axis=(1, 2), keepdims=True), h.var(axis=(1, 2), keepdims=True)
            h = (h - mean) / np.sqrt(var + 1e-3) * w[f"norm{k}/gamma"] + w[f"norm{k}/beta"]
        else:
            h = np.maximum(h, 0)
            h = (h - w[f"norm{k}/moving_mean"]) / np.sqrt(w[f"norm{k}/moving_variance"] + 1e-3)
            h = h * w[f"norm{k}/gamma"] + w[f"norm{k}/beta"]
    h = conv(h, w["dw/kernel"], w["dw/bias"], v["dw"][1], depthwise=True)  # [B, 1, 1, 128]
    u = squash(h.reshape(len(x), 16, 8))
    votes = np.einsum("bji,kjiz->bkjz", u, w["caps/W"])  # [B, K, 16, 16]
    logits = np.einsum("bkjz,bklz->bkj", votes, votes) / 4.0
    c = np.exp(logits - logits.max(axis=1, keepdims=True))
    c = c / c.sum(axis=1, keepdims=True) + w["caps/b"][..., 0]
    caps = squash(np.einsum("bkjz,bkj->bkz", votes, c))
    return caps, np.sqrt((caps**2).sum(-1) + 1e-7)


def generator(w: dict[str, np.ndarray], caps: np.ndarray, variant: str) -> np.ndarray:
    """The reconstruction (NHWC) from the class capsules masked to the longest one."""
    v = VARIANTS[variant]
    mask = np.eye(caps.shape[1])[np.sqrt((caps**2).sum(-1)).argmax(1)]
    z = (caps * mask[..., None]).reshape(len(caps), -1)
    if variant != "smallnorb":
        z = np.maximum(z @ w["gen0/kernel"] + w["gen0/bias"], 0)
        z = np.maximum(z @ w["gen1/kernel"] + w["gen1/bias"], 0)
        z = 1 / (1 + np.exp(-(z @ w["gen2/kernel"] + w["gen2/bias"])))
        return z.reshape(len(caps), v["side"], v["side"], v["channels"])
    h = (z @ w["gen0/kernel"] + w["gen0/bias"]).reshape(len(caps), 8, 8, 1)
    for k in (1, 2, 3):
        h = conv(upsample2(h), w[f"gen{k}/kernel"], w[f"gen{k}/bias"])
        h = np.where(h > 0, h, 0.2 * h)
    return 1 / (1 + np.exp(-conv(h, w["gen4/kernel"], w["gen4/bias"])))


def random_weights(variant: str, seed: int = 0) -> dict[str, np.ndarray]:
    """Weights of the authors' `variant` model in Keras layouts, of He-like scale (keys as `classifier` reads)."""
    rng = np.random.default_rng(seed)
    v = VARIANTS[variant]
    w: dict[str, np.ndarray] = {}
    c_in = v["channels"]
    for k, (kernel, width) in enumerate(zip(v["kernels"], WIDTHS)):
        w[f"conv{k}/kernel"] = rng.normal(0, np.sqrt(2 / (kernel * kernel * c_in)), (kernel, kernel, c_in, width))
        w[f"conv{k}/bias"] = rng.normal(0, 0.05, width)
        w[f"norm{k}/gamma"] = rng.uniform(0.5, 1.5, width)
        w[f"norm{k}/beta"] = rng.normal(0, 0.1, width)
        if variant != "smallnorb":
            w[f"norm{k}/moving_mean"] = rng.uniform(0, 1, width)
            w[f"norm{k}/moving_variance"] = rng.uniform(0.5, 2, width)
        c_in = width
    d = v["dw"][0]
    w["dw/kernel"] = rng.normal(0, 1 / d, (d, d, 1, 128))
    w["dw/bias"] = rng.normal(0, 0.1, 128)
    w["caps/W"] = rng.normal(0, 0.3, (v["classes"], 16, 8, 16))
    w["caps/b"] = rng.normal(0, 0.05, (v["classes"], 16, 1))
    n = 16 * v["classes"]
    if variant == "smallnorb":
        sizes = [(3, 3, 1, 64), (3, 3, 64, 128), (3, 3, 128, 128), (3, 3, 128, 2)]
        w["gen0/kernel"], w["gen0/bias"] = rng.normal(0, 0.3, (n, 64)), rng.normal(0, 0.1, 64)
        for k, shape in enumerate(sizes, start=1):
            w[f"gen{k}/kernel"] = rng.normal(0, np.sqrt(2 / np.prod(shape[:3])), shape)
            w[f"gen{k}/bias"] = rng.normal(0, 0.05, shape[-1])
    else:
        for k, (a, b) in enumerate([(n, 512), (512, 1024), (1024, v["side"] ** 2)]):
            w[f"gen{k}/kernel"], w[f"gen{k}/bias"] = rng.normal(0, np.sqrt(2 / a), (a, b)), rng.normal(0, 0.05, b)
    return {k: a.astype(np.float32).astype(np.float64) for k, a in w.items()}  # float32 values, as the files hold


def keras_names(variant: str) -> tuple[dict[str, str], dict[str, str]]:
    """Our keys -> the tensor names of the authors' files, for the classifier and the Generator groups; the
    classifier's layers are numbered as in their smallNORB file (conv2d_4 ... conv2d_8, digit_caps)."""
    norm = "instance_normalization" if variant == "smallnorb" else "batch_normalization"
    names: dict[str, str] = {}
    for k in range(4):
        names[f"conv{k}"] = f"conv2d_{4 + k}"
        names[f"norm{k}"] = norm + (f"_{k}" if k else "")
    names["dw"], names["caps"] = "conv2d_8", "digit_caps"
    gen = {f"gen{k}": "dense" + (f"_{k}" if k else "") for k in range(3)}
    if variant == "smallnorb":
        gen = {"gen0": "dense", **{f"gen{k}": "conv2d" + (f"_{k - 1}" if k > 1 else "") for k in range(1, 5)}}
    return names, gen


def write_h5(path, w: dict[str, np.ndarray], variant: str, *, drop: str = "", reshape: tuple[str, tuple] = ("", ()),
             whole_model: bool = False):  # fmt: skip
    """An .h5 file in the layout of the authors' training-model weights (root `layer_names`, groups `CapsNet` and
    `Generator` with `weight_names`, trainable tensors first and the BatchNorm moving statistics last, as Keras's
    save_weights orders them). `drop`: a tensor (as "CapsNet/digit_caps/b:0") to leave out; `reshape`: one to
    store with another shape; `whole_model`: under `model_weights/`, as Keras's `Model.save` writes them."""
    import h5py

    caps_names, gen_names = keras_names(variant)
    groups: dict[str, list[tuple[str, np.ndarray]]] = {"CapsNet": [], "Generator": []}
    moving = []
    for key, value in w.items():
        layer, param = key.split("/")
        group, names = ("Generator", gen_names) if layer.startswith("gen") else ("CapsNet", caps_names)
        entry = (f"{names[layer]}/{param}:0", value.astype(np.float32))
        (moving if param.startswith("moving") else groups[group]).append(entry)
    groups["CapsNet"] += moving
    with h5py.File(path, "w") as root:
        f = root.create_group("model_weights") if whole_model else root
        f.attrs["backend"], f.attrs["keras_version"] = "tensorflow", "2.4.0"
        f.attrs["layer_names"] = np.array([b"input_2", b"CapsNet", b"input_3", b"mask", b"Generator"])
        for empty in ("input_2", "input_3", "mask"):
            f.create_group(empty).attrs["weight_names"] = np.array([], dtype=np.float64)
        for group, entries in groups.items():
            g = f.create_group(group)
            kept = [(n, a) for n, a in entries if f"{group}/{n}" != drop]
            for name, value in kept:
                shape = reshape[1] if f"{group}/{name}" == reshape[0] else value.shape
                g.create_dataset(name, data=np.resize(value, shape))
            g.attrs["weight_names"] = np.array([n.encode() for n, _ in kept])
    return path
