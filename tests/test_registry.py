"""The routing registry (capsnet.configs.routings, capsnet.routing.registry) and plugins through entry points
(capsnet.plugins), in this process: every record builds a layer that routes and learns, CapsNet builds its class
capsules from the records, docs/models.md shows the registry's table, one record added is a routing everywhere, and
installed plugins' routings and models are found, loaded, reloaded, refused in one line when broken, and never read
while the command line's parser is built. tests/test_plugins.py installs a plugin and uses it from the command line.
"""

import importlib.metadata
import json
import re
import sys
from pathlib import Path

import pytest
import torch
from helpers import small_config, write_plugin

from capsnet import CapsNet, create_model, list_models, load_pretrained
from capsnet.cli import build_parser, main
from capsnet.configs.capsnet import CapsNetConfig
from capsnet.configs.routings import (
    ROUTINGS,
    RoutingRecord,
    fully_connected,
    routing_names,
    routing_record,
    routing_table,
)
from capsnet.errors import ConfigError
from capsnet.experiments.compare import entries
from capsnet.models.registry import MODELS
from capsnet.plugins import PluginError
from capsnet.routing.base import RoutingOutput
from capsnet.routing.registry import build_routing

ROOT = Path(__file__).resolve().parents[1]
# The plugin that docs/plugins.md shows, its module's source as the page has it.
TOY = re.search(r"```python\n# capsnet_toy.py\n(.*?)```", (ROOT / "docs" / "plugins.md").read_text("utf-8"), re.S)


def _config(routing: str, **options) -> CapsNetConfig:
    return small_config(routing=routing, **({"class_dim": 16} if routing == "em" else {}), **options)


# ------------------------------------------------------------------------------------------------ the records
def test_docs_models_shows_the_registrys_table():
    assert routing_table() in (ROOT / "docs" / "models.md").read_text(encoding="utf-8")


def test_the_registry_holds_the_four_routings_of_before_em_and_deepcaps_3d_routing():
    assert fully_connected()[:5] == ["dynamic", "self-attention", "inverted-attention", "self-routing", "em"]
    assert {"heinsen", "heinsen-vector", "cluster", "variational-bayes"} <= set(fully_connected())
    assert ROUTINGS["3d"].layer is None and ROUTINGS["3d"].models == ("deepcaps",)
    assert {m for r in ROUTINGS.values() for m in r.models} <= set(MODELS)


@pytest.mark.parametrize("name", fully_connected())
def test_every_routing_builds_a_layer_that_routes_and_learns(name):
    torch.manual_seed(0)
    record = routing_record(name)
    layer = build_routing(name, in_caps=6, out_caps=3, in_d=4, out_d=16, iterations=2)
    assert (layer.in_caps, layer.out_caps, layer.in_d, layer.out_d) == (6, 3, 4, 16)
    if record.iterates:
        assert layer.iterations == 2
    u = (0.3 * torch.randn(5, 6, 4)).requires_grad_()
    out = layer(u, torch.rand(5, 6), return_weights=True) if record.activations else layer(u, return_weights=True)
    assert isinstance(out, RoutingOutput) and out.capsules.shape == (5, 3, 16)
    torch.testing.assert_close(out.weights.sum(dim=2), torch.ones(5, 6))  # each child's weights over the parents
    assert (out.activations is not None) == record.activations
    loss = out.capsules.square().sum() + (out.activations.sum() if out.activations is not None else 0)
    loss.backward()
    assert torch.isfinite(u.grad).all() and u.grad.abs().sum() > 0
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in layer.parameters())


@pytest.mark.parametrize("name", fully_connected())
def test_capsnet_builds_its_class_capsules_and_iterations_from_the_record(name):
    model = CapsNet(config=_config(name))
    expected = build_routing(name, in_caps=model.config.n_primary, out_caps=10, in_d=4,
                             out_d=model.config.class_dim, iterations=1)  # fmt: skip
    assert type(model.class_caps) is type(expected)
    assert model.config.routing_iterations == (routing_record(name).iterations or 1)
    assert CapsNet(config=_config(name, routing_iterations=5)).config.routing_iterations == 5


def test_an_unknown_routing_is_one_line_that_lists_the_known_ones(tmp_path, capsys):
    with pytest.raises(ConfigError) as caught:
        CapsNetConfig(routing="nope")
    line = str(caught.value)
    assert "\n" not in line and "unknown routing 'nope'" in line
    assert all(name in line for name in fully_connected())
    assert main(["train", "--routing", "nope", "--out", str(tmp_path / "run"), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unknown routing 'nope'" in err
    assert not (tmp_path / "run").exists()


def test_grid_routing_is_refused_naming_the_model_that_has_it():
    with pytest.raises(ConfigError, match=r"routing '3d' routes capsule grids .* --model deepcaps"):
        CapsNetConfig(routing="3d")


def test_an_option_of_other_routings_is_refused_naming_them():
    with pytest.raises(
        ConfigError, match=r"router_init_std: options of dynamic, self-attention, em, variational-bayes routing"
    ):
        CapsNetConfig(routing="self-routing", router_init_std=0.1)
    with pytest.raises(ConfigError, match="--class-dim 16"):
        CapsNetConfig(routing="em", class_dim=8)
    CapsNetConfig(routing="em", router_init_std=0.1)  # an option EM takes


UNIFORM = """
import torch
from torch import nn
from capsnet.nn.squash import squash
from capsnet.routing.base import RoutingOutput, votes


class UniformFC(nn.Module):
    def __init__(self, *, in_caps, out_caps, in_d, out_d, iterations):
        super().__init__()
        self.in_caps, self.out_caps, self.in_d, self.out_d = in_caps, out_caps, in_d, out_d
        self.weight = nn.Parameter(torch.randn(in_caps, out_caps, in_d, out_d) / in_caps**0.5)

    def forward(self, u, a=None, *, return_weights=False):
        v = squash(votes(self.weight, u).mean(dim=1))
        c = u.new_full((len(u), self.in_caps, self.out_caps), 1 / self.out_caps)
        return RoutingOutput(v, c) if return_weights else v
"""


def test_one_record_adds_a_routing_everywhere(tmp_path, monkeypatch):
    (tmp_path / "registry_test_uniform.py").write_text(UNIFORM, encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    record = RoutingRecord(name="uniform-test", layer="registry_test_uniform:UniformFC", method="uniform routing",
                           classes=("UniformFC",), paper="a test")  # fmt: skip
    monkeypatch.setitem(ROUTINGS, "uniform-test", record)
    model = CapsNet(config=_config("uniform-test"))
    assert type(model.class_caps).__name__ == "UniformFC" and "uniform-test" in routing_names()
    out = model(torch.rand(2, 1, 28, 28), return_coupling=True)
    torch.testing.assert_close(out.coupling, torch.full_like(out.coupling, 0.1))
    model.save_pretrained(tmp_path / "saved")
    loaded = load_pretrained(tmp_path / "saved")
    x = torch.rand(2, 1, 28, 28)
    torch.testing.assert_close(loaded(x).lengths, model.eval()(x).lengths)
    assert "| uniform routing (`UniformFC`) | a test |" in routing_table()
    assert [e.label for e in entries(["uniform-test"], None, {})] == ["capsnet --routing uniform-test"]


def test_build_routing_refuses_what_is_not_a_routing_layer(tmp_path, monkeypatch):
    (tmp_path / "registry_test_bad.py").write_text("def make(**sizes):\n    return 'not a layer'\n", encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(ROUTINGS, "bad-test", RoutingRecord(name="bad-test", layer="registry_test_bad:make",
                                                           method="bad", paper="-"))  # fmt: skip
    with pytest.raises(ConfigError, match="returned a str, not a routing layer"):
        CapsNet(config=_config("bad-test"))


# ---------------------------------------------------------------------------------------------------- plugins
@pytest.fixture
def toy_plugin(tmp_path, monkeypatch):
    """docs/plugins.md's plugin installed (on sys.path, with its .dist-info), and a broken routing plugin."""
    site = write_plugin(tmp_path / "site", "capsnet-toy-test", {"capsnet_toy": TOY.group(1)}, {
        "capsnet.routings": {"uniform": "capsnet_toy:UniformRouting", "broken": "capsnet_toy_missing:Layer"},
        "capsnet.models": {"tiny-net": "capsnet_toy:TinyNet"},
    })  # fmt: skip
    monkeypatch.syspath_prepend(str(site))
    yield site
    if "tiny-net" in MODELS:
        del MODELS["tiny-net"]
    sys.modules.pop("capsnet_toy", None)


def test_a_plugins_routing_is_found_loaded_trained_and_reloaded(toy_plugin, tmp_path):
    assert routing_names()[-2:] == ["broken", "uniform"]  # after the built-in ones, sorted
    record = routing_record("uniform")
    assert record.plugin == "capsnet-toy-test 0.1" and record.paper.startswith("uniform coupling")
    model = CapsNet(config=_config("uniform")).train()
    images, labels = torch.rand(4, 1, 28, 28), torch.tensor([0, 1, 2, 3])
    loss, _ = model.loss(model(images, labels), images, labels)
    loss.backward()
    assert all(p.grad is not None for p in model.class_caps.parameters())
    model.save_pretrained(tmp_path / "saved")
    saved = json.loads((tmp_path / "saved" / "config.json").read_text(encoding="utf-8"))
    assert saved["plugins"] == ["capsnet-toy-test 0.1"] and saved["config"]["routing"] == "uniform"
    torch.testing.assert_close(load_pretrained(tmp_path / "saved")(images).lengths, model.eval()(images).lengths)


def test_a_plugins_model_registers_on_first_lookup(toy_plugin):
    assert "tiny-net" not in MODELS
    model = create_model("tiny-net", hidden=8)
    assert type(model).__name__ == "TinyNet" and model.config.hidden == 8
    assert MODELS.plugin("tiny-net") == "capsnet-toy-test 0.1"
    assert model(torch.rand(3, 1, 28, 28)).predictions.shape == (3,)


def test_list_models_lists_the_installed_plugins_models(toy_plugin):
    assert "tiny-net" in list_models() and "tiny-net" in list_models("tiny*")


def test_a_plugin_that_fails_to_import_is_one_line_naming_it(toy_plugin, tmp_path, capsys):
    with pytest.raises(PluginError) as caught:
        routing_record("broken")
    line = str(caught.value)
    assert "\n" not in line and "plugin 'broken'" in line and "capsnet-toy-test 0.1" in line
    assert "ModuleNotFoundError" in line
    assert main(["train", "--routing", "broken", "--out", str(tmp_path / "run"), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "plugin 'broken'" in err
    assert main(["models"]) == 0  # the others are listed; the broken one is a warning
    out, err = capsys.readouterr()
    assert "uniform" in out and "tiny-net" in out and "warning: plugin 'broken'" in err


def test_a_name_two_distributions_declare_is_one_line_naming_both(toy_plugin, tmp_path, monkeypatch):
    other = write_plugin(tmp_path / "other", "capsnet-other", {}, {"capsnet.routings": {"uniform": "other:Layer"}})
    monkeypatch.syspath_prepend(str(other))
    with pytest.raises(PluginError, match=r"'uniform' is declared twice: ") as caught:
        routing_record("uniform")
    assert "capsnet-toy-test 0.1" in str(caught.value) and "capsnet-other 0.1" in str(caught.value)


def test_entry_points_are_not_read_to_build_the_parser_or_a_built_in_config(monkeypatch, capsys):
    def refuse(**_):
        raise AssertionError("entry points read")

    monkeypatch.setattr(importlib.metadata, "entry_points", refuse)
    for argv in (["--help"], ["train", "--help"], ["compare", "--help"]):
        with pytest.raises(SystemExit) as done:
            build_parser(argv).parse_args(argv)
        assert done.value.code == 0
    assert "--routing" in capsys.readouterr().out
    CapsNet(config=_config("dynamic"))
