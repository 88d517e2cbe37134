# make test  — set up .venv if needed, lint, run the test suite
# make demo  — set up .venv if needed, run the demo
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: setup test lint demo bench clean

setup: $(STAMP)

# torch first, pinned: an open range would make pip fetch a multi-GB CUDA build.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

lint: setup
	$(VENV)/bin/ruff check src tests $(wildcard benchmarks examples)

test: setup lint
	$(VENV)/bin/pytest -q

demo: setup
	$(PY) benchmarks/pipeline.py --quick

bench: setup
	$(PY) benchmarks/pipeline.py

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
