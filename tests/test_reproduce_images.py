"""`capsnet reproduce cifar10|smallnorb|svhn`: the paper's §7 setups, run on stand-ins in the real file formats."""

from __future__ import annotations

import json

import pytest

from capsnet import cli
from capsnet.experiments import image_sets


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("CAPSNET_DATA", str(tmp_path / "cache"))


def test_paper_setups():
    full = {e: image_sets.setting_for(e, quick=False, out="o") for e in image_sets.EXPERIMENTS}
    assert full["cifar10"].models == 7 and full["cifar10"].dataset == "cifar10"
    assert full["cifar10"].capsnet == dict(primary_types=64, padding="same", leaky_routing=True, decoder=False)
    assert full["smallnorb"].capsnet == {}  # the MNIST architecture
    assert full["svhn"].capsnet == dict(conv_channels=64, primary_types=16, primary_dim=6, class_dim=8)
    quick = image_sets.setting_for("svhn", quick=True, out="o")
    assert quick.capsnet["primary_dim"] == 6 and quick.capsnet["class_dim"] == 8 and "stand-in" in quick.note


@pytest.mark.slow
@pytest.mark.parametrize("experiment", ["cifar10", "smallnorb", "svhn"])
def test_reproduce_on_a_stand_in(tmp_path, experiment):
    if experiment == "svhn":
        pytest.importorskip("scipy")
    folder = image_sets.write_standin(experiment, tmp_path / "standin")
    quick = image_sets.setting_for(experiment, quick=True, out=tmp_path)
    setting = image_sets.ImageSetting(dataset=str(folder), epochs=1, batch_size=8, models=quick.models,
                                      capsnet={**quick.capsnet, "conv_channels": 8, "primary_types": 2},
                                      train_subset=16)  # fmt: skip
    report = image_sets.run_image_experiment(experiment, out=str(tmp_path / "out"), device="cpu", progress=False,
                                             setting=setting)  # fmt: skip
    rows = report["rows"]
    assert rows[0]["paper"] == image_sets.PAPER[experiment] and 0 <= rows[0]["ours"] <= 100
    assert len(rows) == (3 if experiment == "cifar10" else 1)  # two members and their ensemble
    meta = json.loads((tmp_path / "out" / experiment / ("capsnet-0" if experiment == "cifar10" else "capsnet")
                       / "config.json").read_text())  # fmt: skip
    size = {"cifar10": 24, "smallnorb": 32, "svhn": 32}[experiment]
    assert meta["model"]["image_size"] == size
    assert meta["model"]["in_channels"] == (2 if experiment == "smallnorb" else 3)
    assert (tmp_path / "out" / experiment / "results.json").is_file()


def test_cli_rejects_unknown_experiment(capsys):
    assert cli.main(["reproduce", "imagenet", "--quick"]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1
