"""The library surface: one registry (names and aliases), list_models, create_model (fresh, from a folder, from shipped
weights), the shipped-weights mechanism (a temporary weights root: no weights are committed for these tests) and
state-dict mismatches as one CheckpointError line."""

import json

import pytest
import torch
from helpers import SMALL_MODEL, small_config, write_digits
from test_devices_models import MODEL_KWARGS

import capsnet
from capsnet import CapsNet, create_model, list_models, load_pretrained
from capsnet.cli import main
from capsnet.errors import CheckpointError, ConfigError
from capsnet.models import hub
from capsnet.models.baseline import BaselineCNN
from capsnet.models.pretrained import StateDictError
from capsnet.models.registry import MODELS, Registry
from capsnet.training.config import TrainConfig

# Small settings per model (input 1×28×28, 10 classes): milliseconds to build; those of test_devices_models, plus
# CapsNet's and the baseline's. A model missing here is built with its defaults, so a newly registered model is
# covered too.
TINY = {**MODEL_KWARGS, "capsnet": SMALL_MODEL, "baseline": {"channels": (4, 4), "hidden": (8, 8)}}
INPUT = {"in_channels": 1, "image_size": 28}
CARD = {
    "command": "capsnet train --out runs/x",
    "dataset": "mnist-sample",
    "val_accuracy": 0.5,
    "test_accuracy": 0.25,
    "epoch": 1,
    "capsnet_version": capsnet.__version__,
    "data_md5": {"train-images-idx3-ubyte.gz": "0" * 32},
}


def tiny(name: str, **options):
    torch.manual_seed(0)
    return create_model(name, **{**INPUT, **TINY.get(name, {}), **options})


@pytest.fixture
def weights_root(tmp_path, monkeypatch):
    """An empty weights root in place of the package's (CAPSNET_WEIGHTS_DIR)."""
    root = tmp_path / "weights"
    monkeypatch.setenv(hub.WEIGHTS_DIR_ENV, str(root))
    return root


# ------------------------------------------------------------------------------------------------ registry
def test_list_models_gives_the_sorted_registered_names():
    names = list_models()
    assert names == sorted(MODELS) and len(names) == len(MODELS) >= 6
    assert {"capsnet", "baseline", "em-capsnet", "efficient-capsnet"} <= set(names)
    assert "baseline-cnn" not in names  # an alias, not a model of its own
    assert list_models("*capsnet") == [n for n in names if n.endswith("capsnet")]
    assert list_models("no-such-*") == []


@pytest.mark.parametrize("name", list(MODELS))
def test_create_model_builds_every_registered_model(name):
    model = tiny(name)
    assert type(model) is MODELS[name] and model.training
    options = {k: v for k, v in TINY.get(name, {}).items() if not isinstance(v, tuple)}
    for key, value in options.items():
        assert getattr(model.config, key) == value
    out = model.eval()(torch.rand(2, 1, 28, 28))
    assert out.lengths.shape == (2, 10) and torch.isfinite(out.lengths).all()


def test_every_name_that_worked_keeps_working(tmp_path):
    assert type(create_model("baseline-cnn", **TINY["baseline"])) is BaselineCNN  # the model_type config.json records
    assert type(create_model("baseline", **TINY["baseline"])) is BaselineCNN
    assert TrainConfig(model="baseline-cnn").model == "baseline"  # runs record the registered name
    assert MODELS["baseline-cnn"] is MODELS["baseline"] and "baseline-cnn" in MODELS
    BaselineCNN(**TINY["baseline"]).save_pretrained(tmp_path / "m")
    assert json.loads((tmp_path / "m" / "config.json").read_text())["model_type"] == "baseline-cnn"
    assert type(load_pretrained(tmp_path / "m")) is BaselineCNN
    assert type(create_model("baseline", pretrained=tmp_path / "m")) is BaselineCNN
    for name in MODELS:
        assert MODELS.canonical(MODELS[name].model_type) == name  # every saved model_type resolves


def test_a_bad_name_or_option_is_one_config_error_naming_the_known_ones():
    with pytest.raises(ConfigError, match=r"unknown model 'nope'; known: capsnet, baseline"):
        create_model("nope")
    with pytest.raises(ConfigError, match=r"unknown key\(s\) widht; known: .*conv_channels"):
        create_model("capsnet", widht=3)
    with pytest.raises(ConfigError, match="routing_iterations: expected an integer"):
        create_model("capsnet", routing_iterations="3")
    assert main(["train", "--model", "nope"]) == 2


def test_the_registry_registers_in_one_line_and_refuses_clashing_names():
    registry = Registry()
    registry.register("net", CapsNet)  # CapsNet saves as model_type "capsnet": an alias of "net" here
    assert list(registry) == ["net"] and registry["capsnet"] is CapsNet and registry.aliases("net") == ["capsnet"]
    with pytest.raises(ValueError, match="taken by 'net'"):
        registry.register("capsnet", BaselineCNN)
    del registry["net"]
    assert "capsnet" not in registry and len(registry) == 0


# ------------------------------------------------------------------------------------------------ pretrained
def test_create_model_from_a_folder_keeps_its_weights_and_data_fields(tmp_path, capsys):
    model = CapsNet(config=small_config(n_classes=4, class_names=("a", "b", "c", "d")))
    model.save_pretrained(tmp_path / "m")
    loaded = create_model("capsnet", pretrained=str(tmp_path / "m"))
    assert not loaded.training and loaded.config == model.config
    for (k, a), b in zip(model.state_dict().items(), loaded.state_dict().values(), strict=True):
        assert torch.equal(a, b), k
    quick = create_model("capsnet", pretrained=tmp_path / "m", routing_iterations=1, n_classes=4)  # no change
    assert quick.config.routing_iterations == 1 and quick.config.class_names == ("a", "b", "c", "d")
    with pytest.raises(ConfigError, match=r"conv_channels=8 changes the architecture .*conv1.weight"):
        create_model("capsnet", pretrained=tmp_path / "m", conv_channels=8)
    tuned = create_model("capsnet", pretrained=tmp_path / "m", n_classes=10)  # fine-tuning: fresh class capsules
    assert tuned.config.n_classes == 10 and tuned.config.class_names == ()
    assert "4 classes -> 10: re-initialised" in capsys.readouterr().err
    assert torch.equal(tuned.conv1.weight, model.conv1.weight)
    with pytest.raises(ConfigError, match="in_channels=3: the pretrained weights record in_channels=1"):
        create_model("capsnet", pretrained=tmp_path / "m", in_channels=3)
    with pytest.raises(ConfigError, match="unknown option"):
        create_model("capsnet", pretrained=tmp_path / "m", widht=3)
    with pytest.raises(CheckpointError, match="holds a 'capsnet' model, not a BaselineCNN"):
        create_model("baseline", pretrained=tmp_path / "m")


def test_create_model_from_a_run_folder_loads_its_best(tmp_path):
    CapsNet(config=small_config()).save_pretrained(tmp_path / "run" / "last")
    best = CapsNet(config=small_config(class_dim=5))
    best.save_pretrained(tmp_path / "run" / "best")
    (tmp_path / "run" / "config.json").write_text(json.dumps({"train": {"dataset": "mnist-sample"}}))
    assert create_model("capsnet", pretrained=tmp_path / "run").config.class_dim == 5


def test_a_pretrained_that_is_neither_tag_nor_folder_names_the_shipped_tags(weights_root, tmp_path):
    with pytest.raises(ConfigError, match=r"neither a shipped tag of capsnet \(shipped: none\) nor a folder"):
        create_model("capsnet", pretrained="fashion-mnist")
    hub.save_shipped(CapsNet(config=small_config()), name="capsnet", tag="mnist-sample", card=CARD)
    with pytest.raises(ConfigError, match=r"shipped: mnist-sample"):
        create_model("capsnet", pretrained="fashion-mnist")
    with pytest.raises(ConfigError, match=r"give the folder's SHA-256 in the URL"):
        create_model("capsnet", pretrained="https://example.com/capsnet")  # (refused before any download)
    with pytest.raises(ConfigError, match=r"no shipped weights 'nope' for capsnet \(shipped: mnist-sample\)"):
        load_pretrained("capsnet:nope")


def test_shipped_weights_load_offline_by_tag(weights_root, capsys):
    model = CapsNet(config=small_config(class_names=tuple("abcdefghij")))
    folder = hub.save_shipped(model, name="capsnet", tag="mnist-sample", card=CARD)
    assert folder == weights_root / "capsnet" / "mnist-sample"
    assert sorted(p.name for p in folder.iterdir()) == ["card.json", "config.json", "model.safetensors"]
    assert hub.read_card(folder) == CARD and hub.shipped_tags("capsnet") == ["mnist-sample"]
    assert list_models(pretrained=True) == ["capsnet"]
    for loaded in (create_model("capsnet", pretrained="mnist-sample"), load_pretrained("capsnet:mnist-sample"),
                   CapsNet.from_pretrained("capsnet:mnist-sample")):  # fmt: skip
        assert not loaded.training and loaded.config == model.config
        assert torch.equal(loaded.conv1.weight, model.conv1.weight)
    assert main(["models", "--json"]) == 0
    rows = {r["model"]: r for r in map(json.loads, capsys.readouterr().out.splitlines())}
    assert rows["capsnet"]["weights"] == ["mnist-sample"] and rows["baseline"]["weights"] == []
    assert rows["baseline"]["aliases"] == ["baseline-cnn"]
    assert rows["baseline"]["own_data_epoch_steps"] == 200
    assert rows["em-capsnet"]["own_data_epoch_steps"] == 600
    for name in ("capsnet", "inverted-attention-capsnet", "vb-capsnet", "heinsen-capsnet"):
        assert rows[name]["own_data_epoch_steps"] == 400, name  # (docs/training.md)
    assert rows["heinsen-capsnet"]["own_data_options"] == {"p_model": "skm"}
    small = {"conv_channels": 64, "primary_types": 8, "caps1_types": 16, "caps2_types": 16}  # the paper's small net
    assert rows["em-capsnet"]["own_data_options"] == small
    assert rows["capsnet"]["own_data_options"] == {} and rows["baseline"]["own_data_options"] == {"pool": True}
    assert main(["models"]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].endswith("weights (--pretrained NAME:TAG)") and table[1].split()[0] == "capsnet"
    assert table[1].endswith("mnist-sample")


def test_evaluate_scores_shipped_weights_on_the_data_their_card_names(weights_root, tmp_path, capsys):
    card = {**CARD, "dataset": str(write_digits(tmp_path / "digits", 12))}
    hub.save_shipped(CapsNet(config=small_config()), name="capsnet", tag="digits", card=card)
    assert main(["evaluate", "--pretrained", "capsnet:digits", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["dataset"] == "digits" and r["n"] == 12
    assert main(["evaluate", "--pretrained", "capsnet:nope"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no shipped weights 'nope' for capsnet" in err[0]
    assert main(["evaluate", "--pretrained", "capsnet"]) == 2
    assert "expected NAME:TAG" in capsys.readouterr().err


@pytest.mark.parametrize(
    "change, message",
    [
        ({"epoch": 0}, "epoch must be >= 1"),
        ({"val_accuracy": 1.5}, r"must lie in \[0, 1\]"),
        ({"data_md5": {"x": "not an md5"}}, "data_md5 must map"),
        ({"command": None}, "command has the wrong type"),
        ({"dataset": ...}, "missing dataset"),
    ],
)
def test_a_card_must_record_how_the_weights_were_made(weights_root, change, message):
    card = {k: v for k, v in {**CARD, **change}.items() if v is not ...}
    with pytest.raises(CheckpointError, match=message):
        hub.save_shipped(CapsNet(config=small_config()), name="capsnet", tag="t", card=card)
    assert not (weights_root / "capsnet" / "t").exists()


def test_save_shipped_refuses_a_model_of_another_name_or_a_bad_tag(weights_root):
    with pytest.raises(ConfigError, match="cannot ship as baseline"):
        hub.save_shipped(CapsNet(config=small_config()), name="baseline", tag="t", card=CARD)
    with pytest.raises(ConfigError, match="tag 'Bad Tag'"):
        hub.save_shipped(CapsNet(config=small_config()), name="capsnet", tag="Bad Tag", card=CARD)


@pytest.mark.parametrize("name", [n for n in MODELS if hub.shipped_tags(n)])
def test_every_shipped_folder_loads_and_has_a_card(name):
    """The weights committed into the package (none until a run is chosen for shipping)."""
    for tag in hub.shipped_tags(name):
        folder = hub.shipped_folder(name, tag)
        card = hub.read_card(folder)
        assert card is not None, f"{folder}: no card.json"
        model = create_model(name, pretrained=tag)
        assert type(model) is MODELS[name]


# ------------------------------------------------------------------------------------------------ mismatches
def test_a_state_dict_mismatch_is_one_checkpoint_error_line(tmp_path, capsys):
    model = CapsNet(config=small_config())
    with pytest.raises(StateDictError, match=r"weights do not fit this CapsNet: size mismatch for conv1.weight"):
        model.load_state_dict(CapsNet(config=small_config(conv_channels=8)).state_dict())
    assert issubclass(StateDictError, CheckpointError) and issubclass(StateDictError, RuntimeError)
    model.save_pretrained(tmp_path / "m")
    meta = json.loads((tmp_path / "m" / "config.json").read_text())
    meta["config"]["conv_channels"] = 8  # config.json no longer describes the weights
    (tmp_path / "m" / "config.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match=r"weights do not match config.json \(size mismatch for conv1.weight"):
        load_pretrained(tmp_path / "m")
    for argv in (["evaluate", "--checkpoint", str(tmp_path / "m"), "--dataset", "mnist-sample"],
                 ["predict", "--checkpoint", str(tmp_path / "m"), str(tmp_path / "x.png")],
                 ["export", "--checkpoint", str(tmp_path / "m"), "--out", str(tmp_path / "m.pt2")]):  # fmt: skip
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "weights do not match config.json" in err[0], argv


@pytest.mark.slow
def test_resuming_with_weights_that_do_not_fit_is_one_line(tmp_path, capsys):
    from helpers import SMALL_FLAGS

    run = tmp_path / "run"
    flags = ["--train-subset", "32", "--test-subset", "32", "--batch-size", "16", "--no-progress", *SMALL_FLAGS]
    assert main(["train", "--out", str(run), "--epochs", "1", *flags]) == 0
    state = torch.load(run / "state.pt", weights_only=True)
    state["model"]["conv1.weight"] = state["model"]["conv1.weight"][:8]  # weights of another model
    torch.save(state, run / "state.pt")
    capsys.readouterr()
    assert main(["train", "--out", str(run), "--epochs", "2", "--resume", *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "weights do not fit this CapsNet: size mismatch for conv1.weight" in err[0]
