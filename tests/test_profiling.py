"""--profile-step-range A,B: a Chrome trace of iterations A+1..B, and one sentence for a bad range."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from hybridlm.config import ConfigError
from hybridlm.training.profiling import StepProfiler

CPU, CUDA = "CPU", "CUDA"


def event(name: str, start: float, end: float, device: str = CUDA) -> SimpleNamespace:
    """What summarize reads of a profiler event: a kernel (CUDA) or a step marker (CPU), in microseconds."""
    return SimpleNamespace(name=name, device_type=SimpleNamespace(name=device), time_range=SimpleNamespace(start=start, end=end))


def _train(profiler: StepProfiler, iterations: int) -> list[str]:
    """A Linear + SGD loop driven the way the trainer drives it; returns the trace paths written."""
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    written = [profiler.step(0)]
    for iteration in range(1, iterations + 1):
        loss = model(torch.randn(8, 16)).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        written.append(profiler.step(iteration))
    return [path for path in written if path]


def _events(path) -> list[dict]:
    with open(path) as f:
        return json.load(f)["traceEvents"]


def _profiled_steps(events) -> list[str]:
    return sorted(e["name"] for e in events if e.get("name", "").startswith("ProfilerStep#"))


def test_trace_covers_exactly_the_iterations_after_a_up_to_b(tmp_path):
    profiler = StepProfiler("2,4", str(tmp_path), rank=3)
    written = _train(profiler, iterations=6)

    trace = tmp_path / "trace_rank3_steps2-4.json"
    assert written == [str(trace)] and [p.name for p in tmp_path.iterdir()] == [trace.name]
    events = _events(trace)
    assert _profiled_steps(events) == ["ProfilerStep#3", "ProfilerStep#4"]
    ops = {e["name"] for e in events if e.get("cat") == "cpu_op"}
    assert {"aten::addmm", "aten::mm"} <= ops  # the Linear forward and its weight gradient
    assert any(e.get("args", {}).get("Input Dims") for e in events if e.get("cat") == "cpu_op")  # record_shapes


def test_range_from_zero_profiles_the_first_iteration(tmp_path):
    _train(StepProfiler("0,1", str(tmp_path), rank=0), iterations=3)
    assert _profiled_steps(_events(tmp_path / "trace_rank0_steps0-1.json")) == ["ProfilerStep#1"]


def test_close_writes_the_trace_when_the_run_ends_inside_the_range(tmp_path):
    profiler = StepProfiler("2,10", str(tmp_path), rank=0)
    assert _train(profiler, iterations=4) == []
    assert profiler.close() == str(tmp_path / "trace_rank0_steps2-10.json")
    steps = _profiled_steps(_events(tmp_path / "trace_rank0_steps2-10.json"))
    assert steps[:2] == ["ProfilerStep#3", "ProfilerStep#4"]  # then an empty #5, opened for a step never run
    assert profiler.close() is None  # closing twice is harmless


def test_no_range_profiles_nothing(tmp_path):
    profiler = StepProfiler(None, str(tmp_path / "profile"), rank=0)
    assert _train(profiler, iterations=3) == [] and profiler.close() is None
    assert not (tmp_path / "profile").exists()


@pytest.mark.parametrize("bad", ["4,2", "3,3", "-1,2", "2", "1,2,3", "a,b", "1.5,3", ""])
def test_bad_range_is_a_one_sentence_config_error(bad):
    with pytest.raises(ConfigError, match=r"^--profile-step-range .* must be two integers A,B with 0 <= A < B, e\.g\. 10,12\.$"):
        StepProfiler.parse(bad)


def test_good_range_parses_to_a_pair():
    assert StepProfiler.parse("10,12") == (10, 12) and StepProfiler.parse(" 0, 5") == (0, 5)


def test_summary_splits_step_time_into_kernel_kinds_exposed_communication_and_idle_time():
    from hybridlm.training.profiling import summarize

    # one 100 us step: gemm 0-40, nccl 30-60 (10 overlapped, 20 exposed), adam 70-80, idle 60-70 and 80-100
    events = [event("ProfilerStep#5", 0, 100, CPU), event("sm90_xmma_gemm_bf16", 0, 40),
              event("ncclDevKernel_AllReduce_Sum", 30, 60), event("multi_tensor_apply_kernel<AdamFunctor>", 70, 80)]
    summary = summarize(events)
    ms = 1e-3
    assert summary["step ms"] == pytest.approx(100 * ms)
    assert summary["matmul ms"] == pytest.approx(40 * ms)
    assert summary["communication ms"] == pytest.approx(30 * ms)
    assert summary["exposed communication ms"] == pytest.approx(20 * ms)
    assert summary["optimizer ms"] == pytest.approx(10 * ms)
    assert summary["idle GPU ms"] == pytest.approx(30 * ms)
    assert summary["top kernels"] == [("sm90_xmma_gemm_bf16", pytest.approx(40 * ms)), ("ncclDevKernel_AllReduce_Sum", pytest.approx(30 * ms)),
                                      ("multi_tensor_apply_kernel", pytest.approx(10 * ms))]
    assert summarize([event("ProfilerStep#1", 0, 10, CPU)]) == {}  # a CPU run has no kernels


def test_an_elementwise_kernel_is_no_optimizer_kernel_for_the_lambda_in_its_name():
    # PyTorch's elementwise kernels are named after the lambda they run: "lamb" (the LAMB optimizer) once counted them all
    # as optimizer time (542 of a 7B QLoRA step's 3,670 ms on an H200, where the optimizer takes about 1 ms)
    from hybridlm.training.profiling import summarize
    mul = ("void at::native::elementwise_kernel<128, 4, at::native::gpu_kernel_impl_nocast<at::native::BinaryFunctor<"
           "c10::BFloat16, c10::BFloat16, c10::BFloat16, at::native::binary_internal::MulFunctor<float> > >(at::TensorIteratorBase&, "
           "at::native::BinaryFunctor<c10::BFloat16, c10::BFloat16, c10::BFloat16> const&)::{lambda(int)#1}>(int, {lambda(int)#1})")
    events = [event("ProfilerStep#2", 0, 100, CPU), event(mul, 0, 50), event("multi_tensor_apply_kernel<FusedAdamMathFunctor>", 60, 70)]
    summary = summarize(events)
    assert summary["other kernels ms"] == pytest.approx(50e-3) and summary["optimizer ms"] == pytest.approx(10e-3)


def test_heaviest_kernels_add_up_the_launches_of_one_kernel_whatever_its_template_arguments():
    from hybridlm.training.profiling import format_summary, summarize

    events = [event("ProfilerStep#1", 0, 100, CPU),
              event("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>(int, float)", 0, 10),
              event("void at::native::vectorized_elementwise_kernel<2, at::native::FillFunctor<c10::BFloat16>>(int)", 10, 30),
              event("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>(int)", 30, 32),
              event("triton_per_fused_add_mul_rsqrt_0", 32, 37)]
    summary = summarize(events)
    # PyTorch's generic elementwise kernels are told apart by the functor that says what they compute
    assert summary["top kernels"] == [("at::native::vectorized_elementwise_kernel [FillFunctor]", pytest.approx(30e-3)),
                                      ("triton_per_fused_add_mul_rsqrt_0", pytest.approx(5e-3)),
                                      ("at::native::vectorized_elementwise_kernel [CUDAFunctor_add]", pytest.approx(2e-3))]
    assert "30.0%  at::native::vectorized_elementwise_kernel [FillFunctor]" in format_summary(summary)


def test_summary_reads_kernels_and_steps_from_an_exported_chrome_trace(tmp_path):
    import json

    from hybridlm.training.profiling import summarize_trace
    trace = {"traceEvents": [
        {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#3", "ts": 1000, "dur": 200},
        {"ph": "X", "cat": "gpu_user_annotation", "name": "ProfilerStep#3", "ts": 1000, "dur": 200},
        {"ph": "X", "cat": "kernel", "name": "nvjet_tst_128x256_h_bz_coopA", "ts": 1000, "dur": 150},
        {"ph": "X", "cat": "kernel", "name": "cudnn_generated_fort_native_sdpa_sm90", "ts": 1150, "dur": 20},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 1000, "dur": 5}]}
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(trace))
    summary = summarize_trace(str(path))
    assert summary["steps"] == 1
    assert summary["matmul ms"] == pytest.approx(0.150)
    assert summary["attention ms"] == pytest.approx(0.020)
    assert summary["idle GPU ms"] == pytest.approx(0.030)


def test_idle_time_is_summed_by_where_the_host_was_when_the_queue_ran_dry_and_when_it_was_refilled(tmp_path):
    import json

    from hybridlm.training.profiling import format_summary, summarize_trace

    def x(cat, name, ts, dur, tid=1, correlation=None):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid,
                **({"args": {"correlation": correlation}} if correlation else {})}
    # idle 100-400: the queue empties while the host syncs in the optimizer step, the next
    # forward's embedding refills it; idle 500-520: autograd's thread launches a backward GEMM;
    # idle 1000-1100: the host logs after a sync, and nothing is queued before the steps end
    trace = {"traceEvents": [
        x("user_annotation", "ProfilerStep#7", 0, 1100),
        x("kernel", "multi_tensor_apply_kernel<AdamFunctor>", 0, 100, tid=7, correlation=1),
        x("kernel", "void at::native::index_select_kernel<float>(int)", 400, 100, tid=7, correlation=2),
        x("kernel", "nvjet_sm90_tst", 520, 480, tid=7, correlation=3),
        x("user_annotation", "hybridlm.step", 80, 300), x("cpu_op", "aten::item", 90, 30),
        x("user_annotation", "hybridlm.forward", 385, 35), x("cpu_op", "aten::embedding", 388, 4),
        x("cuda_runtime", "cudaLaunchKernel", 390, 1, correlation=2),
        x("cpu_op", "autograd::engine::evaluate_function: MmBackward0", 505, 10, tid=2),
        x("cuda_runtime", "cudaLaunchKernel", 510, 1, tid=2, correlation=3),
        x("user_annotation", "hybridlm.log", 990, 110), x("cpu_op", "aten::item", 995, 5),
        x("cuda_runtime", "cudaStreamSynchronize", 996, 4)]}
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(trace))
    summary = summarize_trace(str(path))
    assert summary["idle GPU ms"] == pytest.approx(0.420)
    assert summary["idle sites"]["ran dry"] == [
        (pytest.approx(0.300), 1, pytest.approx(0.300), "hybridlm.step > aten::item"),
        (pytest.approx(0.100), 1, pytest.approx(0.100), "hybridlm.log > cudaStreamSynchronize"),
        (pytest.approx(0.020), 1, pytest.approx(0.020), "(between ops) > (no op)")]
    assert summary["idle sites"]["refilled"] == [
        (pytest.approx(0.300), 1, pytest.approx(0.300), "hybridlm.forward > aten::embedding"),
        (pytest.approx(0.100), 1, pytest.approx(0.100), "(after the steps)"),
        (pytest.approx(0.020), 1, pytest.approx(0.020), "(between ops) > autograd::engine::evaluate_function: MmBackward0")]
    assert "27.3%      1 gaps, longest   0.30 ms  hybridlm.forward > aten::embedding" in format_summary(summary)
