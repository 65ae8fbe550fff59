"""The training monitor (README, "Monitoring"): the gradient noise scale of McCandlish et al. against its formula, on
synthetic gradients and on the micro-batch gradients of real runs (one rank with accumulation, DP=2 under ZeRO 1-3);
the exposed and busy shares on synthetic timelines; which process group a collective is put under; what a sampled step
on gloo records; the guide's warnings; the refusals. The GPU side (NCCL kernels, overlap) is in test_monitor_gpu.py.
"""
from __future__ import annotations

import math

import pytest
import torch

from harness import run_ranks
from oracle import TINY, ds_config

from hybridlm.config import ConfigError, parse_args
from hybridlm.training.monitor import NOISE_EMA_DECAY, GuideThresholds, SmoothedNoiseScale, noise_scale_estimates
from hybridlm.training.timeline import SAMPLED_STEP, GroupMap, analyse

# ---------------------------------------------------------------- the noise scale's arithmetic


def _draws(draws: int, small_batches: int, b_small: int, generator) -> tuple[torch.Tensor, torch.Tensor, float, float]:
    """Per-example gradients g ~ N(G, Sigma) (diagonal Sigma), grouped into small batches of ``b_small`` and one big
    batch of all of them per draw: (mean squared small-batch norm, squared big-batch norm) per draw, |G|^2, tr Sigma."""
    dim = 48
    true = torch.linspace(-0.5, 0.5, dim, dtype=torch.float64)
    std = torch.linspace(0.5, 2.0, dim, dtype=torch.float64)
    examples = true + std * torch.randn(draws, small_batches, b_small, dim, dtype=torch.float64, generator=generator)
    small = examples.mean(dim=2)  # [draws, small batches, dim]
    big = small.mean(dim=1)
    return small.square().sum(-1).mean(1), big.square().sum(-1), float(true.square().sum()), float(std.square().sum())


def test_noise_scale_estimators_are_unbiased_on_gradients_with_a_known_covariance():
    generator = torch.Generator().manual_seed(0)
    b_small, small_batches, draws = 4, 8, 4000
    small_sq, big_sq, true_sq, trace = _draws(draws, small_batches, b_small, generator)
    g2, tr = noise_scale_estimates(small_sq, big_sq, b_small, b_small * small_batches)
    for estimate, truth, name in ((g2, true_sq, "|G|^2"), (tr, trace, "tr Sigma")):
        error = estimate.std() / math.sqrt(draws)
        assert abs(float(estimate.mean()) - truth) < 4 * error, f"{name}: mean estimate {float(estimate.mean())} vs {truth}"
    # the raw squared norms are biased by tr Sigma / B: what the estimators remove
    assert float(big_sq.mean()) > true_sq + 0.5 * trace / (b_small * small_batches)


def test_the_smoothed_noise_scale_tends_to_the_ratio_of_trace_and_squared_gradient():
    generator = torch.Generator().manual_seed(1)
    b_small, small_batches = 2, 8
    small_sq, big_sq, true_sq, trace = _draws(2000, small_batches, b_small, generator)
    smoothed = SmoothedNoiseScale(b_small, b_small * small_batches)
    assert smoothed.value() is None, "no value before the first step"
    for s, b in zip(small_sq.tolist(), big_sq.tolist()):
        smoothed.update(s, b)
    # an EMA of decay 0.99 averages ~200 steps: within 10% of B_simple = tr Sigma / |G|^2 (~27 samples here)
    assert smoothed.value() == pytest.approx(trace / true_sq, rel=0.1)


def _expected_noise_scales(micro_grads: list[list[torch.Tensor]], accumulation: int, b_small: int, b_big: int) -> list[float]:
    """The spec, from the gradients each step's micro-batches left in ``.grad`` (their mean gradients / GAS under the
    loss contract): each step's |G_small|^2 (mean over micro-batches) and |G_big|^2 (their sum's), bias-corrected
    EMAs of decay 0.99, then McCandlish's estimators and their ratio."""
    small_ema = big_ema = 0.0
    values = []
    for step, grads in enumerate(micro_grads, start=1):
        small = sum(float((accumulation * g).double().square().sum()) for g in grads) / len(grads)
        big = float(torch.stack(grads).double().sum(0).square().sum())
        small_ema = NOISE_EMA_DECAY * small_ema + (1 - NOISE_EMA_DECAY) * small
        big_ema = NOISE_EMA_DECAY * big_ema + (1 - NOISE_EMA_DECAY) * big
        correction = 1 - NOISE_EMA_DECAY ** step
        true_sq, trace = noise_scale_estimates(small_ema / correction, big_ema / correction, b_small, b_big)
        values.append(trace / true_sq)
    return values


def _train_keeping_micro_batch_gradients(flags: list[str]) -> tuple[list[dict], list[list[torch.Tensor]]]:
    """In each rank: pretrain with ``flags``; each micro-batch's gradient read as the growth of ``.grad`` across its
    ``engine.backward`` (ZeRO-0 keeps ``.grad`` accumulating; nothing of the monitor's hooks is used)."""
    from hybridlm.training import trainer
    build, steps = trainer.build_run, []

    def build_and_watch(cfg, ds, *rest):
        run = build(cfg, ds, *rest)
        engine, params = run.engine, [p for p in run.engine.module.parameters() if p.requires_grad]
        backward = engine.backward

        def backward_and_keep(loss, *args, **kwargs):
            before = [torch.zeros_like(p) if p.grad is None else p.grad.detach().clone() for p in params]
            done = backward(loss, *args, **kwargs)
            grown = torch.cat([(p.grad.detach() - b).flatten() for p, b in zip(params, before)])
            if not steps or len(steps[-1]) == cfg.gradient_accumulation_steps:
                steps.append([])
            steps[-1].append(grown)
            return done

        engine.backward = backward_and_keep
        return run

    trainer.build_run = build_and_watch
    return trainer.pretrain(flags), steps


def _pretrain(flags: list[str]) -> list[dict]:
    from hybridlm.training.trainer import pretrain
    return pretrain(flags)


NOISE = ["--log-grad-noise-scale", "--train-iters", "3", "--log-interval", "1"]


def test_logged_noise_scale_with_accumulation_4_equals_the_formula_on_each_micro_batchs_gradient():
    # one rank, micro-batches of 2, a step of 8 samples: 4 micro-batches accumulated
    flags = ds_config("zero0") + TINY + NOISE
    [(records, micro_grads)] = run_ranks(1, _train_keeping_micro_batch_gradients, flags)
    assert [len(step) for step in micro_grads] == [4, 4, 4]
    expected = _expected_noise_scales(micro_grads, accumulation=4, b_small=2, b_big=8)
    logged = [r["grad_noise_scale"] for r in records]
    assert logged == pytest.approx(expected, rel=1e-5)


_ONE_RANK: dict = {}


def _one_rank_noise_scales(micro_batch_size: int, model: tuple[str, ...] = ()) -> list[float]:
    """The formula's values on one rank's micro-batch gradients, a step of 8 samples in micro-batches of the given size."""
    key = (micro_batch_size, model)
    if key not in _ONE_RANK:
        flags = ds_config("zero0") + TINY + NOISE + ["--micro-batch-size", str(micro_batch_size), *model]
        [(_, micro_grads)] = run_ranks(1, _train_keeping_micro_batch_gradients, flags)
        _ONE_RANK[key] = _expected_noise_scales(micro_grads, accumulation=8 // micro_batch_size, b_small=micro_batch_size, b_big=8)
    return _ONE_RANK[key]


def _logged_by_every_rank(world: int, flags: list[str]) -> list[float]:
    ranks = run_ranks(world, _pretrain, flags)
    logged = [r["grad_noise_scale"] for r in ranks[0]]
    assert all([r["grad_noise_scale"] for r in records] == logged for records in ranks), "every rank reports the same value"
    return logged


@pytest.mark.parametrize("zero", ["zero1", "zero2", "zero3"])
def test_at_dp2_with_accumulation_4_the_logged_noise_scale_is_the_formula_on_every_ranks_micro_batches(zero):
    # DP=2, micro-batches of 1, 4 accumulated per rank: the same 8 single-sample small batches as one rank with 8;
    # the norms are taken on each rank before ZeRO's reduction
    logged = _logged_by_every_rank(2, ds_config(zero) + TINY + NOISE + ["--micro-batch-size", "1"])
    assert logged == pytest.approx(_one_rank_noise_scales(1), rel=1e-4)


@pytest.mark.parametrize("layout", [["--tensor-model-parallel-size", "2"], ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
                                    ["--pipeline-model-parallel-size", "2", "--untie-embeddings-and-output-weights"]],
                         ids=["tp2", "tp2-sp", "pp2-untied"])
def test_model_parallel_shards_add_up_to_each_micro_batchs_norm_counting_every_parameter_once(layout):
    # TP: sharded weights add their squared norms, replicated ones (norms, SP's summed norm weights) count once
    model = tuple(f for f in layout if f == "--untie-embeddings-and-output-weights")
    logged = _logged_by_every_rank(2, ds_config("zero1") + TINY + NOISE + layout)
    assert logged == pytest.approx(_one_rank_noise_scales(2, model), rel=1e-4)


# ---------------------------------------------------------------- timelines (microseconds)

def _window(start: float, end: float) -> dict:
    return {"ph": "X", "cat": "user_annotation", "name": SAMPLED_STEP, "ts": start, "dur": end - start, "tid": 1}


def _kernel(start: float, end: float, name: str = "ampere_bf16_gemm", **args) -> dict:
    return {"ph": "X", "cat": "kernel", "name": name, "ts": start, "dur": end - start, "args": args}


NCCL = "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)"


def test_exposed_share_is_the_collective_time_no_compute_kernel_overlaps():
    events = [_window(0, 100),
              _kernel(0, 40), _kernel(60, 100),  # compute on one stream
              _kernel(30, 50, NCCL), _kernel(45, 48, NCCL),  # collectives, two of them at once
              _kernel(55, 70, NCCL)]
    step = analyse(events, GroupMap())
    assert step.step_ms == pytest.approx(0.1)
    assert step.comm_ms == pytest.approx((20 + 3 + 15) / 1e3)  # summed, as the profiler's table sums
    assert step.comm_share == pytest.approx(0.35)  # [30, 50] and [55, 70]
    assert step.exposed_comm_share == pytest.approx(0.15)  # [40, 50] and [55, 60]
    assert step.busy_share == pytest.approx(0.95)  # idle only in [50, 55]


@pytest.mark.parametrize("compute, exposed", [([], 0.2), ([(0, 100)], 0.0), ([(0, 25)], 0.15)],
                         ids=["no-overlap", "hidden", "half-hidden"])
def test_exposed_share_equals_the_raw_share_without_overlap_and_vanishes_when_compute_covers_it(compute, exposed):
    events = [_window(0, 100), _kernel(20, 40, NCCL)] + [_kernel(a, b) for a, b in compute]
    step = analyse(events, GroupMap())
    assert step.comm_share == pytest.approx(0.2)
    assert step.exposed_comm_share == pytest.approx(exposed)


def test_kernels_are_clipped_to_the_sampled_step():
    events = [_window(100, 200), _kernel(50, 120), _kernel(190, 250, NCCL), _kernel(300, 400, NCCL)]
    step = analyse(events, GroupMap())
    assert step.busy_share == pytest.approx(0.3)  # [100, 120] and [190, 200]
    assert step.comm_ms == pytest.approx(0.01)
    assert analyse([_kernel(0, 1)], GroupMap()) is None, "no sampled step, no figures"


def _comms_op(start: float, end: float, external: int, tid: int = 1, **meta) -> dict:
    return {"ph": "X", "cat": "cpu_op", "name": "record_param_comms", "ts": start, "dur": end - start, "tid": tid,
            "args": {"External id": external, **meta}}


def _launch(at: float, correlation: int, tid: int = 1) -> dict:
    return {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernelExC", "ts": at, "dur": 1, "tid": tid,
            "args": {"correlation": correlation}}


def test_collectives_go_under_their_process_group_by_name_then_pipeline_traffic_then_ranks():
    groups = GroupMap(names={"3": "tp", "5": "dp"}, ranks={(0, 1): ("tp",), (0, 2): ("dp", "ep"), tuple(range(64)): ("dp",)},
                      pipeline=True)
    meta = lambda name, ranks, collective: {"Process Group Name": name, "Process Group Ranks": ranks,  # noqa: E731
                                            "Collective name": collective}
    events = [
        _window(0, 1000),
        # kineto copied the op's arguments onto the kernel: our TP group, by name
        _kernel(0, 10, NCCL, **meta("3", "[0, 1]", "allreduce")),
        # joined to its record_param_comms op by External id: our DP group (ZeRO's reduce-scatter)
        _comms_op(20, 30, external=7, **meta("5", "[0, 2]", "_reduce_scatter_base")),
        _kernel(25, 45, "ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL", **{"External id": 7}),
        # joined through its launch's correlation: point-to-point on the world group is the pipeline's
        _comms_op(100, 110, external=8, tid=2, **meta("0", "[0, 1, 2, 3]", "send")),
        _launch(105, correlation=42, tid=2),
        _kernel(110, 130, "ncclDevKernel_SendRecv", correlation=42),
        # a group DeepSpeed made with our DP ranks: an all-to-all prefers EP, a gather gets the first label
        _kernel(200, 204, NCCL, **meta("11", "[0, 2]", "all_to_all")),
        _kernel(210, 218, NCCL, **meta("11", "[0, 2]", "_allgather_base")),
        # 64 ranks, cut after 30 by record_param_comms
        _kernel(300, 301, NCCL, **meta("12", "[" + ", ".join(map(str, range(29))) + ", ..., 63]", "allreduce")),
        # nobody's ranks; and a kernel whose op was not recorded
        _kernel(400, 402, NCCL, **meta("13", "[0, 3]", "allreduce")),
        _kernel(500, 505, NCCL),
    ]
    step = analyse(events, groups)
    assert step.by_group == pytest.approx({"tp": 0.010, "dp": 0.020 + 0.008 + 0.001, "pp": 0.020, "ep": 0.004,
                                           "cp": 0.0, "other": 0.002 + 0.005})
    assert step.by_collective["dp"] == pytest.approx({"_reduce_scatter_base": 0.020, "_allgather_base": 0.008,
                                                      "allreduce": 0.001})
    assert step.by_collective["pp"] == {"send": pytest.approx(0.020)}
    assert step.by_collective["other"] == pytest.approx({"allreduce": 0.002, "AllReduce": 0.005})
    assert sum(step.by_group.values()) == pytest.approx(step.comm_ms)


def _sampled_step_on_gloo(tp: int, dp: int) -> dict:
    """In each rank: a real ParallelState; one all-reduce on the TP group and one on the DP group under a sampled step."""
    import torch.distributed as dist

    from hybridlm.parallel.state import ParallelState
    from hybridlm.training.distributed import init_distributed
    from hybridlm.training.monitor import CommSampler, group_map
    init_distributed(1.0)
    ps = ParallelState(tp=tp, dp=dp)
    groups = group_map(ps)
    sampler = CommSampler(1, groups)
    with sampler.around(1):
        for handle in (ps.tp, ps.grad_reduction):
            if handle.size > 1:
                dist.all_reduce(torch.ones(1 << 16), group=handle.group)
    step, iteration, _ = sampler.take()
    # what NCCL's record_param_comms would say of these groups, labelled through the real groups' names and ranks
    labels = {kind: groups.label(h.group.group_name, str(dist.get_process_group_ranks(h.group)), "allreduce")
              for kind, h in (("tp", ps.tp), ("dp", ps.grad_reduction)) if h.size > 1}
    return {"labels": labels, "by_collective": step.by_collective, "comm_ms": step.comm_ms,
            "exposed": step.exposed_comm_share, "busy": step.busy_share, "iteration": iteration}


@pytest.mark.parametrize("tp, dp", [(2, 1), (1, 2), (2, 2)])
def test_on_gloo_a_sampled_step_holds_each_collectives_work_and_the_groups_of_the_layout_are_labelled(tp, dp):
    # Gloo records the work of each collective ("gloo:all_reduce", on the group's worker thread) but not its group
    # (no record_param_comms on gloo in torch 2.13): its time is "other"; the labels of the run's own groups are
    # checked through their real names and ranks.
    for rank in run_ranks(tp * dp, _sampled_step_on_gloo, tp, dp):
        assert rank["labels"] == {k: k for k in rank["labels"]} and len(rank["labels"]) == (tp > 1) + (dp > 1)
        assert rank["comm_ms"] > 0 and rank["iteration"] == 1
        assert set(rank["by_collective"]) == {"other"} and "all_reduce" in rank["by_collective"]["other"]
        assert rank["exposed"] is None and rank["busy"] is None, "no device timeline on a CPU"


def test_training_with_tp2_and_dp2_logs_the_sampled_steps_figures_on_the_log_interval():
    flags = ds_config("zero1") + TINY + ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--train-iters", "4",
                                         "--log-interval", "2", "--log-comm-interval", "3"]
    records = run_ranks(4, _pretrain, flags)[0]
    sampled = [r for r in records if "comm_sampled_iteration" in r]
    assert [r["iteration"] for r in sampled] == [4] and sampled[0]["comm_sampled_iteration"] == 3
    figures = sampled[0]
    assert {"comm_tp_ms", "comm_dp_ms", "comm_other_ms"} <= set(figures) and "comm_pp_ms" not in figures
    assert figures["comm_ms"] > 0 and figures["comm_other_ms"] == pytest.approx(figures["comm_ms"])  # gloo: no groups
    assert figures["sampled_step_ms"] > 0 and figures["comm_sample_overhead_ms"] > 0


# ---------------------------------------------------------------- the guide's thresholds, refusals

def test_each_threshold_is_said_once_when_its_window_crosses_it():
    guide = GuideThresholds()
    said = [guide.crossed({"mfu": 0.10})]  # the first logged interval (warm-up) is not judged
    said += [guide.crossed({"mfu": mfu}) for mfu in (0.35, 0.5, 0.36, 0.38, 0.6)]  # median 0.38
    said += [guide.crossed({"mfu": 0.2}) for _ in range(10)]
    assert [len(s) for s in said] == [0, 0, 0, 0, 0, 1] + [0] * 10
    assert said[5][0].startswith("MFU has been 38.0% (median of the last 5 logged steps), below the 40%")
    assert said[5][0].endswith("(README, 'Monitoring').")
    exposed = [guide.crossed({"exposed_comm_share": share, "gpu_busy_share": 0.9}) for share in (0.2, 0.4, 0.5, 0.1, 0.1)]
    assert [len(s) for s in exposed] == [0, 0, 1, 0, 0] and "exposed communication has been 36.7%" in exposed[2][0]
    assert GuideThresholds().crossed({"mfu": None, "gpu_busy_share": None}) == []
    busy = GuideThresholds()
    assert [len(busy.crossed({"gpu_busy_share": 0.7})) for _ in range(4)] == [0, 0, 1, 0]


@pytest.mark.parametrize("flags, says", [
    (["--context-parallel-size", "2"], "--log-grad-noise-scale cannot be combined with --context-parallel-size 2"),
    (["--num-experts", "4", "--expert-model-parallel-size", "2"], "with --expert-model-parallel-size 2"),
    (["--pipeline-model-parallel-size", "2"], "--pipeline-model-parallel-size 2 and tied embeddings"),
    (["--global-batch-size", "2", "--micro-batch-size", "2"], "needs at least two micro-batches per step"),
], ids=["cp", "ep", "pp-tied", "one-micro-batch"])
def test_noise_scale_is_refused_where_a_micro_batch_gradient_is_not_one_ranks(flags, says):
    from hybridlm.training.trainer import prepare_config
    world = 1 if "--global-batch-size" in flags else 2
    with pytest.raises(ConfigError) as refused:
        prepare_config(parse_args(TINY + ["--log-grad-noise-scale"] + flags), world_size=world)
    assert says in str(refused.value)


def test_a_comm_interval_below_one_is_refused():
    from hybridlm.training.trainer import prepare_config
    with pytest.raises(ConfigError, match="--log-comm-interval must be at least 1, got 0"):
        prepare_config(parse_args(TINY + ["--log-comm-interval", "0"]), world_size=1)


def test_the_monitors_figures_join_the_step_record_the_log_line_and_the_trackers_scalars(tmp_path, capsys):
    from hybridlm.config import ModelConfig
    from hybridlm.training.metrics import StepLog
    from hybridlm.training.moe_metrics import tracker_metrics
    model = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=512, seq_length=32)
    model.padded_vocab_size = 512
    figures = {"comm_sampled_iteration": 500, "comm_ms": 12.5, "comm_share": 0.2, "exposed_comm_share": 0.05,
               "exposed_comm_share_max": 0.08, "gpu_busy_share": 0.9, "comm_tp_ms": 10.0, "comm_other_ms": 2.5,
               "sampled_step_ms": 62.5, "comm_sample_overhead_ms": 300.0, "grad_noise_scale": 1234.5}
    log = StepLog(model, world_size=2, tokens_per_step=256, peak=None, metrics_file=str(tmp_path / "m.jsonl"), enabled=True)
    record = log.record(iteration=510, loss=2.0, lr=1e-4, grad_norm=1.0, step_seconds=0.1, total_iters=1000, monitor=figures)
    log.close()
    line = capsys.readouterr().out.splitlines()[1]
    assert line == ("    monitor | iteration 500 sampled: collectives 12.5 ms (tp 10.0, other 2.5), 20.0% of the step, exposed 5.0% "
                    "(worst rank 8.0%) | GPU busy 90.0% | grad noise scale 1,234 samples")
    assert figures.items() <= record.items()
    assert figures.items() <= tracker_metrics(record).items()
