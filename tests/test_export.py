"""Export (capsnet.models.export, `capsnet export`): every registered model traced once and written to ONNX, run
by onnxruntime, and to torch.export, against the PyTorch model within 1e-4 at batch sizes other than the one traced
(a dynamic batch axis); export_model itself (its check, report and atomic write) on CapsNet's routing options, the
opsets and the command line. Tiny configurations (test_api.TINY) keep it to seconds per model; a model registered
later is covered with its defaults."""

import json

import pytest
import torch
from helpers import small_config
from test_api import tiny

import capsnet
from capsnet import CapsNet, export_model
from capsnet.cli import main
from capsnet.errors import ConfigError, ExportError
from capsnet.models import export as ex
from capsnet.models.recipe import model_input
from capsnet.models.registry import MODELS
from capsnet.routing import backend, get_backend
from capsnet.routing.matrix_capsules import ConvCaps


def _reference(model, images):
    """The model's own outputs (its default, fast routing paths, its input recipe) for the exported ones."""
    with torch.no_grad():
        out = model.eval()(model_input(model, images))
    return [out.lengths] if out.capsules is None else [out.lengths, out.capsules]


def _raw(shape, seed):
    """Raw uint8 images, what the exported graph takes."""
    return torch.randint(0, 256, shape, generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)


# Two routing iterations rather than three for the iterative EM and VB routings: every step of their loop is still in
# the graph (an E-step between two M-steps), whose conversion unrolls the loop and takes a third less time.
FEWER_ITERATIONS = {"em-capsnet": {"routing_iterations": 2}, "vb-capsnet": {"routing_iterations": 2}}


@pytest.fixture(scope="module")
def traced():
    """Each registered model's tiny configuration and its torch.export program (`export_model`'s first step and the
    slow part of an export), traced once and shared by the ONNX and .pt2 tests of the model."""
    cache: dict[str, tuple] = {}

    def get(name: str) -> tuple:
        if name not in cache:
            model = (tiny(name) if name not in FEWER_ITERATIONS else tiny(name, **FEWER_ITERATIONS[name])).eval()
            cache[name] = (model, ex.export_program(model))
        return cache[name]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MODELS))
def test_onnx_runs_in_onnxruntime_like_the_model(name, tmp_path, traced):
    onnxruntime = pytest.importorskip("onnxruntime")
    onnx = pytest.importorskip("onnx")
    model, program = traced(name)
    names = list(ex.OUTPUT_NAMES[: len(program.graph_signature.user_outputs)])
    assert names == ["lengths", "capsules"][: len(_reference(model, _raw((1, 1, 28, 28), 0)))]  # (baseline: lengths)
    ex._write_onnx(model, program, tmp_path / "m.onnx", opset=ex.OPSET, names=names)  # export_model's ONNX step
    proto = onnx.load(str(tmp_path / "m.onnx"))
    assert [o.name for o in proto.graph.output] == names
    assert proto.graph.input[0].name == "images"
    for value in [*proto.graph.input, *proto.graph.output]:  # the dynamic axis is named as the report names it
        assert value.type.tensor_type.shape.dim[0].dim_param == "batch", value.name
    assert {i.domain or "ai.onnx": i.version for i in proto.opset_import}["ai.onnx"] == ex.OPSET
    meta = {p.key: p.value for p in proto.metadata_props}
    assert meta["capsnet.model_type"] == model.model_type and json.loads(meta["capsnet.config"])["n_classes"] == 10
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx"]  # one file: no external data
    session = onnxruntime.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"])
    for batch in (1, 5):  # the trace used 2 images
        images = _raw((batch, 1, 28, 28), batch)
        got = session.run(None, {"images": images.numpy()})
        want = _reference(model, images)
        assert len(got) == len(want)
        for g, w in zip(got, want):
            assert g.shape == tuple(w.shape)
            assert abs(torch.from_numpy(g) - w).max().item() <= 1e-4
        assert abs(torch.from_numpy(got[0]) - capsnet.predict(model, images).lengths).max().item() <= 1e-4  # front door


@pytest.mark.slow
@pytest.mark.parametrize(
    "options",
    [
        {"routing": "self-attention"},
        {"routing": "inverted-attention"},
        {"routing": "self-routing"},
        {"leaky_routing": True, "capsule_bias": True},
        {"detach_votes": True, "padding": "same", "image_size": (28, 24)},
    ],
    ids=["self-attention", "inverted-attention", "self-routing", "leaky-bias", "same-padding-28x24"],
)
def test_every_capsnet_routing_option_exports_to_onnx(options, tmp_path):
    """export_model's check runs the file in onnxruntime on 3 images (the trace used 2) against the model."""
    pytest.importorskip("onnxruntime")
    model = CapsNet(config=small_config(**options)).eval()
    info = export_model(model, tmp_path / "m.onnx")
    assert info["max_abs_diff"] <= 1e-4 and info["outputs"]["lengths"] == ["batch", 10]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MODELS))
def test_torch_export_program_loads_and_matches_the_model(name, tmp_path, traced):
    model, program = traced(name)
    regions = [n.target for n in program.graph.nodes if isinstance(n.target, torch._ops.HigherOrderOperator)]
    assert regions == []  # no autocast region: export runs without autocast (capsnet.routing.base.autocast_off)
    torch.export.save(program, tmp_path / "m.pt2")  # export_model's .pt2 step
    loaded = torch.export.load(tmp_path / "m.pt2").module()
    for batch in (1, 4):  # the trace used 2 images
        images = _raw((batch, 1, 28, 28), batch)
        with torch.no_grad():
            got = loaded(images)
        for g, w in zip(got, _reference(model, images), strict=True):
            assert g.shape == w.shape and abs(g - w).max().item() <= 1e-4


def test_export_runs_the_pure_pytorch_routing_and_restores_the_model(tmp_path):
    """The graph holds no capsnet custom operator (C++ kernel or fast path: no ONNX translation), and the model's
    mode and layers are as they were afterwards."""
    model = CapsNet(config=small_config()).train()
    model.class_caps.backend = "cpp"
    program = ex.export_program(model)
    assert model.training
    targets = {str(n.target) for n in program.graph.nodes if n.op == "call_function"}
    assert not [t for t in targets if "capsnet" in t], targets
    assert model.class_caps.fast and model.class_caps.backend == "cpp" and get_backend() == "auto"
    with ex.reference_routing(model):
        assert not model.class_caps.fast and model.class_caps.backend == "torch"
    assert [layer.backend for layer in backend.kernel_layers(model)] == ["cpp"]


def test_conv_caps_reference_path_matches_the_chunked_one():
    """ConvCaps.fast = False (the votes materialised, then em_routing: what export traces) gives the chunked
    result."""
    torch.manual_seed(0)
    layer = ConvCaps(3, 4, kernel_size=3, stride=2, iterations=3).eval()
    poses, acts = torch.randn(3, 7, 7, 3, 16), torch.rand(3, 7, 7, 3)
    fast = layer(poses, acts)
    layer.fast = False
    slow = layer(poses, acts)
    for a, b in zip(fast, slow, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_cli_exports_a_checkpoint_to_torch_export(tmp_path, capsys):
    CapsNet(config=small_config()).save_pretrained(tmp_path / "m")
    assert main(["export", "--checkpoint", str(tmp_path / "m"), "--out", str(tmp_path / "m.pt2")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(
        f"wrote {tmp_path / 'm.pt2'}: torch.export, input images [batch, 1, 28, 28] (batch dynamic)"
    )
    assert "outputs lengths [batch, 10], capsules [batch, 10, 6]" in out[0]
    assert out[1].startswith("checked: torch.export.load matches the PyTorch model within")
    assert (tmp_path / "m.pt2").is_file()


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--out", "m.onnx"], "one of the arguments --checkpoint --pretrained is required"),
        (["--checkpoint", "CKPT", "--out", "m.txt"], "give a .onnx or .pt2 file name"),
        (["--checkpoint", "/no/such/run", "--out", "m.onnx"], "no such checkpoint"),
        (["--pretrained", "capsnet:nope", "--out", "m.onnx"], "no shipped weights 'nope' for capsnet"),
        (["--pretrained", "nope:tag", "--out", "m.onnx"], "unknown model 'nope'"),
    ],
)
def test_cli_export_refuses_bad_input_in_one_line(argv, message, tmp_path, capsys):
    CapsNet(config=small_config()).save_pretrained(tmp_path / "m")
    argv = [str(tmp_path / "m") if a == "CKPT" else a for a in argv]
    try:
        code = main(["export", *argv])
    except SystemExit as e:  # a usage error, from the parser
        code = e.code
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_onnx_without_its_packages_says_what_to_install(tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # an import of it fails
    with pytest.raises(ExportError, match=r"needs onnxruntime: pip install 'capsnet\[export\]' \(or pass --no-check"):
        export_model(CapsNet(config=small_config()), tmp_path / "m.onnx")
    monkeypatch.setitem(sys.modules, "onnxscript", None)
    with pytest.raises(ExportError, match=r"needs onnx and onnxscript: pip install 'capsnet\[export\]'"):
        export_model(CapsNet(config=small_config()), tmp_path / "m.onnx", check=False)
    assert not list(tmp_path.iterdir())  # nothing written


def test_a_model_that_cannot_be_traced_is_named_in_the_error(tmp_path):
    class Branchy(CapsNet):
        def forward(self, images, labels=None, **kw):
            if images.sum() > 0:  # data-dependent control flow: not traceable for any input
                images = images * 2
            return super().forward(images, labels, **kw)

    with pytest.raises(ExportError, match="Branchy cannot be exported"):
        export_model(Branchy(config=small_config()), tmp_path / "m.pt2")
    with pytest.raises(ConfigError, match=r"give a \.onnx or \.pt2"):
        export_model(CapsNet(config=small_config()), tmp_path / "m.tflite")


def test_opsets_older_than_the_default_are_written_and_impossible_ones_refused(tmp_path):
    pytest.importorskip("onnxruntime")
    model = tiny("baseline")
    for opset in (ex.MIN_OPSET, 17):
        info = export_model(model, tmp_path / f"m{opset}.onnx", opset=opset)
        assert info["format"] == "ONNX" and info["opset"] == opset and info["max_abs_diff"] <= ex.ATOL
        assert info["outputs"] == {"lengths": ["batch", 10]} and info["path"] == str(tmp_path / f"m{opset}.onnx")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted({f"m{ex.MIN_OPSET}.onnx", "m17.onnx"})  # no temporary
    for opset in (0, ex.MIN_OPSET - 1, 10_000):
        with pytest.raises(ConfigError, match=rf"opset {opset}: the installed onnx writes opsets {ex.MIN_OPSET} to"):
            export_model(model, tmp_path / "bad.onnx", opset=opset)
    assert not (tmp_path / "bad.onnx").exists()
