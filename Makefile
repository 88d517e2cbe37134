# make test  — set up .venv if needed, install the system packages the launcher tests use (as root), lint, run the test suite
# make demo  — set up .venv if needed, train the digits demo on two workers
# Both install the `dev` extra, which includes `all` (plots, TensorBoard, scikit-learn for the demo's data).
# make bench — the benchmarks (input pipeline, all-reduce, parameter-server transport and training, pipeline parallelism,
#              multi-host transports and training, the data service on namespace hosts, the scaling model's
#              validation, and the CIFAR-10 case study's figures in runs/case_study/)
# make fuzz  — every fuzz target for FUZZ_SECONDS each (make test runs them for 3 s each)
# make dist  — build the wheel into dist/ (pip install dist/conveyor-*.whl), offline: the venv's setuptools
# make gpu-wheels — here, with a network: the wheels a GPU machine needs (GPU_NEEDS, cp312 manylinux x86-64) and
#              conveyor's own, into GPU_WHEELS (git-ignored); make gpu-check — on the GPU machine, offline:
#              every CUDA path, reports in GPU_OUT (scripts/gpu_check.py; README, "On a GPU")
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: setup sysdeps test lint demo bench fuzz dist clean gpu-wheels gpu-check
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

# One pytest process by default. TEST_WORKERS=N (or auto) runs two passes instead (docs/testing.md): every test not
# marked `serial` on N pytest-xdist workers (each with its own ports: tests/conftest.py; all tests of a file on one
# worker, so a module fixture is built once), then the `serial` ones alone (exit status 5, no test marked serial,
# is no failure); the second pass runs even when the first fails. Serial stays the default until five parallel
# runs in a row and one under load have passed (issue #22).
TEST_WORKERS ?= 0
# compileall first: where PYTHONDONTWRITEBYTECODE is set, every process a test starts would otherwise compile each
# conveyor module it imports whose .pyc is missing or older than its source (after a merge; up to 0.4 CPU-s a task).
test: setup sysdeps lint
	@$(PY) -m compileall -q src; \
	if [ "$(TEST_WORKERS)" = 0 ]; then $(VENV)/bin/pytest -q; exit $$?; fi; \
	status=0; \
	$(VENV)/bin/pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not serial" || status=$$?; \
	$(VENV)/bin/pytest -q -m serial || { rc=$$?; [ $$rc -eq 5 ] || status=$$rc; }; \
	exit $$status

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
	$(PY) benchmarks/sharded.py
	$(PY) benchmarks/scaling_model.py
	$(PY) benchmarks/hosts.py
	$(PY) benchmarks/data_service.py
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

# conveyor's requirements that the GPU image lacks: pyzmq, google-crc32c and cryptography (msgpack too, by the
# issue; the image's own list has it, and carrying it costs 0.4 MB); pip adds their own needs (cffi, pycparser).
GPU_NEEDS  ?= pyzmq google-crc32c msgpack cryptography
GPU_WHEELS ?= .gpu-wheels
GPU_OUT    ?= runs/gpu-check
GPU_PYTHON ?= python3
GPU_PLATFORMS := $(foreach p,manylinux2014_x86_64 manylinux_2_17_x86_64 manylinux_2_28_x86_64 manylinux_2_34_x86_64,--platform $(p))

gpu-wheels: setup
	rm -rf $(GPU_WHEELS)  # one version of each: pip refuses two wheels of one name
	$(PY) -m pip download --quiet --only-binary=:all: $(GPU_PLATFORMS) --python-version 3.12 --implementation cp \
	  --abi cp312 --abi abi3 --abi none -d $(GPU_WHEELS) $(GPU_NEEDS)
	$(PY) -m pip wheel --quiet --no-deps --no-build-isolation -w $(GPU_WHEELS) .
	du -sh $(GPU_WHEELS)

gpu-check:
	$(GPU_PYTHON) scripts/gpu_check.py --wheels $(GPU_WHEELS) --out $(GPU_OUT) $(GPU_CHECK_ARGS)

clean:
	rm -rf $(VENV) build dist *.egg-info src/*.egg-info
