"""Test-session set-up: CPU DeepSpeed, one thread per rank, and the repo importable."""
import os
import subprocess
import sys

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_MODE", "offline")
# Inductor compiles a graph's kernels in one process instead of starting a pool of compile workers first: on a
# two-core machine the pool's start-up cost more than it saved (~8 s over the suite's cold compiles).
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
# Inductor takes the SIMD instruction sets the CPU reports instead of first compiling and running a probe program for
# each (AVX2, AVX-512, its BF16 and VNNI parts, AMX: 11 builds, ~20 s of a cold cache's CPU before the first kernel);
# it then picks the same set, the best one the CPU has. The kernels are vectorised as users' are.
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "1")
# One cache of JIT-built ops (DeepSpeed's NVMe ops, the project's fused CPU op) per checkout, in its git-ignored .cache/:
# a cache shared by every checkout on the machine let one venv's build overwrite another's, and a build killed in one
# checkout left torch's lock file and an empty library that hung, then failed, the next checkout's suite.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                                           ".cache", "torch_extensions"))
# Inductor's kernels likewise in the checkout's .cache/: a fresh clone compiles them as a fresh CI machine does (a cache
# shared by the machine's checkouts, /tmp/torchinductor_<user>, made local runs of the suite ~50 s faster than CI's).
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                                              ".cache", "torchinductor"))
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]

import gpu_shards  # noqa: E402

# A pytest-xdist worker of a laned GPU run (tests/gpu_suite.py) sees its own GPUs only: before torch is imported.
gpu_shards.pin_lane()

import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # on the GPU machine DeepSpeed must pick CUDA


def _import_for_forked_ranks() -> None:
    """Import the heavy libraries once in the process that runs tests: ranks forked from it inherit them (see
    harness.py). Called where tests are collected, so not in pytest-xdist's controller, which runs none: there these
    imports were ~5 s of one core before any worker started."""
    import deepspeed  # noqa: F401

    import hybridlm.training.trainer  # noqa: F401
    # deepspeed.initialize imports this module under ZeRO, and its module-level torch.compile imports torch._inductor
    # (~3 s of CPU): once here, not once in every forked rank of every test.
    import deepspeed.runtime.zero.muon.muon_optimizer  # noqa: F401


def pytest_addoption(parser):
    parser.addoption("--shard", default=None, metavar="K/N", help="run the K-th of N shards, packed by measured duration "
                     "(tests/gpu_shards.py; for the GPU suite: pytest -m gpu --shard 1/4)")
    parser.addoption("--gpu-record", default=None, metavar="DIR", help="append this run's gpu-tests record to "
                     "DIR/records.jsonl (file it with python -m benchmarks render --add)")
    parser.addoption("--gpu-pass", default=None, choices=gpu_shards.PASSES, help="keep the tests that need one GPU "
                     "(lanes1), two (lanes2) or more (whole); tests/gpu_suite.py runs the three")


def pytest_configure(config):
    gpu_shards.configure(config)
    if hasattr(config.option, "loadscopereorder") and not gpu_shards.requested(config):
        config.option.loadscopereorder = False  # pytest-xdist's loadfile takes files in pytest_collection_modifyitems' order


# Seconds each of the heaviest test files takes on a pytest-xdist worker of `make test` (two cores; measured 2026-12-01
# from a fresh clone, Inductor's and the ops' caches cold, junit times, rounded). Only the order of files uses them
# (pytest_collection_modifyitems): no test is skipped or changed by them, and a file missing here just counts its tests.
FILE_SECONDS = {"test_oracle.py": 146, "test_megatron_scripts.py": 120, "test_cli.py": 98, "test_context_parallel.py": 65,
                "test_checkpoint.py": 50, "test_moe.py": 46, "test_grpo.py": 45, "test_slurm.py": 43, "test_reshape.py": 41,
                "test_preemption.py": 39, "test_moe_routers.py": 33, "test_finetune.py": 33, "test_mpi.py": 33,
                "test_finetune_cli.py": 29, "test_benchmarks.py": 29, "test_generate.py": 25, "test_convert.py": 25,
                "test_planner.py": 25, "test_lora.py": 20, "test_offload.py": 16, "test_qlora.py": 14, "test_ops.py": 14,
                "test_monitor.py": 14, "test_megatron.py": 13, "test_wgrad_fusion.py": 12}


def pytest_collection_modifyitems(session, config, items):
    """The heaviest test files first, then the rest by their number of tests (GPU tests, which skip here, not
    counted), and last the files that load an op the suite builds in the background (pytest_collection_finish), by
    then built. pytest-xdist's loadfile hands whole files to its workers in this order (pytest_configure turns off
    its own, by number of tests, which left a 95-second file of 3 tests to the end, where one worker ran it while the
    other had nothing left): longest first, so the run ends on short files on both workers. Every test runs as
    before; only the order of files changes, which pytest-xdist never fixed anyway. The GPU suite keeps its order."""
    _import_for_forked_ranks()
    if gpu_shards.requested(config):
        return
    files: dict[str, list] = {}
    for item in items:
        files.setdefault(item.nodeid.split("::")[0], []).append(item)

    def weight(path: str) -> tuple:
        tests = files[path]
        builds = any(item.get_closest_marker("ops_build") for item in tests)
        cpu_tests = [item for item in tests if not item.get_closest_marker("gpu")]  # GPU tests skip here at once
        return (builds, -FILE_SECONDS.get(os.path.basename(path), 0.2 * len(cpu_tests)))

    items[:] = [item for path in sorted(files, key=weight) for item in files[path]]


def pytest_runtest_setup(item):
    """``@pytest.mark.gpus(n)``: skipped, with its reason, where fewer than ``n`` GPUs are visible."""
    needed = gpu_shards.gpus_needed(item)
    if needed > 1 and torch.cuda.device_count() < needed:
        pytest.skip(f"needs {needed} CUDA GPUs (NCCL)")


@pytest.fixture(autouse=True)
def _default_generators_seeded_alike_before_every_test():
    """torch's default generators (CPU and CUDA) start every test from one seed, whichever tests ran before on this
    pytest-xdist worker: a test that draws from them unseeded (a layer's dropout, forced random routing) otherwise drew
    what the earlier tests had left, and its figures changed with the order the workers were dealt (a CI run of
    2026-12-02 failed so: forced load balancing's counts were 3.5 standard deviations from even)."""
    torch.manual_seed(0)
    yield


@pytest.fixture(autouse=True)
def _no_process_group_left_in_the_test_process():
    """Ranks are forked from this process: a process group left here by one test would be inherited by every later
    test's ranks (an order dependence). The test that leaves one fails, by name."""
    yield
    import torch.distributed as dist
    assert not (dist.is_available() and dist.is_initialized()), "this test left a torch.distributed process group in the test process"


def pytest_collection_finish(session):
    """Start the op builds that collected tests need in the background at the lowest CPU priority, as the tests load
    them: DeepSpeed's ops they name (``@pytest.mark.ops_build(deepspeed="AsyncIOBuilder")``; tests/deepspeed_ops.py:
    async_io and pin_memory as one translation unit, ~40 s of CPU instead of ~5 minutes), then the project's fused CPU ops if a
    test is marked ``@pytest.mark.ops_build`` alone (~1 minute). Started here, a build uses the cycles the earlier
    tests leave idle, and the test that loads the op waits on the build's lock (and finds the build done) instead
    of compiling in its own time."""
    marks = [mark for item in session.items for mark in item.iter_markers("ops_build")]
    builders = sorted({mark.kwargs["deepspeed"] for mark in marks if "deepspeed" in mark.kwargs})
    builders += ["hybridlm"] if any("deepspeed" not in mark.kwargs for mark in marks) else []
    if builders and os.environ.get("PYTEST_XDIST_WORKER", "gw0") == "gw0":  # one build, not one per pytest-xdist worker
        session.config._background_build = subprocess.Popen([sys.executable, os.path.join(HERE, "deepspeed_ops.py"), *builders],
                                                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                                             preexec_fn=_lowest_priority)


def _lowest_priority() -> None:
    """In the background build's process, before it starts: yield the CPU to every test. A nice of 19 alone did not
    (a cold suite ran 71 s longer than a warm one on 2 cores, the early launch tests up to twice as long): with the
    kernel's autogroups (sched_autogroup_enabled), nice ranks a process only within its session's group, and the
    tests' launched jobs run in sessions of their own (harness.run_command), each a group the build's whole session
    competed with as an equal. So the build gets a session of its own whose group has the lowest weight."""
    os.setsid()
    try:
        with open("/proc/self/autogroup", "w") as f:
            f.write("19")
    except OSError:  # no autogroups here: nice alone then ranks it
        pass
    os.nice(19)


def pytest_sessionfinish(session):
    """Let a background build finish (a build killed half way leaves torch's lock behind, and the next load waits on it)."""
    build = getattr(session.config, "_background_build", None)
    if build is not None:
        build.wait(timeout=900)
