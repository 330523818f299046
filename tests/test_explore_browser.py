"""`capsnet explore` in a real browser (Chromium driven by Playwright): upload a PNG and find the class that
`capsnet predict` gives it on the page, move a pose slider and see the reconstruction change, pick a test image.
Saves the page's screenshot in the test's folder, and as docs/figures/explore.png (the README's) when
$CAPSNET_SCREENSHOT is set, so that a test run leaves the checkout as it was. Skips, saying how to get one,
without a browser."""

import io
import os
import shutil
import socket
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.tooling]  # (make check leaves it out)

CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]  # fmt: skip
INSTALL = ("no browser for the explore test: apt-get install chromium (Debian) and pip install playwright, or "
           "playwright install chromium")  # fmt: skip
SCREENSHOT = Path(__file__).resolve().parents[1] / "docs" / "figures" / "explore.png"


def chromium_path() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="module")
def browser():
    pytest.importorskip("gradio", reason="capsnet explore needs Gradio: pip install 'capsnet[app]'")
    sync = pytest.importorskip("playwright.sync_api", reason=INSTALL)
    path = chromium_path()
    with sync.sync_playwright() as p:
        try:
            b = p.chromium.launch(executable_path=path, args=CHROMIUM_ARGS) if path else p.chromium.launch()
        except Exception as e:  # Playwright's own browser not downloaded
            pytest.skip(f"{INSTALL} ({str(e).splitlines()[0]})")
        yield b
        b.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def digit_png(tmp_path) -> Path:
    """A bundled test digit as a PNG file, black ink on white (as a user would photograph one)."""
    from PIL import Image, ImageOps

    from capsnet.data import load_dataset

    img = load_dataset("mnist-sample").test.images[3, 0].numpy()
    path = tmp_path / "digit.png"
    ImageOps.invert(Image.fromarray(img)).resize((112, 112)).save(path)
    return path


def pixels(png: bytes):
    from PIL import Image

    return bytes(Image.open(io.BytesIO(png)).convert("L").tobytes())


def test_explore_in_a_browser(browser, tmp_path):
    from capsnet.cli.checkpoints import pretrained_folder
    from capsnet.models.pretrained import load_pretrained
    from capsnet.training.evaluate import predict
    from capsnet.viz.explore import Explorer, test_images

    folder = pretrained_folder("efficient-capsnet:mnist-sample")
    model = load_pretrained(folder)
    ex = Explorer(model, images=test_images(model, folder), title="EfficientCapsNet (efficient-capsnet:mnist-sample)")
    assert ex.gallery_paths, "the shipped model records its test images"
    url = ex.launch(host="127.0.0.1", port=free_port(), block=False, quiet=True)
    try:
        page = browser.new_page(viewport={"width": 1400, "height": 1500})
        page.goto(url)
        png = digit_png(tmp_path)
        want = predict(model, [png])[0]["name"]
        page.locator("#upload input[type=file]").set_input_files(str(png))
        page.wait_for_function("() => !document.querySelector('#prediction').innerText.includes('no image')",
                               timeout=30_000)  # fmt: skip
        assert f"Prediction: {want} " in page.locator("#prediction").inner_text()

        recon = page.locator("#reconstruction img")
        recon.wait_for(timeout=30_000)
        before = recon.get_attribute("src")
        still = pixels(recon.screenshot())
        page.locator("#pose-0 input[type=range]").fill("0.25")
        page.wait_for_function(f"() => document.querySelector('#reconstruction img').src !== {before!r}",
                               timeout=30_000)  # fmt: skip
        page.wait_for_timeout(300)  # the new image decoded
        assert pixels(recon.screenshot()) != still

        page.get_by_role("tab", name="Test images").click()
        page.locator("#gallery img").nth(1).click()
        want = predict(model, [ex.gallery_paths[1]])[0]["name"]
        page.wait_for_function(
            f"() => document.querySelector('#prediction').innerText.includes('Prediction: {want} ')", timeout=30_000
        )
        page.wait_for_timeout(500)
        shot = SCREENSHOT if os.environ.get("CAPSNET_SCREENSHOT") else tmp_path / "explore.png"
        page.screenshot(path=str(shot), full_page=True)
        assert shot.stat().st_size > 10_000  # (a page drawn, not a blank one)
    finally:
        ex.close()
