"""`capsnet explore`: a local web page (Gradio, the optional extra `capsnet[app]`) to look inside a model's capsules.

    import capsnet
    capsnet.explore(capsnet.load_pretrained("runs/mnist/best")).launch()

The page's callbacks are the methods of `Explorer` (tested without a browser); what they compute is
`capsnet.viz.explore_model`. Safe by default: it binds to 127.0.0.1, makes no public share link, caps uploads
and serves only the images it shows.
"""

from __future__ import annotations

import os
import socket
import tempfile
from pathlib import Path
from typing import Any

import torch

from ..data.images import flatten_alpha
from ..errors import CapsNetError, ConfigError
from . import explore_model as em

GALLERY_SIZE = 12
PAGE_NOTE = "Capsule lengths |v_j| are the model's probabilities that each class is present."


def _gradio():
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")  # no calls home
    try:
        import gradio
    except ImportError:
        raise CapsNetError("capsnet explore needs Gradio: pip install 'capsnet[app]'") from None
    return gradio


class Explorer:
    """The page for one model. `images` [N, C, H, W] (uint8 or floats in [0, 1]): the gallery, e.g. a few of the
    run's test images; each is written as a PNG and read back through `capsnet predict`'s conversion. `note`: a
    line shown at the top (`capsnet explore` gives the training run's stuck line there, when it is stuck)."""

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        images: torch.Tensor | None = None,
        title: str | None = None,
        note: str | None = None,
    ):
        self.model = model.eval()
        self.note = note  # a line about the run shown above everything (e.g. capsnet.training.stuck's)
        self.names = em.class_names(model)
        self.features = em.features(model)
        self.title = title or type(model).__name__
        self._folder = tempfile.TemporaryDirectory(prefix="capsnet-explore-")
        self.gallery_paths = _write_gallery(images, Path(self._folder.name)) if images is not None else []
        self.blocks: Any = None

    # ------------------------------------------------------------------------------------------ callbacks

    def classify(self, path: str | None) -> dict[str, Any]:
        """An image file: the analysis (the page's state), the prediction line, the lengths and every panel for the
        predicted capsule, poses at rest. A bad file: only `message`, naming what is wrong."""
        if not path:
            return {"message": "Upload, draw or pick an image."}
        try:
            a = em.analyse(self.model, em.model_input(self.model, path))
        except CapsNetError as e:
            return {"message": f"**Cannot read this image:** {e}"}
        j = a.prediction
        out: dict[str, Any] = {"state": a, "message": "", "prediction": self.prediction_line(a)}
        out["lengths"] = self.lengths_table(a)
        out.update(self.capsule_panels(a, j, [0.0] * self.features.pose_dim, self.features.iterations))
        return out

    def prediction_line(self, a: em.Analysis) -> str:
        j = a.prediction
        what = "activation" if self.features.matrix_pose else "length"
        return f"Prediction: **{self.names[j]}** (class {j}, {what} {float(a.lengths[j]):.3f})"

    def lengths_table(self, a: em.Analysis) -> dict[str, list]:
        """Class names and their capsule lengths (EM: activations a_j; a CNN: softmax probabilities)."""
        return {"class": list(self.names), "length": [round(float(v), 4) for v in a.lengths]}

    def capsule_panels(self, a: em.Analysis, j: int, offsets: list[float], iteration: int) -> dict[str, Any]:
        """Reconstruction, pose table, branch lengths and routing map for class capsule j."""
        out: dict[str, Any] = {}
        if self.features.decoder:
            out["reconstruction"] = self.reconstruction(a, j, offsets)
        if self.features.pose_dim and not self.features.decoder:
            out["poses"] = self.pose_table(a, j)
        if self.features.branches:
            out["branches"] = self.branch_table(a)
        if self.features.routing:
            out["routing"] = self.routing(a, j, iteration)
        return out

    def reconstruction(self, a: em.Analysis, j: int, offsets: list[float]):
        """The decoder's image from capsule j, each dimension moved by its slider (a slider move calls this)."""
        return em.image_rgb(em.reconstruct(self.model, a, j, offsets)).numpy()

    def routing(self, a: em.Analysis, j: int, iteration: int):
        """The heat map of c_ij into class j after `iteration` routing iterations."""
        return em.heatmap_rgb(em.routing_map(self.model, em.coupling_at(self.model, a, iteration), j)).numpy()

    def pose_table(self, a: em.Analysis, j: int) -> list[list[float]]:
        """Class capsule j's pose: a 4×4 matrix (EM), else one row of its dimensions."""
        assert a.capsules is not None
        pose = a.capsules[0, j].float().cpu()
        side = em.pose_side(pose.numel()) if self.features.matrix_pose else 0
        rows = pose.view(side, side) if side else pose[None]
        return [[round(float(x), 4) for x in row] for row in rows]

    def branch_table(self, a: em.Analysis) -> list[list]:
        """HVC: each class's capsule length in every branch, one row per class."""
        assert a.branch_lengths is not None
        return [[name, *(round(float(x), 4) for x in row)] for name, row in zip(self.names, a.branch_lengths)]

    def chosen(self, a: em.Analysis | None, choice: str | None) -> int:
        """The class a capsule choice names ("predicted", or a class name)."""
        if a is None:
            return 0
        return self.names.index(choice) if choice in self.names else a.prediction

    def drawing(self, value: dict | None) -> dict[str, Any]:
        """The sketchpad's drawing (RGBA strokes on a transparent canvas), laid on paper (`flatten_alpha`) and
        classified as the PNG file it is written to."""
        composite = None if value is None else value.get("composite")
        if composite is None:
            return {"message": "Draw a digit first."}
        from PIL import Image

        img = flatten_alpha(Image.fromarray(composite))  # (dark strokes: onto white)
        fd, name = tempfile.mkstemp(suffix=".png", dir=self._folder.name)
        try:
            with os.fdopen(fd, "wb") as f:
                img.save(f, format="PNG")
            return self.classify(name)
        finally:
            os.unlink(name)

    def gallery_pick(self, index: int) -> dict[str, Any]:
        if not 0 <= index < len(self.gallery_paths):
            return {"message": "No such gallery image."}
        return self.classify(str(self.gallery_paths[index]))

    # ------------------------------------------------------------------------------------------ the page

    def build(self):
        """The Gradio page (built once, on first use)."""
        if self.blocks is None:
            from .explore_page import build_page

            self.blocks = build_page(self, _gradio())
        return self.blocks

    def launch(self, *, host: str = "127.0.0.1", port: int | None = None, block: bool = True, quiet: bool = False):
        """Serve the page on http://host:port (a free port when None): no share link, uploads capped at
        MAX_UPLOAD_BYTES. ConfigError when the port is taken. Returns the URL; with `block`, serves until Ctrl-C."""
        if port is not None:
            check_port_free(host, port)
        blocks = self.build()
        _, url, _ = blocks.launch(
            server_name=host,
            server_port=port,
            share=False,
            max_file_size=em.MAX_UPLOAD_BYTES,
            prevent_thread_lock=True,
            quiet=quiet,
            footer_links=[],
            inbrowser=False,
            ssr_mode=False,
        )
        if block:
            try:
                blocks.block_thread()
            finally:
                self.close()
        return url

    def close(self) -> None:
        if self.blocks is not None:
            self.blocks.close()
        self._folder.cleanup()


def explore(model: torch.nn.Module, *, images: torch.Tensor | None = None) -> Explorer:
    """The explore page for `model` (see `Explorer`); `.launch()` serves it on 127.0.0.1."""
    return Explorer(model, images=images)


def check_port_free(host: str, port: int) -> None:
    """ConfigError unless a server could listen on host:port."""
    if not 0 < port < 65536:
        raise ConfigError(f"--port {port}: not a port number (1 to 65535)")
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError as e:
            raise ConfigError(f"cannot listen on {host}:{port} ({e.strerror or e}); is the port in use?") from None


def _write_gallery(images: torch.Tensor, folder: Path) -> list[Path]:
    """Images [N, C, H, W] as PNG files in `folder` (channels 1 or 3; others: the first channel)."""
    from PIL import Image

    paths = []
    for k, img in enumerate(images):
        x = img if img.dtype == torch.uint8 else (img.float().clamp(0, 1) * 255).round().to(torch.uint8)
        x = x if x.shape[0] in (1, 3) else x[:1]
        arr = x[0].numpy() if x.shape[0] == 1 else x.permute(1, 2, 0).contiguous().numpy()
        path = folder / f"gallery-{k:02d}.png"
        Image.fromarray(arr).save(path, format="PNG")
        paths.append(path)
    return paths


def test_images(model: torch.nn.Module, checkpoint: str | os.PathLike, n: int = GALLERY_SIZE) -> torch.Tensor | None:
    """Up to `n` of the checkpoint's own test images, one per class first (None when it records no data)."""
    from ..training.checkpoint_data import checkpoint_data
    from .common import distinct_classes

    try:
        test = checkpoint_data(model, [checkpoint]).test
    except CapsNetError:
        return None
    if len(test) == 0:
        return None
    labels = test.labels[:1000]
    picks = distinct_classes(labels, n) if labels.dim() == 1 else torch.arange(min(n, len(labels)))
    return test.images[picks]
