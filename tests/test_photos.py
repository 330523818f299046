"""A photo of a digit reads as MNIST reads it (issue 38): LeCun et al.'s procedure (:mod:`capsnet.data.mnist_form`)
puts a picture of a digit in MNIST's form whatever its paper, light, polarity, position and size; `capsnet predict`
and the explorer apply it; photos made in the tests (:mod:`photos`) score as their clean digits do with the shipped
weights; docs/inputs.md's lines for a deployment of the exported graph give the same pixels."""

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from photos import photo, write_photos

from capsnet import create_model
from capsnet.cli import main
from capsnet.data.datasets import load_dataset
from capsnet.data.folder import _decode
from capsnet.data.mnist_form import mnist_form
from capsnet.inference import prepare_image
from capsnet.models.recipe import model_input
from capsnet.viz.explore import Explorer

Image = pytest.importorskip("PIL.Image")
DOCS = Path(__file__).resolve().parents[1] / "docs" / "inputs.md"
SHIPPED = "efficient-capsnet:mnist-sample"


@pytest.fixture(scope="module")
def held_out():
    """The sample's test digits [N, 28, 28] uint8 (white on black) and their labels [N]."""
    split = load_dataset("mnist-sample").test
    return split.images[:, 0].numpy(), split.labels.numpy()


def centre_of_mass(x: np.ndarray) -> tuple[float, float]:
    ys, xs = np.indices(x.shape)
    return float((ys * x).sum() / x.sum()), float((xs * x).sum() / x.sum())


def ink_box(x: np.ndarray) -> tuple[int, int]:
    """Height and width of the bounding box of the pixels > 0."""
    return int(x.any(1).sum()), int(x.any(0).sum())


def paper_photo(digit: np.ndarray, *, frame=(240, 300), at=(20, 30), scale=5, light=None, ink_on_paper=True):
    """`digit` scaled by `scale` (bilinear) at `at` in a frame, as dark ink on light paper (or its negative: light
    ink on dark), multiplied by `light` [H, W] if given: uint8 [H, W]."""
    d = np.asarray(Image.fromarray(digit).resize((28 * scale, 28 * scale), Image.Resampling.BILINEAR), np.float64)
    alpha = np.zeros(frame)
    alpha[at[0] : at[0] + 28 * scale, at[1] : at[1] + 28 * scale] = d / 255
    x = 230 - 200 * alpha if ink_on_paper else 25 + 200 * alpha
    return np.round(x * (1 if light is None else light)).astype(np.uint8)


def test_a_clean_digit_keeps_mnist_form(held_out):
    digits, _ = held_out
    diffs = []
    for d in digits[:100]:
        x = mnist_form(d)
        assert x.shape == (28, 28) and x.dtype == np.float32 and x.min() >= 0 and x.max() <= 1
        assert max(ink_box(x)) in (20, 21)  # fitted in the 20×20 box (Lanczos may leave a faint pixel beside it)
        cy, cx = centre_of_mass(x)
        assert abs(cy - 14) <= 0.55 and abs(cx - 14) <= 0.55  # centred by its centre of mass, as MNIST's are
        diffs.append(np.abs(x - d / 255).mean())
    assert np.mean(diffs) < 0.05  # MNIST's digits are already in this form: mean change under 5% of the range


def test_a_clean_28x28_file_is_taken_as_it_is(held_out, tmp_path):
    model = create_model("efficient-capsnet", pretrained="mnist-sample")
    Image.fromarray(held_out[0][0]).save(tmp_path / "d.png")
    x, how = prepare_image(tmp_path / "d.png", model.config)
    assert how.startswith("digit-style, taken as it is")
    assert torch.equal(x, torch.from_numpy(held_out[0][0]).float()[None] / 255)


def test_polarity_position_uneven_light_and_dust_do_not_change_the_form(held_out):
    digit = held_out[0][0]
    base = mnist_form(paper_photo(digit))
    assert np.array_equal(base, mnist_form(paper_photo(digit, at=(90, 140))))  # elsewhere in the frame
    assert np.array_equal(base, mnist_form(paper_photo(digit, ink_on_paper=False)))  # the negative
    y, x = np.mgrid[0:1:240j, 0:1:300j]
    shadow = np.where(x + 0.5 * y > 0.9, 0.6, 1.0)  # a shadow's edge across the digit
    for light in (1 - 0.5 * x, 1 - 0.4 * ((x - 0.3) ** 2 + (y - 0.6) ** 2), shadow):  # a gradient; a vignette
        lit = mnist_form(paper_photo(digit, light=light))
        assert np.abs(lit - base).mean() < 0.02 and abs(int(lit.any(1).sum()) - int(base.any(1).sum())) <= 1
    dusty = paper_photo(digit)
    dusty[5:8, 5:8] = dusty[200:202, 280:283] = 40  # specks of dust far from the digit
    assert np.array_equal(base, mnist_form(dusty))
    assert np.abs(base - digit / 255).mean() < 0.06  # and it is the digit


def test_blank_paper_under_uneven_light_is_no_ink():
    rng = np.random.default_rng(0)
    nothing = np.zeros((28, 28), np.uint8)
    nothing[0, 0] = 1  # (one pixel of ink at 1/255: a photo of nothing)
    for _ in range(6):
        assert not mnist_form(photo(nothing, rng)).any()
    for level in (0, 200, 255):  # uniform images, black included
        assert not mnist_form(np.full((50, 40, 3), level, np.uint8)).any()
    with pytest.raises(ValueError, match="H×W or H×W×3"):
        mnist_form(np.zeros((2, 3, 4, 5)))


def test_a_dark_seven_on_off_white_paper_reads_seven(held_out, tmp_path, capsys):
    digits, labels = held_out
    seven = digits[np.flatnonzero(labels == 7)[0]]
    ink = np.asarray(Image.fromarray(seven).resize((140, 140), Image.Resampling.BILINEAR), np.float64)[..., None] / 255
    frame = np.tile(np.array([235.0, 232.0, 225.0]), (240, 200, 1))  # the paper, RGB (235, 232, 225)
    frame[70:210, 20:160] = frame[70:210, 20:160] * (1 - ink) + 30 * ink
    Image.fromarray(frame.astype(np.uint8)).save(tmp_path / "seven.jpg", quality=85)
    assert main(["predict", "--pretrained", SHIPPED, str(tmp_path / "seven.jpg"), "--json"]) == 0
    row = json.loads(capsys.readouterr().out)
    assert row["class"] == 7 and "MNIST's procedure" in row["conversion"]


@pytest.mark.slow
def test_photos_score_as_their_clean_digits_through_predict_and_the_explorer(held_out, tmp_path, capsys):
    digits, labels = held_out[0][:200], held_out[1][:200]
    model = create_model("efficient-capsnet", pretrained="mnist-sample").eval()
    with torch.no_grad():
        clean = (model(model_input(model, torch.from_numpy(digits)[:, None])).predictions.numpy() == labels).mean()
    paths = write_photos(tmp_path / "photos", digits, seed=0)
    assert main(["predict", "--pretrained", SHIPPED, *map(str, paths), "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    predicted = (np.array([r["class"] for r in rows]) == labels).mean()
    explorer = Explorer(model)
    explored = np.mean([explorer.classify(str(p))["state"].prediction == y for p, y in zip(paths, labels)])
    print(f"clean {clean:.1%}, photos through predict {predicted:.1%}, through the explorer {explored:.1%}")
    assert predicted >= clean - 0.03 and explored >= clean - 0.03


def docs_conversion():
    """The function docs/inputs.md gives for a deployment of the exported graph (its ```python block)."""
    text = DOCS.read_text(encoding="utf-8")
    code = re.search(r"## A photo of a digit.*?```python\n(.*?)```", text, flags=re.S).group(1)
    scope: dict = {}
    exec(compile(code, str(DOCS), "exec"), scope)
    return scope["mnist_pixels"]


def test_the_docs_lines_give_the_librarys_pixels(held_out, tmp_path):
    convert = docs_conversion()
    rng = np.random.default_rng(1)
    images = [photo(d, rng) for d in held_out[0][:12]] + [photo(held_out[0][0], rng, side=600), held_out[0][1]]
    for i, image in enumerate(images):
        path = tmp_path / f"p{i}.jpg"
        Image.fromarray(image).save(path, quality=80)
        with Image.open(path) as img:
            ours = np.round(mnist_form(img) * 255).astype(np.uint8)
            theirs = convert(img)
        assert theirs.dtype == np.uint8 and theirs.shape == (28, 28)
        assert np.array_equal(theirs, ours)


def test_the_exported_graphs_note_sends_a_digit_models_photos_to_the_docs():
    from capsnet.models.export import input_note

    digits = create_model("efficient-capsnet", pretrained="mnist-sample")
    assert "MNIST's form" in input_note(digits) and "docs/inputs.md" in input_note(digits)
    assert "MNIST's form" not in input_note(create_model("efficient-capsnet", digits=False))


@pytest.mark.parametrize("ink", [0, 255], ids=["dark-ink", "light-ink"])
def test_a_digit_drawn_on_a_transparent_canvas_reads_as_on_paper(held_out, tmp_path, ink):
    """A PNG whose strokes are all one colour and whose shape is in the alpha channel (a drawing program's export)
    reads as the same strokes on paper: dropping the alpha would leave a blank image."""
    model = create_model("efficient-capsnet", pretrained="mnist-sample")
    digits, _ = held_out
    canvas = np.zeros((28, 28, 4), np.uint8)
    canvas[..., :3], canvas[..., 3] = ink, digits[0]  # the colour everywhere, the digit in alpha
    Image.fromarray(canvas, "RGBA").save(tmp_path / "drawn.png")
    x, how = prepare_image(tmp_path / "drawn.png", model.config)
    paper = 255 - digits[0] if ink == 0 else digits[0]  # the strokes on contrasting paper, as an opaque file holds them
    want, _ = prepare_image(_save(tmp_path / "opaque.png", paper), model.config)
    assert torch.equal(x, want), how
    read = _decode(tmp_path / "drawn.png", (28, 28), 1)[0]  # the image-folder reader's decoding of one file
    assert np.abs(read.astype(int) - paper.astype(int)).max() <= 1  # the image folder reader: the same paper


def _save(path, digit):
    Image.fromarray(digit).save(path)
    return path
