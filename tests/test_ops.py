"""Fused kernels on CPU: JIT-built through DeepSpeed's op builder, they compute the PyTorch
definitions (outputs and gradients against fp32, fresh random inputs each run: see
kernel_checks.py); the build falls back (or stops) with the compiler's error, builds once
per node, and survives a build killed half-way.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import queue
import random
import signal
import stat
import time

import pytest
import torch

from hybridlm.config import FUSED_OPS
from hybridlm.ops import FusedOpsUnavailable, functions, reference, select_kernels
from hybridlm.ops.op_builder import FusedOpsCPUBuilder
from hybridlm.ops.jit import BATON_NAME, build_and_load, build_directory
from hybridlm.ops.report import main as report_main

from harness import run_ranks
from kernel_checks import DTYPES, check_rms_norm, check_rotary, check_swiglu, fresh_generator, outputs_and_grads, randn
from oracle import TINY, assert_matches, ds_config, train_and_probe


@pytest.fixture
def gen():
    return fresh_generator()


@pytest.fixture(scope="module")
def kernels():
    return select_kernels(FUSED_OPS, require=True, device="cpu", log=lambda _: None)


def test_the_package_reaches_the_top_level_sources_and_builders_and_ships_them(monkeypatch):
    """ops/csrc and ops/op_builder sit beside the package (DeepSpeed's layout): a checkout imports the
    builders as hybridlm.ops.op_builder through the package's search path, the builders find the
    sources, setup.py installs both where the builders look, and the tree holds no symbolic link."""
    import glob
    import runpy
    from unittest import mock

    import setuptools

    import hybridlm.ops.op_builder as op_builder
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    assert os.path.abspath(op_builder.__file__).startswith(os.path.join(root, "ops", "op_builder"))
    for device in ("cpu", "cuda"):
        builder = op_builder.builder_for(device)
        assert all(os.path.exists(s) for s in builder.sources()), builder.sources()
    for folder in ("hybridlm", "ops"):
        links = [p for p in glob.glob(os.path.join(root, folder, "**"), recursive=True) if os.path.islink(p)]
        assert not links, f"symbolic links do not travel to every machine: {links}"
    monkeypatch.chdir(root)  # setup.py finds packages from the current directory
    with mock.patch.object(setuptools, "setup") as setup:
        runpy.run_path(os.path.join(root, "setup.py"))
    options = setup.call_args.kwargs
    assert {"hybridlm.ops.op_builder", "hybridlm.ops.csrc"} <= set(options["packages"])
    installed = options["package_dir"]
    assert (installed["hybridlm.ops.op_builder"], installed["hybridlm.ops.csrc"]) == ("ops/op_builder", "ops/csrc")
    shipped = {os.path.realpath(p) for pattern in options["package_data"]["hybridlm.ops.csrc"]
               for p in glob.glob(os.path.join(root, "ops", "csrc", pattern))}
    sources = {os.path.realpath(p) for p in glob.glob(os.path.join(root, "ops", "csrc", "**", "*.*"), recursive=True)}
    assert sources and sources <= shipped, sorted(sources - shipped)


@pytest.mark.ops_build
def test_every_op_runs_the_built_kernel(kernels):
    assert kernels.fused == FUSED_OPS
    assert kernels.rms_norm is not reference.rms_norm and kernels.swiglu is not reference.swiglu
    assert all(path.startswith("fused (hybridlm_fused_cpu") for path in kernels.paths.values()), kernels.paths


@pytest.mark.ops_build
@pytest.mark.parametrize("hidden", [33, 1000])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_matches_fp32_reference(kernels, gen, dtype, hidden):
    check_rms_norm(kernels, gen, dtype, (7, 3, hidden))


@pytest.mark.ops_build
@pytest.mark.parametrize("head_dim", [10, 64])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_matches_fp32_reference_on_a_strided_view(kernels, gen, dtype, head_dim):
    check_rotary(kernels, gen, dtype, seq=7, batch=2, heads=3, head_dim=head_dim)


@pytest.mark.ops_build
@pytest.mark.parametrize("ffn", [33, 1000])
@pytest.mark.parametrize("dtype", DTYPES)
def test_swiglu_matches_fp32_reference(kernels, gen, dtype, ffn):
    check_swiglu(kernels, gen, dtype, (7, 3, ffn))


@pytest.mark.ops_build
def test_kernels_trace_under_torch_compile(kernels, gen):
    # The fake implementations let torch.compile trace through the custom ops (aot_eager: no codegen).
    cos, sin = randn(gen, 3, 8).cos(), randn(gen, 3, 8).sin()

    def block(x, w, h, q):
        return kernels.rms_norm(x, w, 1e-5).sum() + kernels.swiglu(h).sum() + kernels.rotary(q, cos, sin).sum()

    inputs = randn(gen, 5, 16), randn(gen, 16), randn(gen, 5, 12), randn(gen, 3, 2, 2, 8)
    eager = outputs_and_grads(block, inputs, torch.tensor(1.0))
    compiled = outputs_and_grads(torch.compile(block, backend="aot_eager", fullgraph=True), inputs, torch.tensor(1.0))
    assert torch.allclose(compiled[0], eager[0])
    for got, want in zip(compiled[1], eager[1]):
        assert torch.allclose(got, want)


def test_auto_on_cpu_builds_nothing_and_says_so():
    lines = []
    kernels = select_kernels(None, require=True, device="cpu", log=lines.append)
    assert kernels.fused == () and kernels.rms_norm is reference.rms_norm
    assert lines == ["hybridlm: fused ops: rmsnorm, rope, swiglu PyTorch (auto: off on cpu)"]


@pytest.mark.ops_build
def test_a_subset_is_fused_and_the_log_names_each_path(kernels):
    lines = []
    subset = select_kernels(("swiglu",), require=False, device="cpu", log=lines.append)
    assert subset.fused == ("swiglu",) and subset.rms_norm is reference.rms_norm
    assert lines == ["hybridlm: fused ops: rmsnorm, rope PyTorch (not requested); "
                     "swiglu fused (hybridlm_fused_cpu: already loaded in this process)"]


def _train_counting_kernel_calls(flags):
    """train_and_probe, plus how often each fused kernel's autograd function ran (forward, recompute included)."""
    calls = {}
    for name in ("_RMSNorm", "_Rotary", "_SwiGLU"):
        function = getattr(functions, name)
        original = function.forward

        def counted(ctx, *args, _original=original, _name=name):
            calls[_name] = calls.get(_name, 0) + 1
            return _original(ctx, *args)

        function.forward = staticmethod(counted)
    result = train_and_probe(flags)
    result["kernel_calls"] = calls
    return result


@pytest.mark.ops_build
def test_tp2_sp_with_full_recompute_and_fused_ops_matches_single_process_pytorch():
    # The fused kernels inside DeepSpeed's activation checkpointing, on sequence-parallel shards.
    reference_run = run_ranks(1, train_and_probe, TINY + ds_config("zero0"))[0]
    layout = ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--recompute-granularity", "full",
              "--fused-ops", "all", "--require-fused-ops"]
    fused = run_ranks(2, _train_counting_kernel_calls, TINY + layout + ds_config("zero1"), timeout=300)
    assert fused[0]["losses"] == fused[1]["losses"], "ranks disagree on the loss"
    # 3 steps x 4 micro-batches x 4 layers, each layer run twice (forward and recompute): norms x2, q and k, one MLP
    per_layer_run = 3 * 4 * 4 * 2
    assert fused[0]["kernel_calls"] == {"_RMSNorm": 2 * per_layer_run + 3 * 4, "_Rotary": 2 * per_layer_run,
                                        "_SwiGLU": per_layer_run}
    assert_matches(reference_run, fused[0])


# ---------------------------------------------------------------- build robustness

# A minimal extension: a module and nothing else (no PyTorch headers: compiles in about a second).
TINY_SOURCE = """
#include <Python.h>
#define STR_(x) #x
#define STR(x) STR_(x)
#define CAT_(a, b) a##b
#define CAT(a, b) CAT_(a, b)
static PyModuleDef def = {PyModuleDef_HEAD_INIT, STR(TORCH_EXTENSION_NAME), nullptr, -1, nullptr};
PyMODINIT_FUNC CAT(PyInit_, TORCH_EXTENSION_NAME)(void) { return PyModule_Create(&def); }
"""


class SourceBuilder(FusedOpsCPUBuilder):
    """The CPU builder on another source file (a unique extension name per test)."""

    def __init__(self, name: str, source: str):
        super().__init__(name)
        self.source = source

    def sources(self):
        return [self.source]

    def cxx_args(self):
        return ["-O0"]


@pytest.fixture
def build_env(tmp_path, monkeypatch):
    """A private extensions directory, and a compiler wrapper that counts compiles (and takes a
    few seconds each, so that builds started together really overlap)."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "extensions"))
    monkeypatch.setenv("TORCH_DONT_CHECK_COMPILER_ABI", "1")
    counter = tmp_path / "compiles"
    wrapper = tmp_path / "bin" / "c++"
    wrapper.parent.mkdir()
    wrapper.write_text(f'#!/bin/sh\ncase " $* " in *" -c "*) echo compile >> {counter}; sleep 3;; esac\nexec c++ "$@"\n')
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("CXX", str(wrapper))
    source = tmp_path / "tiny.cpp"
    source.write_text(TINY_SOURCE)
    name = f"hybridlm_test_{os.getpid()}_{random.randrange(10**9)}"
    return SourceBuilder(name, str(source)), lambda: len(counter.read_text().split()) if counter.exists() else 0


def _build_in_child(builder, results):
    os.setsid()  # its own process group, so a test can kill the build with its compiler
    results.put(build_and_load(builder).status)


def _start_builds(builder, count):
    ctx = mp.get_context("fork")
    results = ctx.Queue()
    procs = [ctx.Process(target=_build_in_child, args=(builder, results), daemon=True) for _ in range(count)]
    for p in procs:
        p.start()
    return procs, results


def _statuses(procs, results, timeout=120.0) -> list[str]:
    """The build outcomes of ``procs``, sorted; fails (and kills them) if they do not all finish in time."""
    try:
        return sorted(results.get(timeout=timeout) for _ in procs)
    except queue.Empty:
        raise AssertionError(f"a build did not finish within {timeout:.0f} s") from None
    finally:
        for p in procs:
            if p.is_alive():
                os.killpg(p.pid, signal.SIGKILL)
            p.join(timeout=10)


@pytest.mark.ops_build
def test_builds_started_together_compile_once(build_env):
    builder, compiles = build_env
    assert _statuses(*_start_builds(builder, 2)) == ["built", "cached"]
    assert compiles() == 1


@pytest.mark.ops_build
def test_a_build_killed_half_way_does_not_hang_the_next(build_env):
    builder, compiles = build_env
    baton = os.path.join(build_directory(builder.name), BATON_NAME)
    (victim,), _ = _start_builds(builder, 1)
    deadline = time.monotonic() + 60
    while not (os.path.exists(baton) and compiles() == 1) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert os.path.exists(baton), "the first build never started"
    os.killpg(victim.pid, signal.SIGKILL)  # mid-compile: torch's lock file stays behind
    victim.join(timeout=10)
    assert os.path.exists(baton)
    assert _statuses(*_start_builds(builder, 1)) == ["built"]  # torch alone would wait for the dead build forever


@pytest.mark.ops_build
def test_a_failing_build_shows_the_compiler_error_and_falls_back(build_env, tmp_path):
    builder, compiles = build_env
    broken = tmp_path / "broken.cpp"
    broken.write_text(TINY_SOURCE + "\nint broken( {\n")
    builder.source = str(broken)
    lines = []
    kernels = select_kernels(("rmsnorm",), require=False, device="cpu", log=lines.append, builder=builder)
    assert kernels.fused == () and kernels.rms_norm is reference.rms_norm
    assert len(lines) == 1 and "rmsnorm PyTorch (build failed: " in lines[0], lines
    assert "broken.cpp" in lines[0] and "error" in lines[0], lines  # the compiler's own words, with file and line

    with pytest.raises(FusedOpsUnavailable) as raised:
        select_kernels(("rmsnorm",), require=True, device="cpu", log=lines.append, builder=builder)
    message = str(raised.value)
    assert message.startswith("--require-fused-ops: the fused rmsnorm kernel(s) cannot be used on cpu: build failed:")
    assert "\n" not in message and "broken.cpp" in message
    assert compiles() == 1, "a process that saw the build fail compiled the same sources again"


def test_report_lists_each_op_for_each_device_and_exits_0(capsys):
    assert report_main() == 0
    out = capsys.readouterr().out
    for op in FUSED_OPS:
        rows = [line for line in out.splitlines() if line.startswith(op + " ")]
        assert [row.split()[1] for row in rows] == ["cpu", "cuda"], out
    assert "hybridlm_fused_cpu" in out and "used by --fused-ops auto" in out
