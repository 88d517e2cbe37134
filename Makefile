# make test  — set up .venv if needed, lint, run the test suite
# make demo  — set up .venv if needed, train the digits demo on two workers
# Both install the `dev` extra, which includes `all` (plots, TensorBoard, scikit-learn for the demo's data).
# make bench — the benchmarks (input pipeline, all-reduce, parameter-server transport and training)
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

# Two workers train on scikit-learn's bundled digits (written as TFRecord shards on first use).
demo: setup
	rm -rf runs/demo
	$(VENV)/bin/conveyor run -n 2 --data-dir data --output-dir runs/demo examples/digits/train.py --epochs 20

bench: setup
	$(PY) benchmarks/pipeline.py
	$(PY) benchmarks/allreduce.py
	$(PY) benchmarks/ps.py
	$(PY) benchmarks/ps_training.py

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
