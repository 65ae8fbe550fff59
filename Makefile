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

# Optional system packages for tests that skip without them: a local Slurm (tests/test_slurm.py)
# and Open MPI (tests/test_mpi.py). Installed where we may (root with apt), else a note.
TEST_SYSTEM_PACKAGES ?= slurm-wlm munge openmpi-bin libopenmpi-dev

.PHONY: venv train test test-fast test-gpu clean test-system-packages

venv: $(STAMP)

$(STAMP): setup.py
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@# pip byte-compiles one file at a time (~30 s of the venv's minute); compileall below does it on every core.
	@# Without the .pyc files every process would compile what it imports, where PYTHONDONTWRITEBYTECODE is set.
	$(PY) -m pip install -q --no-compile "$(TORCH_SPEC)"
	$(PY) -c "import torch; print('torch==' + torch.__version__.split('+')[0])" > $(VENV)/constraints.txt
	DS_BUILD_OPS=0 $(PY) -m pip install -q --no-compile -c $(VENV)/constraints.txt -e ".[dev]"
	@# a few files of some packages are not Python 3 and fail here, as pip's own compile skips them
	$(PY) -m compileall -q -j 0 $(VENV)/lib > /dev/null 2>&1 || true
	@# NVMe offload (ZeRO-Infinity) needs libaio; install it where we may (root with apt), else its test skips.
	@dpkg -s libaio-dev >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
		(apt-get update -qq && apt-get install -y -qq libaio-dev >/dev/null) || echo "note: libaio-dev not installed; NVMe offload unavailable"; }
	touch $(STAMP)

train: venv
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-2} PATH=$(abspath $(VENV))/bin:$$PATH deepspeed scripts/pretrain.py --deepspeed_config ds_configs/zero1.json

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
	@# Byte-compile the project once: many tests start fresh interpreters (launchers, ranks), and where
	@# PYTHONDONTWRITEBYTECODE is set each of them would compile it again (~0.3 s of CPU a process).
	$(PY) -m compileall -q -j 0 hybridlm scripts tests benchmarks > /dev/null
	PATH=$(abspath $(VENV))/bin:$$PATH $(PY) -m pytest -n $(PYTEST_WORKERS) --dist loadfile --durations=25

test-fast: venv test-system-packages
	PATH=$(abspath $(VENV))/bin:$$PATH $(PY) -m pytest -m "not slow"

# The GPU suite on the GPU machine, in shards that each finish within 8 minutes on four GPUs (tests/gpu_shards.py):
#   make test-gpu SHARD=1/4 RECORD=$$OUT     (its own Python: the GPU machine has torch; DeepSpeed from .device/)
# RECORD: a folder for the shard's gpu-tests record (python -m benchmarks render --add FOLDER/records.jsonl).
# One-GPU tests run four at once on four GPUs, two-GPU tests in two lanes of two (tests/gpu_suite.py); LANES=1: one at a time.
test-gpu:
	$(PYTHON) tests/gpu_suite.py $(if $(SHARD),--shard=$(SHARD)) $(if $(RECORD),--record=$(RECORD)) $(if $(LANES),--lanes=$(LANES))

clean:
	rm -rf $(VENV) .pytest_cache
