"""Start-up stays light: `import capsnet` and its public API load no torch._dynamo, and the command line's parser
(every subcommand's flags and help) builds with torch blocked from import. Each check runs in a fresh interpreter,
since this one has long imported everything."""

import subprocess
import sys
import textwrap

import pytest

# A meta-path finder that refuses torch (and every torch.* module): whatever imports it fails loudly.
BLOCK_TORCH = textwrap.dedent(
    """
    import sys

    class BlockTorch:
        def find_spec(self, name, path=None, target=None):
            if name == "torch" or name.startswith("torch."):
                raise ImportError(f"blocked: {name}")
            return None

    sys.meta_path.insert(0, BlockTorch())
    """
)


def run_python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_the_public_api_loads_without_dynamo_or_the_heavy_extras():
    heavy = ["torch._dynamo", "torch.utils.cpp_extension", "matplotlib", "onnx", "onnxruntime", "PIL"]
    done = run_python(
        "import sys, capsnet\n"
        "assert 'torch' not in sys.modules, 'import capsnet imported torch'\n"
        "for name in capsnet.__all__:\n"
        "    getattr(capsnet, name)\n"
        f"print([m for m in {heavy!r} if m in sys.modules])\n"
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_loading_the_shipped_digit_model_loads_no_dynamo():
    """Its size check counts parameters on the meta device, where normal_ would import torch._dynamo (1.5 s)."""
    done = run_python(
        "import sys, capsnet\n"
        "model = capsnet.create_model('capsnet', pretrained='mnist-sample')\n"
        "print(type(model).__name__, 'torch._dynamo' in sys.modules)\n"
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "CapsNet False"


def test_the_torch_blocker_blocks():
    done = run_python(BLOCK_TORCH + "import capsnet\ncapsnet.CapsNet\n")
    assert done.returncode != 0 and "blocked: torch" in done.stderr


# Subcommands whose flags come from torch modules (the export tolerances, the converters' and the experiments'
# options): their own --help imports torch; `capsnet --help` lists them without.
NEEDS_TORCH = {"convert", "export", "reproduce"}


def test_the_parser_builds_with_torch_blocked():
    code = BLOCK_TORCH + textwrap.dedent(
        f"""
        import contextlib, io
        from capsnet.cli import COMMANDS, build_parser

        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
            build_parser(["--help"]).parse_args(["--help"])
        assert all(name in out.getvalue() for name, _ in COMMANDS)
        for command in [c for c, _ in COMMANDS if c not in {NEEDS_TORCH!r}]:
            out = io.StringIO()
            with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
                build_parser([command, "--help"]).parse_args([command, "--help"])
            assert "usage: capsnet " + command in out.getvalue(), command
        print(len(COMMANDS) - len({NEEDS_TORCH!r}))
        """
    )
    done = run_python(code)
    assert done.returncode == 0, done.stderr[-2000:]
    assert int(done.stdout) >= 7


@pytest.mark.parametrize("argv", [["--help"], ["train", "--help"], ["models", "--help"]])
def test_help_from_the_command_line_imports_no_torch(argv):
    done = run_python(BLOCK_TORCH + f"import sys\nsys.argv = ['capsnet', *{argv!r}]\nimport runpy\n"
                      "runpy.run_module('capsnet', run_name='__main__')\n")  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("usage: capsnet")
