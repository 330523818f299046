"""`capsnet explore`'s callbacks without a browser, for every registered model (small configs): the lengths are
model(x)'s, the reconstruction is the decoder's on the tweaked capsule, the routing map is the router's
coefficients (return_coupling=True) at each iteration; bad input is one message on the page or one line + exit 2."""

import socket

import pytest
import torch
from helpers import small_model_config

from capsnet import Router, list_models
from capsnet.cli import main
from capsnet.inference import predict
from capsnet.models.registry import MODELS
from capsnet.viz import explore_model as em
from capsnet.viz.explore import Explorer, check_port_free
from capsnet.viz.routing import routing_maps

pytest.importorskip("PIL")


def small(name: str):
    torch.manual_seed(0)
    return MODELS[name](config=small_model_config(name)).eval()


def png(tmp_path, name="x.png", size=(40, 40), seed=0):
    from PIL import Image

    g = torch.Generator().manual_seed(seed)
    arr = (torch.rand(*size, generator=g) * 255).to(torch.uint8).numpy()
    path = tmp_path / name
    Image.fromarray(arr).save(path)
    return path


@pytest.mark.parametrize("name", list_models())
def test_lengths_are_the_models(name, tmp_path):
    model = small(name)
    ex = Explorer(model)
    path = png(tmp_path)
    r = ex.classify(str(path))
    assert r["message"] == ""
    x = em.model_input(model, path)
    with torch.no_grad():
        out = model(x)
    assert r["lengths"]["length"] == [round(float(v), 4) for v in out.lengths[0]]
    assert r["state"].prediction == int(out.predictions[0])
    # the input is predict's: the same lengths as `capsnet predict` gives this file
    assert predict(model, [path]).rows()[0]["lengths"] == [round(float(v), 6) for v in r["state"].lengths]
    assert ex.names[r["state"].prediction] in r["prediction"]


@pytest.mark.parametrize("name", list_models())
def test_panels_that_apply(name):
    model = small(name)
    f = em.features(model)
    assert f.decoder == (getattr(model, "decoder", None) is not None) == (name in DECODER)
    assert bool(f.routing) == (name in ROUTED)
    assert bool(f.hidden) == (not f.decoder or not f.routing or f.routing == "list" or f.iterations == 1)
    if name == "capsnet":
        assert (f.pose_dim, f.routing, f.iterations) == (model.config.class_dim, "grid", 3)
    if name == "em-capsnet":
        assert f.matrix_pose and f.pose_dim == 16 and not f.decoder
    if name == "hvc-capsnet":
        assert f.branches == len(model.config.branches_after) and not f.routing


DECODER = [
    "capsnet",
    "efficient-capsnet",
    "deepcaps",
]  # the registered models with a decoder (test_panels_that_apply checks)
ROUTED = ["capsnet", "efficient-capsnet", "em-capsnet", "inverted-attention-capsnet", "self-routing-capsnet",
          "deepcaps", "heinsen-capsnet", "cluster-capsnet", "vb-capsnet"]  # fmt: skip


@pytest.mark.parametrize("name", DECODER)
def test_reconstruction_is_the_decoders_on_the_tweaked_capsule(name, tmp_path):
    model = small(name)
    ex = Explorer(model)
    a = ex.classify(str(png(tmp_path)))["state"]
    d = ex.features.pose_dim
    offsets = [0.25 if k == 1 else (-0.1 if k == 0 else 0.0) for k in range(d)]
    j = (a.prediction + 1) % model.config.n_classes
    v = a.capsules.clone()
    v[0, j, 0] -= 0.1
    v[0, j, 1] += 0.25
    with torch.no_grad():
        want = model.decoder(v, torch.tensor([j]))[0]
    assert torch.equal(em.reconstruct(model, a, j, offsets), want)
    moved, rest = ex.reconstruction(a, j, offsets), ex.reconstruction(a, j, [0.0] * d)
    assert moved.shape == rest.shape and (moved != rest).any()  # a slider move changes the picture


@pytest.mark.parametrize("name", ROUTED)
def test_routing_map_is_the_final_coupling(name, tmp_path):
    model = small(name)
    ex = Explorer(model)
    a = ex.classify(str(png(tmp_path)))["state"]
    with torch.no_grad():
        c = model(a.x, return_coupling=True).coupling[0]
    j = a.prediction
    got = em.routing_map(model, em.coupling_at(model, a, ex.features.iterations), j)
    grid = em.routing_grid(model, c.shape[0])
    want = c[:, j][None] if grid is None else routing_maps(c, grid[0], grid[1])[j]
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("iteration", [1, 2, 3])
def test_routing_iterations_are_the_routers(iteration, tmp_path):
    """CapsNet's iteration slider: the coefficients a Router with that many iterations gives (return_coupling)."""
    model = small("capsnet")
    a = Explorer(model).classify(str(png(tmp_path)))["state"]
    (u,), _ = a.routing_call
    cfg = model.config
    router = Router(cfg.n_primary, cfg.n_classes, cfg.primary_dim, cfg.class_dim, iteration)
    router.load_state_dict(model.class_caps.state_dict())
    with torch.no_grad():
        c = router(u, return_coupling=True).coupling[0]
    for j in (0, a.prediction):
        want = routing_maps(c, cfg.primary_types, cfg.primary_grid)[j]
        torch.testing.assert_close(em.routing_map(model, em.coupling_at(model, a, iteration), j), want)
    if iteration < 3:  # the iterations differ: the slider shows something
        assert not torch.equal(em.coupling_at(model, a, iteration), a.coupling)


def test_drawing_and_gallery_go_through_predicts_conversion(tmp_path):
    model = small("capsnet")
    images = (torch.rand(3, 1, 28, 28) * 255).to(torch.uint8)
    ex = Explorer(model, images=images)
    r = ex.gallery_pick(2)
    assert r["state"].lengths.tolist() == pytest.approx(
        predict(model, [ex.gallery_paths[2]]).rows()[0]["lengths"], abs=1e-6
    )
    canvas = torch.zeros(280, 280, 4, dtype=torch.uint8)
    canvas[100:200, 130:150, 3] = 255  # a black stroke on a transparent canvas
    r = ex.drawing({"composite": canvas.numpy()})
    assert r["message"] == "" and len(r["lengths"]["length"]) == 10
    assert ex.drawing(None)["message"] and ex.gallery_pick(7)["message"]
    ex.close()


def test_bad_images_are_one_message(tmp_path):
    from PIL import Image

    ex = Explorer(small("capsnet"))
    text = tmp_path / "notes.png"
    text.write_text("not an image")
    assert "not a PNG, JPEG or other readable image" in ex.classify(str(text))["message"]
    bomb = tmp_path / "bomb.png"
    Image.new("1", (9000, 9000)).save(bomb)  # a few kB on disk, 81 million pixels decoded
    assert bomb.stat().st_size < em.MAX_UPLOAD_BYTES
    r = ex.classify(str(bomb))
    assert set(r) == {"message"} and "MAX_IMAGE_PIXELS" in r["message"]
    big = tmp_path / "big.png"
    big.write_bytes(b"\0" * (em.MAX_UPLOAD_BYTES + 1))
    assert "larger than" in ex.classify(str(big))["message"]


@pytest.mark.slow
def test_cli_bad_input_is_one_line(tmp_path, capsys):
    assert main(["explore", "--checkpoint", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("capsnet explore: error:") and err.count("\n") == 1
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(Exception, match="in use"):
            check_port_free("127.0.0.1", port)
        assert main(["explore", "--checkpoint", str(tmp_path), "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert "is the port in use?" in err and err.count("\n") == 1


def test_missing_gradio_is_one_line(monkeypatch, capsys):
    import builtins

    real = builtins.__import__

    def no_gradio(name, *args, **kwargs):
        if name == "gradio":
            raise ImportError("No module named 'gradio'")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_gradio)
    assert main(["explore", "--pretrained", "efficient-capsnet:mnist-sample"]) == 2
    err = capsys.readouterr().err
    assert err == "capsnet explore: error: capsnet explore needs Gradio: pip install 'capsnet[app]'\n"
