# make test  — set up .venv if needed, install the system packages the launcher tests use (as root), lint, run the test suite
# make demo  — set up .venv if needed, train the digits demo on two workers
# Both install the `dev` extra, which includes `all` (plots, TensorBoard, scikit-learn for the demo's data).
# make bench — the benchmarks (input pipeline, all-reduce, parameter-server transport and training, pipeline parallelism,
#              multi-host transports and training, the scaling model's validation, and the CIFAR-10 case
#              study's figures in runs/case_study/)
# make fuzz  — every fuzz target for FUZZ_SECONDS each (make test runs them for 3 s each)
# make dist  — build the wheel into dist/ (pip install dist/conveyor-*.whl), offline: the venv's setuptools
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: setup sysdeps test lint demo bench fuzz dist clean
FUZZ_SECONDS ?= 120

setup: $(STAMP)

# torch first, pinned: an open range would make pip fetch a multi-GB CUDA build.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

# Open MPI, Slurm and munge (apt-get, root only) and mpi4py for the tests that run real launchers;
# only what is missing, and nothing without root: those tests then skip (scripts/system-deps.sh).
sysdeps: setup
	sh scripts/system-deps.sh $(PY)

lint: setup
	$(VENV)/bin/ruff check src tests $(wildcard benchmarks examples)

test: setup sysdeps lint
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
	$(PY) benchmarks/data_state.py
	$(PY) benchmarks/pipeline_parallel.py
	$(PY) benchmarks/scaling_model.py
	$(PY) benchmarks/hosts.py
	$(PY) benchmarks/case_study.py    # last: its strategies table reads the JSON the ones above wrote

# One JSON report per target in runs/fuzz/; stops at the first target with a finding.
fuzz: setup
	for t in tests/fuzz/targets/*.py; do \
	  $(PY) tests/fuzz/runner.py $$t --seconds $(FUZZ_SECONDS) --json runs/fuzz/$$(basename $$t .py).json || exit 1; \
	done

# No build isolation: the `dev` extra's setuptools builds it, so no index is asked (tests/test_dist.py too).
dist: setup
	$(PY) -m pip wheel --quiet --no-deps --no-build-isolation --wheel-dir dist .
	@ls dist/conveyor-*.whl

clean:
	rm -rf $(VENV) build dist *.egg-info src/*.egg-info
