"""`pretrained=` the URL of a published save_pretrained folder (`URL#sha256=HEX`, HEX the SHA-256 of its manifest,
capsnet.models.hub.folder_sha256): downloaded with capsnet.fetch.fetch_url into the cache, checked, and loaded;
tested against a loopback server (tests/faulty_server.py), never the network."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch
from faulty_server import FaultyServer
from helpers import small_config

from capsnet import CapsNet, create_model, load_pretrained
from capsnet import fetch as fetch_module
from capsnet.cli import main
from capsnet.errors import CheckpointError, ConfigError, DownloadError
from capsnet.models.hub import folder_sha256


@pytest.fixture
def published(tmp_path, monkeypatch):
    """A save_pretrained folder served at /models/small/, and an empty cache ($CAPSNET_DATA)."""
    monkeypatch.setenv("CAPSNET_DATA", str(tmp_path / "cache"))
    model = CapsNet(config=small_config(class_names=tuple("abcdefghij"), digits=False))
    folder = model.save_pretrained(tmp_path / "small")
    files = {name: (folder / name).read_bytes() for name in ("config.json", "model.safetensors")}
    with FaultyServer() as server:
        yield server, files, model


def _pin(files) -> str:
    """`sha256sum config.json model.safetensors | sha256sum`, computed here from its definition."""
    manifest = "".join(f"{hashlib.sha256(files[n]).hexdigest()}  {n}\n" for n in ("config.json", "model.safetensors"))
    return hashlib.sha256(manifest.encode()).hexdigest()


def _url(server, files, *plan: str, path: str = "models/small", pinned=None) -> str:
    for name, body in files.items():
        server.serve(f"{path}/{name}", body, *(plan if name == "model.safetensors" else ()))
    return f"{server.url}{path}#sha256={_pin(pinned or files)}"


def _same(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_create_model_from_a_url_downloads_once_into_the_cache(published, tmp_path):
    server, files, model = published
    url = _url(server, files)
    loaded = create_model("capsnet", pretrained=url)
    assert _same(loaded, model) and not loaded.training and loaded.config.class_names == tuple("abcdefghij")
    sha = url.rsplit("=", 1)[1]
    cached = tmp_path / "cache" / "pretrained" / sha
    assert sha == folder_sha256(tmp_path / "small")
    assert sorted(p.name for p in cached.iterdir() if not p.name.endswith(".lock")) == [
        "config.json",
        "model.safetensors",
    ]
    assert server.counts == {"/models/small/model.safetensors": 1, "/models/small/config.json": 1}
    slash = url.replace("small#", "small/#")  # (the folder's URL with a trailing slash names the same folder)
    assert _same(load_pretrained(url), model) and _same(create_model("capsnet", pretrained=slash), model)
    assert server.counts["/models/small/model.safetensors"] == 1  # the cached copy, its SHA-256 checked again
    with pytest.raises(CheckpointError, match="holds a 'capsnet' model, not a BaselineCNN"):
        create_model("baseline", pretrained=url)


def test_a_cut_download_is_retried(published, monkeypatch):
    server, files, model = published
    monkeypatch.setattr(fetch_module.time, "sleep", lambda s: None)  # (no back-off wait between the tries)
    assert _same(create_model("capsnet", pretrained=_url(server, files, "truncate", "ok")), model)
    assert server.counts["/models/small/model.safetensors"] == 2


def test_weights_that_do_not_have_the_sha256_are_refused_and_not_kept(published, tmp_path):
    server, files, _ = published
    url = _url(server, files, "wrong")
    with pytest.raises(DownloadError, match=r"files served have SHA-256 [0-9a-f]{64}, not the URL's") as caught:
        create_model("capsnet", pretrained=url)
    assert "\n" not in str(caught.value)
    assert not any((tmp_path / "cache").rglob("*.*"))  # no file, no temporary folder, no lock


def test_an_altered_config_with_the_true_weights_is_refused_and_not_cached(published, tmp_path):
    server, files, _ = published
    meta = json.loads(files["config.json"])
    meta["config"]["class_names"] = ["attacker", *meta["config"]["class_names"][1:]]
    url = _url(server, {**files, "config.json": json.dumps(meta).encode()}, pinned=files)
    with pytest.raises(DownloadError, match=r"not the URL's \(config.json or the weights differ\)"):
        create_model("capsnet", pretrained=url)
    assert not any((tmp_path / "cache").rglob("*.*"))
    _url(server, files)  # the honest server: the same URL now loads the true folder (nothing was cached)
    assert create_model("capsnet", pretrained=url).config.class_names == tuple("abcdefghij")


def test_a_url_pinning_the_weights_alone_is_told_what_to_give(published, tmp_path):
    server, files, _ = published
    _url(server, files)
    url = f"{server.url}models/small#sha256={hashlib.sha256(files['model.safetensors']).hexdigest()}"
    with pytest.raises(DownloadError, match=r"SHA-256 of model.safetensors alone; a URL pins the whole folder"):
        create_model("capsnet", pretrained=url)


def test_a_trickling_or_endless_download_ends_with_one_line_and_leaves_nothing(published, tmp_path, monkeypatch):
    server, files, _ = published
    monkeypatch.setattr("capsnet.models.hub.CONFIG_DOWNLOAD_DEADLINE_S", 1.0)
    server.serve("slow/config.json", files["config.json"], "trickle")
    with pytest.raises(DownloadError, match="not done within its deadline"):
        create_model("capsnet", pretrained=f"{server.url}slow#sha256={_pin(files)}")
    monkeypatch.setattr("capsnet.models.hub.MAX_CONFIG_DOWNLOAD_BYTES", 1 << 20)
    server.serve("endless/config.json", b"", "endless")
    with pytest.raises(DownloadError, match=f"past the limit of {1 << 20:,} bytes"):
        create_model("capsnet", pretrained=f"{server.url}endless#sha256={_pin(files)}")
    server.serve("big/config.json", bytes(2 << 20))
    with pytest.raises(DownloadError, match=f"announces {2 << 20:,} bytes, more than the limit"):
        create_model("capsnet", pretrained=f"{server.url}big#sha256={_pin(files)}")
    assert not any((tmp_path / "cache").rglob("*.*"))


def test_a_url_without_its_sha256_is_refused_before_any_request(published):
    server, files, _ = published
    url = _url(server, files).split("#")[0]
    for bad in (url, url + "#sha256=abc", url + "#md5=" + "0" * 32):
        with pytest.raises(ConfigError, match=r"give the folder's SHA-256 in the URL"):
            create_model("capsnet", pretrained=bad)
    assert server.counts == {}


def test_a_config_that_is_not_one_is_refused_and_not_kept(published, tmp_path):
    server, files, _ = published
    url = _url(server, {**files, "config.json": b"<html>a login page</html>"})
    with pytest.raises(CheckpointError, match=r"models/small/config.json: not the config.json of a save_pretrained"):
        create_model("capsnet", pretrained=url)
    assert not list((tmp_path / "cache").rglob("config.json"))


def test_the_command_line_takes_a_url_for_pretrained(published, tmp_path, capsys):
    from PIL import Image

    server, files, _ = published
    Image.new("L", (28, 28), 128).save(tmp_path / "x.png")
    url = _url(server, files)
    assert main(["predict", "--pretrained", url, str(tmp_path / "x.png"), "--json"]) == 0
    assert '"name": ' in capsys.readouterr().out
    server.serve("other/config.json", b"\0" * 8, "404")
    assert main(["predict", "--pretrained", f"{server.url}other#sha256={'0' * 64}", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "HTTP 404" in err[0] and "other/config.json" in err[0]


def test_a_folder_served_wrong_once_is_fetched_again_and_loads(published, tmp_path):
    """A transient fault of the right length (wrong bytes once, then the true ones) is not a broken pin: the folder
    is fetched once more, from scratch, and loads."""
    server, files, model = published
    assert _same(create_model("capsnet", pretrained=_url(server, files, "wrong", "ok")), model)
    assert server.counts["/models/small/model.safetensors"] == 2 and server.counts["/models/small/config.json"] == 2
    assert sorted(p.name for p in (tmp_path / "cache" / "pretrained").iterdir()) == [_pin(files)]


def test_a_pin_that_fails_on_every_fetch_is_broken_after_two_and_keeps_nothing(published, tmp_path):
    server, files, _ = published
    url = _url(server, files, "wrong")
    with pytest.raises(DownloadError, match=r"not the URL's .*\(fetched 2 times\); nothing was kept"):
        create_model("capsnet", pretrained=url)
    assert server.counts["/models/small/model.safetensors"] == 2
    assert not any((tmp_path / "cache").rglob("*.*"))
