# Two commands do all set-up on a fresh machine:
#   make train   builds .venv and runs the built-in default training run (tiny model, CPU, ~1 min)
#   make test    builds .venv and runs the test suite (what .ci/run calls)
# TORCH_SPEC is installed first so that deepspeed's plain `torch` requirement is already met
# (on these machines a CPU wheel of torch 2.13.0 is on disk; on a GPU box pick your CUDA build).
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.hybridlm-installed
# How the targets run a command: the venv's bin first on PATH (launchers, ranks), and Python left to write the .pyc
# of each module it imports, once, for every later process; where PYTHONDONTWRITEBYTECODE is set, each of the
# suite's hundreds of interpreters (launchers, ranks) would otherwise compile all it imports again.
RUN = env -u PYTHONDONTWRITEBYTECODE PATH=$(abspath $(VENV))/bin:$$PATH

# Optional system packages for tests that skip without them: a local Slurm (tests/test_slurm.py)
# and Open MPI (tests/test_mpi.py). Installed where we may (root with apt), else a note.
TEST_SYSTEM_PACKAGES ?= slurm-wlm munge openmpi-bin libopenmpi-dev

.PHONY: venv train test test-fast test-gpu clean test-system-packages

venv: $(STAMP)

$(STAMP): setup.py
	@# The venv gets its pip from the system's pip where there is one (pip >= 22.3 installs into another Python with
	@# --python): ensurepip's own copy, upgraded at once, took ~7 s of the set-up. Else ensurepip, as venv does.
	$(PYTHON) -m pip --version >/dev/null 2>&1 && $(PYTHON) -m venv --without-pip $(VENV) && \
		$(PYTHON) -m pip --python $(PY) install -q --upgrade pip || \
		{ $(PYTHON) -m venv $(VENV) && $(PY) -m pip install -q --upgrade pip; }
	@# No byte-compiling at install (pip's, one file at a time, was ~30 s of the venv's minute; compileall of all of
	@# torch, transformers and sympy 26 s on 2 cores): Python writes the .pyc of what is imported, once (see RUN).
	$(PY) -m pip install -q --no-compile "$(TORCH_SPEC)"
	@# the installed version from pip's metadata (importing torch only to read it took 6 s of the set-up)
	$(PY) -c "from importlib.metadata import version; print('torch==' + version('torch').split('+')[0])" > $(VENV)/constraints.txt
	DS_BUILD_OPS=0 $(PY) -m pip install -q --no-compile -c $(VENV)/constraints.txt -e ".[dev]"
	@# NVMe offload (ZeRO-Infinity) needs libaio; install it where we may (root with apt), else its test skips.
	@dpkg -s libaio-dev >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
		(apt-get update -qq && apt-get install -y -qq libaio-dev >/dev/null) || echo "note: libaio-dev not installed; NVMe offload unavailable"; }
	touch $(STAMP)

train: venv
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-2} $(RUN) deepspeed scripts/pretrain.py --deepspeed_config ds_configs/zero1.json

test-system-packages:
	@missing=$$(for p in $(TEST_SYSTEM_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	if [ -n "$$missing" ]; then \
		if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
			(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null) || \
				echo "note: could not install" $$missing "; their tests skip"; \
		else echo "note: not installed:" $$missing "(their tests skip)"; fi; \
	fi

# Two pytest-xdist workers, a test file each at a time (a file's module fixtures built once): the suite left one of
# CI's two cores idle about half the time (launches, imports, single-process tests); multi-rank tests share both.
PYTEST_WORKERS ?= 2

test: venv test-system-packages
	$(RUN) $(PY) -m pytest -n $(PYTEST_WORKERS) --dist loadfile --durations=25

test-fast: venv test-system-packages
	$(RUN) $(PY) -m pytest -m "not slow"

# The GPU suite on the GPU machine, in shards that each finish within 8 minutes on four GPUs (tests/gpu_shards.py):
#   make test-gpu SHARD=1/4 RECORD=$$OUT     (its own Python: the GPU machine has torch; DeepSpeed from .device/)
# RECORD: a folder for the shard's gpu-tests record (python -m benchmarks render --add FOLDER/records.jsonl).
# One-GPU tests run four at once on four GPUs, two-GPU tests in two lanes of two (tests/gpu_suite.py); LANES=1: one at a time.
test-gpu:
	$(PYTHON) tests/gpu_suite.py $(if $(SHARD),--shard=$(SHARD)) $(if $(RECORD),--record=$(RECORD)) $(if $(LANES),--lanes=$(LANES))

clean:
	rm -rf $(VENV) .pytest_cache
