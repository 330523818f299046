"""The docs site's sources: the API reference covers the public API and the routing layers, and every page in
docs/ is in mkdocs.yml's nav (`make docs` builds the site with --strict: broken links and references fail)."""

import re
from pathlib import Path

import capsnet
import capsnet.routing

ROOT = Path(__file__).resolve().parents[1]
API = (ROOT / "docs" / "api.md").read_text(encoding="utf-8")
MKDOCS = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")


def documented() -> set[str]:
    return set(re.findall(r"^::: ([\w.]+)$", API, flags=re.M))


def test_the_api_reference_covers_capsnet_all_and_the_routing_layers():
    names = {path.rsplit(".", 1)[1] for path in documented()}
    assert set(capsnet.__all__) - {"__version__"} <= names
    layers = {"Router", "SelfAttentionRouter", "InvertedAttentionFC", "InvertedAttentionConv", "SelfRoutingFC",
              "SelfRoutingConv", "PrimaryMatrixCaps", "ConvCaps", "ClassCaps"}  # fmt: skip
    assert layers <= names and layers <= set(capsnet.routing.__all__)
    for path in documented():  # each entry names the object where it is defined
        module, name = path.rsplit(".", 1)
        obj = getattr(__import__(module, fromlist=[name]), name)
        assert getattr(obj, "__module__", module) == module, path


def test_every_docs_page_is_in_the_nav():
    nav = set(re.findall(r":\s*([\w-]+\.md)\s*$", MKDOCS, flags=re.M))
    pages = {p.name for p in (ROOT / "docs").glob("*.md")} - {"index.md"}  # index.md: the README, made by make docs
    assert pages <= nav, f"add to mkdocs.yml's nav: {sorted(pages - nav)}"
    assert "index.md" in nav and "api.md" in nav
