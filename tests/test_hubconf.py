"""hubconf.py: `torch.hub.load(REPO_DIR, NAME, source="local", pretrained=...)` for every model in the registry (and
a model registered later), fresh or with weights, as `capsnet.create_model` gives it."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from helpers import SMALL_OPTIONS, small_config

from capsnet import CapsNet, create_model
from capsnet.errors import ConfigError
from capsnet.models.hub import shipped_tags
from capsnet.models.registry import MODELS

ROOT = Path(__file__).resolve().parents[1]


def _same(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def _hubconf():
    spec = importlib.util.spec_from_file_location("hubconf_under_test", ROOT / "hubconf.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_hubconf_has_an_entry_point_for_every_registered_model_and_nothing_else():
    names = {n for n in dir(_hubconf()) if not n.startswith("_") and callable(getattr(_hubconf(), n))}
    assert names == set(MODELS) | {n.replace("-", "_") for n in MODELS}


@pytest.mark.parametrize("name", list(MODELS))
def test_torch_hub_load_builds_every_registered_model(name):
    options = SMALL_OPTIONS.get(name, {})
    model = torch.hub.load(str(ROOT), name, source="local", **options)
    assert type(model) is MODELS[name] and model.training and model.provenance is None
    assert type(torch.hub.load(str(ROOT), name.replace("-", "_"), source="local", **options)) is MODELS[name]


@pytest.mark.parametrize(("name", "tag"), [(n, t) for n in MODELS for t in shipped_tags(n)])
def test_torch_hub_load_with_a_shipped_tag_is_create_models(name, tag):
    model = torch.hub.load(str(ROOT), name, source="local", pretrained=tag)
    assert not model.training and _same(model, create_model(name, pretrained=tag))
    assert model.provenance["source"] == tag


def test_torch_hub_load_takes_a_folder_options_and_refuses_what_create_model_refuses(tmp_path):
    saved = CapsNet(config=small_config()).save_pretrained(tmp_path / "small")
    model = torch.hub.load(str(ROOT), "capsnet", source="local", pretrained=str(saved), routing_iterations=1)
    assert _same(model, CapsNet.from_pretrained(saved)) and model.config.routing_iterations == 1
    with pytest.raises(ConfigError, match=r"unknown key\(s\) no_such_option"):
        torch.hub.load(str(ROOT), "capsnet", source="local", no_such_option=1)


def test_a_model_registered_later_gets_its_entry_point():
    class HubTestNet(CapsNet):
        model_type = "hub-test-net"

    MODELS.register("hub-test-net", HubTestNet)
    try:
        model = torch.hub.load(str(ROOT), "hub_test_net", source="local", **SMALL_OPTIONS["capsnet"])
        assert type(model) is HubTestNet
    finally:
        del MODELS["hub-test-net"]
