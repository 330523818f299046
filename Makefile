# `make test` and `make demo` each set up everything on a fresh machine.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: test test-tooling check demo lint types pytest bench docs gpu-check gpu-session clean

$(PY):
	$(PYTHON) -m venv $(VENV)

# pip installs torch (the CPU wheel constraints.txt pins, which pip's configuration may point at) and uv; uv installs
# the rest, the same versions, in parallel (the extras: 8 s against pip's 21 s, uv's cache empty), and pip does it
# where uv cannot reach an index. Neither byte-compiles (the install in 40% of the time): Python compiles each module
# on its first import and keeps it, even where the shell says not to (PYTHONDONTWRITEBYTECODE).
export PYTHONDONTWRITEBYTECODE :=
$(STAMP): $(PY) pyproject.toml constraints.txt
	$(PY) -m pip install -q --no-compile torch==2.13.0 uv -c constraints.txt
	$(VENV)/bin/uv pip install -q --python $(PY) -c constraints.txt -e '.[dev]' \
		|| $(PY) -m pip install -q --no-compile -c constraints.txt -e '.[dev]'
	touch $(STAMP)

# pytest-xdist: a worker per core (at most 4), each computing on one thread; a test module's tests stay on one
# worker, so that its module fixtures are built once, but for a few (tests/conftest.py, SPREAD).
XDIST := -n auto --maxprocesses 4 --dist loadscope

# The library's whole suite: lint, types, every test but the tooling ones (the slow ones too: kernel builds,
# trainings, torchrun, CLI subprocesses), the 30 slowest, and the docs site. mypy and the docs site, one process
# each, run beside pytest (about 9 s sooner on 2 cores); mypy prints its findings as one block when it ends.
test: lint
	$(MAKE) -j3 --no-print-directory types pytest docs

types: $(STAMP)
	$(PY) -m mypy

pytest: $(STAMP)
	$(PY) -m pytest -q $(XDIST) --durations=30 -m "not tooling"

# The checks of the project's tooling rather than the library: the notebook, the browser test of `capsnet explore`,
# the wheel build, the benchmark scripts, the GPU session script. CI (.ci/run) runs them after `make test`.
test-tooling: $(STAMP)
	$(PY) -m pytest -q $(XDIST) -m tooling

# The docs site (site/): docs/ plus the README as its front page, the API reference from the docstrings
# (mkdocstrings); --strict fails on a broken link or a missing reference.
docs: $(STAMP)
	sed 's#](docs/#](#g' README.md > docs/index.md
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet

# The fast loop: lint, types, the tests marked neither slow nor tooling (no C++ build: the PyTorch routing path).
check: lint types
	$(PY) -m pytest -q $(XDIST) -m "not slow and not tooling"

demo: $(STAMP)
	$(PY) -m capsnet demo

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

bench: $(STAMP)
	$(PY) benchmarks/bench_routing.py

# On a machine with one CUDA GPU: CUDA tests, epoch timings vs the labml loop, a Fashion-MNIST run (< 8 min);
# writes gpu_check/gpu_check.json and gpu_check/gpu_check.md.
gpu-check: $(STAMP)
	$(PY) benchmarks/gpu_check.py --out gpu_check

# A lent GPU machine's first command, from the source tree with its own python3 (no install): the check with the
# training-step profile, graphs and Triton kernels, then the Fashion-MNIST rows results/ lacks (when .gpu-data holds
# the data), in 9.3 minutes; writes gpu_session/ (docs/benchmarks.md#gpu).
gpu-session:
	bash benchmarks/gpu_session.sh gpu_session

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache .mypy_cache
