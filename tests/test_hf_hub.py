"""`hf-hub:ORG/REPO[@REVISION]` and `push_to_hub` / `capsnet push` against a loopback server that answers the Hugging
Face Hub's HTTP API as the Hub does (tests/hub_server.py), huggingface_hub pointed at it (its ENDPOINT, as HF_ENDPOINT
sets it) with an empty cache of its own: a folder goes up with its card and comes back down equal, in Python and on
the command line, then offline from the cache; each failure is one line. Never the real Hub."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import small_config
from hub_server import FakeHub

from capsnet import CapsNet, create_model, load_pretrained
from capsnet.cli import main
from capsnet.errors import CheckpointError, ConfigError, DownloadError
from capsnet.limits import MAX_HUB_FILES

hf = pytest.importorskip("huggingface_hub")
pytest.importorskip("huggingface_hub.constants")
yaml = pytest.importorskip("yaml")
TOKEN = "hf_accepted"
CARD = {
    "command": "capsnet train --model capsnet --dataset fashion-mnist --epochs 30 --out runs/f",
    "dataset": "fashion-mnist",
    "val_accuracy": 0.9125,
    "test_accuracy": 0.9043,
    "epoch": 27,
    "capsnet_version": "0.1.0",
    "data_md5": {"t10k-images-idx3-ubyte.gz": "bef4ecab320f06d8554ea6380940ec79"},
    "validation": {"source": "held out of the training split", "fraction": 0.1, "seed": 0, "n": 6000},
    "test_n": 10000,
    "seeds": [3],
}


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """The loopback Hub, as HF_ENDPOINT would name it, with an empty Hub cache, no stored token, LFS uploads (the
    server does not speak Xet) and capsnet's own cache empty too."""
    constants = hf.constants
    with FakeHub(tokens=(TOKEN,)) as server:
        monkeypatch.setattr(constants, "ENDPOINT", server.url)
        monkeypatch.setattr(
            constants, "HUGGINGFACE_CO_URL_TEMPLATE", server.url + "/{repo_id}/resolve/{revision}/{filename}"
        )
        monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf"))
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
        monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)
        monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "hf-token"))
        monkeypatch.setattr(constants, "HF_STORED_TOKENS_PATH", str(tmp_path / "hf-stored-tokens"))
        monkeypatch.setattr(constants, "AGENT_HARNESSES_PATH", str(tmp_path / "hf-agent-harnesses.json"))
        monkeypatch.delenv("HF_TOKEN", raising=False)
        monkeypatch.setenv("CAPSNET_DATA", str(tmp_path / "cache"))
        yield server


@pytest.fixture
def model():
    return CapsNet(config=small_config(class_names=tuple("abcdefghij"), digits=False))


def _same(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def _files(model: torch.nn.Module, folder: Path) -> dict[str, bytes]:
    model.save_pretrained(folder)
    return {name: (folder / name).read_bytes() for name in ("config.json", "model.safetensors")}


def test_push_to_hub_makes_the_hubs_calls_and_the_folder_comes_back_equal_then_offline(
    hub, model, tmp_path, monkeypatch
):
    done = model.push_to_hub("org/small", card=CARD, token=TOKEN)
    # (huggingface_hub's own look-up of its user-agent registry, /api/agent-harnesses, is not a call of the push)
    hub.requests[:] = [r for r in hub.requests if r.path != "/api/agent-harnesses"]
    calls = [(r.method, r.path.split("?")[0]) for r in hub.requests]
    weights = next(r.body for r in hub.sent("PUT", "/lfs/"))
    oid = hashlib.sha256(weights).hexdigest()
    assert calls == [
        ("POST", "/api/repos/create"),
        ("POST", "/api/validate-yaml"),
        ("POST", "/api/models/org/small/preupload/main"),
        ("POST", "/org/small.git/info/lfs/objects/batch"),
        ("PUT", f"/lfs/{oid}"),
        ("POST", "/api/models/org/small/commit/main"),
    ]
    assert all(r.headers["authorization"] == f"Bearer {TOKEN}" for r in hub.requests if r.method != "PUT")
    assert json.loads(hub.requests[0].body) == {"name": "small", "organization": "org"}
    preupload = json.loads(hub.sent("POST", "/preupload/")[0].body)["files"]
    assert [f["path"] for f in preupload] == ["config.json", "model.safetensors", "README.md"]
    batch = json.loads(hub.sent("POST", "/lfs/objects/batch")[0].body)
    assert batch["operation"] == "upload" and batch["objects"] == [{"oid": oid, "size": len(weights)}]
    lines = [json.loads(line) for line in hub.sent("POST", "/commit/")[0].body.splitlines()]
    assert lines[0] == {"key": "header", "value": {"summary": "Upload a capsnet model", "description": ""}}
    sent = {line["value"]["path"]: line for line in lines[1:]}
    assert sent["model.safetensors"] == {
        "key": "lfsFile",
        "value": {"path": "model.safetensors", "algo": "sha256", "oid": oid, "size": len(weights)},
    }
    files = _files(model, tmp_path / "saved")
    assert base64.b64decode(sent["config.json"]["value"]["content"]) == files["config.json"]
    assert weights == files["model.safetensors"] and set(sent) == {"config.json", "model.safetensors", "README.md"}
    commit = hub.repos["org/small"].refs["main"]
    assert done == {
        "repo": "org/small",
        "commit": commit,
        "url": f"{hub.url}/org/small/commit/{commit}",
        "ref": f"hf-hub:org/small@{commit}",
    }

    loaded = load_pretrained("hf-hub:org/small")
    assert _same(loaded, model) and not loaded.training and loaded.config.class_names == tuple("abcdefghij")
    assert loaded.provenance == {
        "source": "hf-hub:org/small",
        "repo": "org/small",
        "revision": "main",
        "commit": commit,
        "pinned": False,
        "folder": str(Path(loaded.provenance["folder"])),
    }
    assert Path(loaded.provenance["folder"]).name == commit  # (the Hub cache's snapshot folder of the commit)
    assert {n: (Path(loaded.provenance["folder"]) / n).read_bytes() for n in files} == files
    hub.requests.clear()
    pinned = create_model("capsnet", pretrained=done["ref"])
    assert _same(pinned, model) and pinned.provenance["pinned"] and pinned.provenance["commit"] == commit
    assert hub.requests == []  # a commit's files, once in the cache, are never asked for again
    assert not hub.sent("GET", "README.md")  # the card is never read to load a model

    monkeypatch.setattr(hf.constants, "HF_HUB_OFFLINE", True)
    hub.requests.clear()
    for ref in ("hf-hub:org/small", done["ref"]):
        offline = load_pretrained(ref)
        assert _same(offline, model) and offline.provenance["commit"] == commit
    assert hub.requests == []


def test_the_model_card_has_the_hubs_metadata_and_says_how_the_model_was_made(hub, model):
    model.push_to_hub("org/card", card=CARD, token=TOKEN)
    text = hub.repos["org/card"].commits[hub.repos["org/card"].refs["main"]]["README.md"].decode()
    _, front, body = text.split("---\n", 2)
    meta = yaml.safe_load(front)
    assert meta["library_name"] == "capsnet" and {"capsnet", "capsule-network"} <= set(meta["tags"])
    assert meta["datasets"] == ["zalando-datasets/fashion_mnist"] and meta["pipeline_tag"] == "image-classification"
    (index,) = meta["model-index"]
    assert index["name"] == "org/card"
    results = {r["dataset"]["split"]: r for r in index["results"]}
    test, val = results["test"]["metrics"][0], results["validation"]["metrics"][0]
    assert (test["type"], test["value"], val["value"]) == ("accuracy", 0.9043, 0.9125)
    assert test["args"] == {
        "seeds": [3],
        "validation": CARD["validation"],
        "epoch": 27,
        "selected_on": "val_acc",
        "command": CARD["command"],
    }
    assert results["test"]["dataset"] == {
        "name": "fashion-mnist",
        "type": "zalando-datasets/fashion_mnist",
        "split": "test",
    }
    assert 'capsnet.load_pretrained("hf-hub:org/card")' in body and "| test accuracy | 90.43% on 10,000 images" in body
    assert "| training seeds | 3 |" in body and "10% of the training split held out, stratified, seed 0" in body
    model.push_to_hub("org/bare", token=TOKEN)  # no card: no figure claimed
    bare = hub.repos["org/bare"].commits[hub.repos["org/bare"].refs["main"]]["README.md"].decode()
    assert "model-index" not in bare and "no accuracy is claimed" in bare


def test_a_branch_is_resolved_once_and_a_commit_pins_the_files(hub, model, tmp_path):
    first = model.push_to_hub("org/moving", token=TOKEN)["commit"]
    other = CapsNet(config=small_config(class_names=tuple("abcdefghij"), digits=False))
    second = other.push_to_hub("org/moving", token=TOKEN)["commit"]
    hub.requests.clear()
    latest = load_pretrained("hf-hub:org/moving@main")
    assert _same(latest, other) and latest.provenance["commit"] == second
    # resolved once (the revision endpoint), then the listing and both files asked by commit, never by "main"
    asked = [r.path for r in hub.requests]
    assert [p for p in asked if "main" in p] == ["/api/models/org/moving/revision/main"]
    assert all(second in p for p in asked[1:]) and len(asked) >= 5
    assert _same(load_pretrained(f"hf-hub:org/moving@{first}"), model)


@pytest.fixture
def run(tmp_path_factory):
    """A finished one-epoch run of a tiny CapsNet on 40 + 12 RGB images (validation-chosen best/, test.json)."""
    from helpers import QUIET_FLAGS, TINY_RUN_FLAGS, write_rgb

    tmp = tmp_path_factory.mktemp("run")
    data = write_rgb(tmp, n_train=40)
    out = tmp / "run"
    argv = ["train", "--dataset", str(data), "--out", str(out), "--batch-size", "8", "--epochs", "1", "--seed", "5"]
    assert main([*argv, *TINY_RUN_FLAGS, *QUIET_FLAGS]) == 0
    return out, data


def test_capsnet_push_publishes_a_run_that_loads_back_on_the_command_line_then_offline(
    hub, run, tmp_path, capsys, monkeypatch
):
    from PIL import Image

    out, data = run
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    capsys.readouterr()
    assert main(["push", "--checkpoint", str(out), "org/run"]) == 0
    printed = capsys.readouterr().out
    commit = hub.repos["org/run"].refs["main"]
    assert f"commit {commit}" in printed and f"--pretrained hf-hub:org/run@{commit}" in printed
    held = hub.repos["org/run"].commits[commit]
    assert {n: held[n] for n in ("config.json", "model.safetensors")} == {
        n: (out / "best" / n).read_bytes() for n in ("config.json", "model.safetensors")
    }
    meta = yaml.safe_load(held["README.md"].decode().split("---\n")[1])
    test = next(r for r in meta["model-index"][0]["results"] if r["dataset"]["split"] == "test")["metrics"][0]
    tested = json.loads((out / "test.json").read_text())
    assert test["value"] == tested["best"]["accuracy"] and test["args"]["seeds"] == [5]
    assert test["args"]["command"].startswith("capsnet train") and "--seed 5" in test["args"]["command"]

    Image.new("RGB", (16, 16), 128).save(tmp_path / "x.png")
    assert main(["predict", "--pretrained", "hf-hub:org/run", str(tmp_path / "x.png"), "--json"]) == 0
    local = capsys.readouterr().out
    assert main(["predict", "--checkpoint", str(out), str(tmp_path / "x.png"), "--json"]) == 0
    assert capsys.readouterr().out == local  # the same prediction as the run's own best/
    monkeypatch.setattr(hf.constants, "HF_HUB_OFFLINE", True)
    hub.requests.clear()
    assert main(["evaluate", "--pretrained", "hf-hub:org/run", "--dataset", str(data), "--json"]) == 0
    assert hub.requests == [] and '"accuracy"' in capsys.readouterr().out


def _one_line(capsys, code: int) -> str:
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0], err
    return err[0]


def test_a_missing_repo_revision_or_file_a_refused_token_or_an_empty_offline_cache_is_one_line(
    hub, model, tmp_path, capsys, monkeypatch
):
    from PIL import Image

    Image.new("L", (28, 28), 128).save(tmp_path / "x.png")
    files = _files(model, tmp_path / "saved")
    hub.add_repo("org/public", files)
    hub.add_repo("org/private", files, private=True)
    hub.add_repo("org/weightless", {"config.json": files["config.json"], "README.md": b"# nothing\n"})

    def predict(ref: str) -> str:
        return _one_line(capsys, main(["predict", "--pretrained", ref, str(tmp_path / "x.png")]))

    assert "hf-hub:org/absent: no such repository on the Hub at http" in predict("hf-hub:org/absent")
    assert "or a private one: give a token" in predict("hf-hub:org/private")
    assert "hf-hub:org/public@v9: no such revision" in predict("hf-hub:org/public@v9")
    assert (
        "no model.safetensors (a capsnet repository holds config.json and model.safetensors; this one holds "
        "README.md, config.json)" in predict("hf-hub:org/weightless")
    )
    monkeypatch.setenv("HF_TOKEN", "hf_refused")
    line = predict("hf-hub:org/public")
    assert "refused the token (HTTP 401: Invalid credentials in Authorization header)" in line
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    assert main(["predict", "--pretrained", "hf-hub:org/private", str(tmp_path / "x.png")]) == 0
    monkeypatch.delenv("HF_TOKEN")
    monkeypatch.setattr(hf.constants, "HF_HUB_OFFLINE", True)
    hub.requests.clear()
    assert "not in the Hub cache" in predict("hf-hub:org/public@v1") and "HF_HUB_OFFLINE is set" in predict(
        "hf-hub:org/public@" + "a" * 40
    )
    assert hub.requests == []
    with pytest.raises(DownloadError, match="HF_HUB_OFFLINE is set"):
        load_pretrained("hf-hub:org/other")
    assert not (tmp_path / "cache").exists()  # nothing in capsnet's own cache


def test_a_push_without_a_token_the_hub_accepts_is_one_line(hub, model, tmp_path, capsys):
    model.save_pretrained(tmp_path / "folder")
    line = _one_line(capsys, main(["push", "--checkpoint", str(tmp_path / "folder"), "org/x"]))
    assert "org/x: " in line and "HTTP 401" in line and "org/x" not in hub.repos
    with pytest.raises(DownloadError, match="refused the token"):
        model.push_to_hub("org/x", token="hf_refused")
    with pytest.raises(ConfigError, match="not a repository ORG/NAME"):
        model.push_to_hub("../x", token=TOKEN)


def test_without_huggingface_hub_one_line_names_the_extra(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # (import huggingface_hub raises ImportError)
    with pytest.raises(ConfigError, match=r"needs huggingface_hub: pip install 'capsnet\[hub\]'"):
        load_pretrained("hf-hub:org/repo")
    line = _one_line(capsys, main(["predict", "--pretrained", "hf-hub:org/repo", str(tmp_path / "x.png")]))
    assert "pip install 'capsnet[hub]'" in line


# ---------------------------------------------------------------------------------------------- hostile references
MALFORMED = [
    "hf-hub:",
    "hf-hub:org",
    "hf-hub:org/",
    "hf-hub:/repo",
    "hf-hub:a/b/c",
    "hf-hub:org/re po",
    "hf-hub:org/repo@",
    "hf-hub:org/repo@a@b",
    "hf-hub:../repo",
    "hf-hub:org/..",
    "hf-hub:org/a--b",
    "hf-hub:org/repo.git",
    "hf-hub:org/" + "x" * 97,
    "hf-hub:org/repo@../../../etc/passwd",
    "hf-hub:org/repo@main/../../x",
    "hf-hub:org/repo@/abs",
    "hf-hub:org/repo@a\nb",
    "hf-hub:org/repo@%2e%2e",
    "hf-hub:org/repo@refs/heads/main.lock",
    "hf-hub:org/repo@" + "v" * 300,
    "hf-hub:org/répo",
]


@pytest.mark.parametrize("ref", MALFORMED)
def test_a_malformed_reference_is_refused_before_any_request(hub, ref, tmp_path):
    with pytest.raises(ConfigError) as caught:
        load_pretrained(ref)
    assert "\n" not in str(caught.value) and hub.requests == [] and not (tmp_path / "hf").exists()


def test_a_repository_that_lists_a_huge_file_list_is_refused_before_any_download(hub, model, tmp_path):
    hub.add_repo("org/huge", _files(model, tmp_path / "saved"), extra_listing=MAX_HUB_FILES + 5000)
    with pytest.raises(DownloadError, match=f"lists more than {MAX_HUB_FILES:,} files"):
        load_pretrained("hf-hub:org/huge")
    assert len(hub.sent("GET", "/tree/")) == MAX_HUB_FILES // 1000 + 1  # pages read up to the limit, no further
    assert not hub.sent("GET", "/resolve/") and not any((tmp_path / "hf").rglob("blobs/*"))


def test_a_config_or_card_that_lies_is_one_line_or_unread(hub, model, tmp_path):
    files = _files(model, tmp_path / "saved")
    meta = json.loads(files["config.json"])
    lying = {**files, "config.json": json.dumps({**meta, "config": {**meta["config"], "class_dim": 8}}).encode()}
    hub.add_repo("org/lies", lying)
    with pytest.raises(CheckpointError, match=r"weights do not match config\.json"):
        load_pretrained("hf-hub:org/lies")
    hub.add_repo("org/big", {**files, "config.json": b"{" + b" " * (2 << 20) + b"}"})
    with pytest.raises(CheckpointError, match=r"config.json is listed with 2,097,154 bytes.*CONFIG_FILE_BYTES"):
        load_pretrained("hf-hub:org/big")
    assert not hub.sent("GET", "org/big/resolve/")
    nan = {k: torch.full_like(v, float("nan")) for k, v in model.state_dict().items()}
    from safetensors.torch import save

    hub.add_repo("org/nan", {**files, "model.safetensors": save(nan)})
    with pytest.raises(CheckpointError, match="holds NaN or infinite values"):
        load_pretrained("hf-hub:org/nan")
    card = b"---\nlibrary_name: capsnet\nmodel-index: &a [*a]\n---\nclaims 100% accuracy\n"  # (not even YAML)
    hub.add_repo("org/card-lies", {**files, "README.md": card})
    assert _same(load_pretrained("hf-hub:org/card-lies"), model) and not hub.sent("GET", "README.md")
    other = {"model_type": "baseline-cnn", "config": {}, "capsnet_version": "0.1.0"}
    hub.add_repo("org/other", {**files, "config.json": json.dumps(other).encode()})
    with pytest.raises(CheckpointError, match=r"do not match config\.json"):
        create_model("baseline", pretrained="hf-hub:org/other")


@pytest.mark.slow
def test_hf_endpoint_and_hf_hub_offline_from_the_environment_on_the_command_line(hub, model, tmp_path):
    """The variables as a user sets them, read by huggingface_hub in a fresh process: HF_ENDPOINT, HF_HUB_CACHE,
    then HF_HUB_OFFLINE=1 with the loopback server gone from the picture (every request refused)."""
    from PIL import Image

    hub.add_repo("org/env", _files(model, tmp_path / "saved"))
    Image.new("L", (28, 28), 128).save(tmp_path / "x.png")
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(
        HF_ENDPOINT=hub.url,
        HF_HUB_CACHE=str(tmp_path / "env-cache"),
        HF_HUB_DISABLE_XET="1",
        HF_HOME=str(tmp_path / "hf-home"),
        CAPSNET_NO_EXT="1",
    )
    argv = [sys.executable, "-m", "capsnet", "predict", "--pretrained", "hf-hub:org/env", str(tmp_path / "x.png")]
    online = subprocess.run([*argv, "--json"], capture_output=True, text=True, env=env, timeout=120)
    assert online.returncode == 0 and '"name"' in online.stdout, online.stderr[-500:]
    hub.tokens.clear()
    hub.requests.clear()
    offline = subprocess.run(
        [*argv, "--json"], capture_output=True, text=True, env={**env, "HF_HUB_OFFLINE": "1"}, timeout=120
    )
    assert offline.returncode == 0 and offline.stdout == online.stdout and hub.requests == [], offline.stderr[-500:]
