# `make test` and `make demo` each set up everything on a fresh machine.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: test demo lint bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(PY) pyproject.toml constraints.txt
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0 -c constraints.txt
	$(PY) -m pip install -q -c constraints.txt -e '.[dev]'
	touch $(STAMP)

test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q

demo: $(STAMP)
	$(PY) -m capsnet demo

lint: $(STAMP)
	$(VENV)/bin/ruff check .

bench: $(STAMP)
	$(PY) benchmarks/bench_routing.py

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache
