"""The training monitor: the figures the Megatron-LM guide says to watch beside MFU, on the same log line,
``--metrics-file`` record and trackers as every other figure (README, "Monitoring").

The guide asks for MFU above 40%, GPU utilisation of 80-95%, communication taking no more than 30% of an
iteration, and an eye on the gradient noise scale. StepLog logs MFU; this module adds the rest, and says
once per run, on rank 0, when a threshold is crossed over a window of logged steps.

Communication and busy share (``--log-comm-interval N``). Every N-th step runs under torch.profiler, the
device synchronised before and after so the profiled window holds all of that step's kernels; the profile
is exported, read by ``timeline.analyse`` (time in collective kernels, the exposed share, the split by
process group, the busy share) and dropped. Only that step pays: the profiler's start and stop and the
slower step under it (counted in the logged step time), the export and the analysis (run in the logging
block, whose time the log's clock leaves out; logged as ``comm_sample_overhead_ms``). Each rank analyses
its own step; the figures are averaged over the ranks, with the worst rank's exposed share beside the
mean (a pipeline runs at its slowest stage's pace). Where nvidia-ml-py is installed, NVML's utilisation
(the share of its last sample period in which any kernel ran: what nvidia-smi shows) is read after every
step and averaged over the log interval; one small kernel keeps it at 100%, hence the busy share.

Gradient noise scale (``--log-grad-noise-scale``), McCandlish et al. 2018, "An Empirical Model of
Large-Batch Training", appendix A: B_simple = tr(Sigma) / |G|^2 (in samples) is about the batch size
beyond which a larger batch stops cutting the steps a run needs. From the squared norm of a gradient
over B_small samples and of one over B_big samples, the unbiased estimators are

    |G|^2    ~ (B_big |G_big|^2 - B_small |G_small|^2) / (B_big - B_small)
    tr Sigma ~ (|G_small|^2 - |G_big|^2) / (1/B_small - 1/B_big)

and each is smoothed by an exponential moving average over steps (decay 0.99, bias-corrected as Adam's
moments) before the ratio, as the paper does: a ratio of one step's noisy estimates is biased. The big
batch is the step's: its norm is the one DeepSpeed computes for clipping after every reduction
(``get_global_grad_norm``), free. The small batches are the step's K = DP x GAS micro-batches of
--micro-batch-size samples each; |G_small|^2 is their mean squared norm.

How the micro-batch norms are read inside DeepSpeed's engine: a tensor hook on every parameter
(``Tensor.register_hook``) receives the parameter's gradient from one micro-batch's backward before
autograd adds it into ``.grad``, hence before DeepSpeed's own hooks, which are post-accumulate ones (ZeRO
1/2 copy the gradient into their buckets and reduce them, ZeRO-3 reduce-scatters and frees it, ZeRO-0
all-reduces at the step's end). So it sees one rank's gradient of one micro-batch, before any reduction,
under every ZeRO stage and in the pipeline engine alike, and keeps its norm (fp32, on the device: no host
sync; one kernel a parameter a micro-batch), squared and summed at the step's end. The alternatives were
worse: the difference of the accumulated ``.grad`` between micro-batches needs a copy of the whole
gradient and does not exist under ZeRO-2/3 (which reduce and free ``.grad`` after each micro-batch); a
replica's gradient (all its micro-batches) would have to be read inside DeepSpeed's reduction, which
ZeRO-2/3 run bucket by bucket during backward. Micro-batches
also give K small batches a step instead of DP, and work on one GPU with accumulation.

The scale: under the loss contract (hybridlm.parallel.loss) the gradient a hook sees is the
micro-batch's mean gradient / GAS when micro-batches count equal tokens (pretraining), times the loss
scale under fp16; so |G_small|^2 = GAS^2 |hook gradient|^2 / scale^2. Fine-tuning's micro-batches count
different numbers of loss tokens: the estimate then weighs them as equal, an approximation. A parameter's
gradient is counted once per model: a TP-sharded one on every TP rank (the squared norms of the shards
add up), any other on TP rank 0 only (it is the same on every TP rank; sequence parallelism's norm weights
are summed over TP by a hook registered before this one). The EMA is linear, so each rank smooths its own
sum and one scalar all-reduce over the world at each logged step adds them up: no collective in the
other steps. Refused (``check_config``) where a micro-batch's gradient is not one rank's: context
parallelism, expert parallelism, a pipeline with tied embeddings, --gradient-accumulation-fusion.
"""
from __future__ import annotations

import json
import math
import os
import statistics
import sys
import tempfile
import time
from collections import deque
from contextlib import contextmanager
from typing import Optional

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile, record_function

from ..config import ConfigError, RunConfig
from ..config.fields import refuse_first
from .timeline import LABELS, SAMPLED_STEP, GroupMap, StepTimeline, analyse

NOISE_EMA_DECAY = 0.99
MFU_TARGET = 0.40  # the guide: MFU above 40%
EXPOSED_COMM_LIMIT = 0.30  # the guide: communication at most 30% of an iteration
BUSY_TARGET = 0.80  # the guide: GPU utilisation 80-95%
MFU_WINDOW = 5  # logged steps (after the first, which holds warm-up and compilation) whose median MFU is judged
SAMPLE_WINDOW = 3  # sampled steps whose mean shares are judged
SECTION = "README, 'Monitoring'"


def check_config(cfg: RunConfig) -> None:
    """The monitor's flags against the layout, before any process group (ConfigError, one sentence)."""
    t, p, m = cfg.train, cfg.parallel, cfg.model
    if t.log_comm_interval is not None and t.log_comm_interval < 1:
        raise ConfigError(f"--log-comm-interval must be at least 1, got {t.log_comm_interval}.")
    if not t.log_grad_noise_scale:
        return
    pp = p.pipeline_model_parallel_size
    refuse_first("--log-grad-noise-scale", (
        (p.context_parallel_size > 1, f"--context-parallel-size {p.context_parallel_size}: a micro-batch's gradient is "
                                      "then the sum of its CP ranks' gradients, which no rank holds"),
        (p.expert_model_parallel_size > 1, f"--expert-model-parallel-size {p.expert_model_parallel_size}: an expert's "
                                           "gradient then holds the tokens of every rank of its EP group"),
        (pp > 1 and not m.untie_embeddings_and_output_weights,
         f"--pipeline-model-parallel-size {pp} and tied embeddings: the tied weight's gradient is then split between "
         "the first and the last stage (add --untie-embeddings-and-output-weights)"),
        (m.gradient_accumulation_fusion, "--gradient-accumulation-fusion: the fused weight gradients bypass autograd's hooks"),
    ))
    if t.global_batch_size // t.micro_batch_size < 2:
        raise ConfigError(f"--log-grad-noise-scale needs at least two micro-batches per step to compare with the step's "
                          f"batch; --global-batch-size {t.global_batch_size} is one micro-batch of {t.micro_batch_size} "
                          "samples (raise --global-batch-size, or train with DP > 1).")


# ---------------------------------------------------------------- gradient noise scale

def noise_scale_estimates(small_sq, big_sq, b_small: float, b_big: float):
    """McCandlish et al.'s unbiased estimates (|G|^2, tr Sigma) from the mean squared norm of gradients over
    ``b_small`` samples and the squared norm of one over ``b_big`` samples (floats or tensors)."""
    true_sq = (b_big * big_sq - b_small * small_sq) / (b_big - b_small)
    trace = (small_sq - big_sq) / (1.0 / b_small - 1.0 / b_big)
    return true_sq, trace


class SmoothedNoiseScale:
    """Bias-corrected EMAs of a step's small- and big-batch squared norms, and B_simple from them (both
    estimators are linear in the two, so smoothing the inputs is smoothing the estimators)."""

    def __init__(self, b_small: int, b_big: int, decay: float = NOISE_EMA_DECAY, device=None):
        self.b_small, self.b_big, self.decay, self.steps = b_small, b_big, decay, 0
        self.small = torch.zeros((), dtype=torch.float64, device=device)
        self.big = torch.zeros((), dtype=torch.float64, device=device)

    def update(self, small_sq, big_sq) -> None:
        """In place on the device: no host sync."""
        keep = self.decay
        self.small.mul_(keep).add_(torch.as_tensor(small_sq, dtype=torch.float64, device=self.small.device), alpha=1 - keep)
        self.big.mul_(keep).add_(torch.as_tensor(big_sq, dtype=torch.float64, device=self.big.device), alpha=1 - keep)
        self.steps += 1

    def value(self, small_ema: Optional[float] = None) -> Optional[float]:
        """B_simple in samples; None before the first step and while an estimate is not positive (noise).
        ``small_ema``: the small-batch EMA summed over the ranks (default: this one's)."""
        if not self.steps:
            return None
        correction = 1.0 - self.decay ** self.steps
        small = (float(self.small) if small_ema is None else small_ema) / correction
        true_sq, trace = noise_scale_estimates(small, float(self.big) / correction, self.b_small, self.b_big)
        return trace / true_sq if true_sq > 0 and trace > 0 else None


def counted_parameters(module: torch.nn.Module, tp_rank: int) -> list[torch.nn.Parameter]:
    """The trained parameters whose gradient this rank adds to the model's squared norm."""
    return [p for p in module.parameters() if p.requires_grad and (tp_rank == 0 or getattr(p, "tensor_model_parallel", False))]


class GradNoiseScale:
    """Tensor hooks that sum this rank's micro-batch squared gradient norms over a step, and the EMA."""

    def __init__(self, module: torch.nn.Module, tp_rank: int, *, micro_batch_size: int, global_batch_size: int,
                 accumulation_steps: int, device):
        self.small_batches = global_batch_size // micro_batch_size
        self.accumulation = accumulation_steps
        self.ema = SmoothedNoiseScale(micro_batch_size, global_batch_size, device=device)
        self.device = device
        # this step's norms, one per parameter per micro-batch, squared and summed at its end: one kernel a hook where
        # adding each squared norm into one scalar launched three (norm, square, add). On an H200 (monitor-overhead) the
        # reference model's noise scale still costs 1.04% of a step, against 1.06% with three kernels: the norms' reads
        # of the gradients, not the launches, are most of it
        self._norms: list[torch.Tensor] = []
        self._handles = [p.register_hook(self._add) for p in counted_parameters(module, tp_rank)]

    def _add(self, grad: torch.Tensor) -> None:
        self._norms.append(torch.linalg.vector_norm(grad, dtype=torch.float32))

    def _step_sum(self) -> torch.Tensor:
        if not self._norms:
            return torch.zeros((), dtype=torch.float64, device=self.device)
        return torch.stack([n.to(self.device) for n in self._norms]).double().square().sum()

    def end_step(self, engine, loss_scale: float) -> None:
        """After the engine's step: smooth this step's sums in if the step applied (a skipped step's gradients are not finite)."""
        norm = engine.get_global_grad_norm()
        if engine.was_step_applied() and norm is not None:
            big_sq = torch.as_tensor(norm, dtype=torch.float64).to(self.device).square()
            mean_share = self.accumulation ** 2 / (self.small_batches * loss_scale ** 2)  # this rank's part of the mean
            self.ema.update(self._step_sum() * mean_share, big_sq)
        self._norms.clear()

    def value(self) -> Optional[float]:
        """B_simple over the whole world; collective (one scalar all-reduce)."""
        small = self.ema.small.clone()
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(small)
        return self.ema.value(float(small))

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()


def _loss_scale(engine) -> float:
    """The loss scale of the coming backward passes (fp16's dynamic one; 1 otherwise)."""
    if not engine.fp16_enabled():
        return 1.0
    optimizer = engine.optimizer
    return float(getattr(optimizer, "cur_scale", None) or getattr(optimizer, "loss_scale", 1.0))


# ---------------------------------------------------------------- sampled steps

def group_map(ps) -> GroupMap:
    """Labels of this rank's process groups (``ParallelState``), by name and by global ranks."""
    names: dict[str, str] = {}
    ranks: dict[tuple[int, ...], tuple[str, ...]] = {}
    for label, handle in (("dp", ps.grad_reduction), ("dp", ps.dp), ("dp", ps.expert_dp), ("tp", ps.tp), ("cp", ps.cp),
                          ("pp", ps.pp), ("ep", ps.ep)):
        if handle.size < 2 or handle.group is None:
            continue
        names.setdefault(str(handle.group.group_name), label)
        key = tuple(dist.get_process_group_ranks(handle.group))
        if label not in ranks.get(key, ()):
            ranks[key] = ranks.get(key, ()) + (label,)
    return GroupMap(names, ranks, pipeline=ps.pp.size > 1)


def _synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class CommSampler:
    """One torch.profiler session around every ``interval``-th step; the analysis waits for the next logged step."""

    def __init__(self, interval: int, groups: GroupMap):
        self.interval, self.groups = interval, groups
        self.pending = None  # (profile, iteration, seconds the profiler took to stop)
        self.last: Optional[StepTimeline] = None  # this rank's last analysed step

    def wants(self, iteration: int) -> bool:
        """Step ``iteration`` is sampled (not while another profiler runs: --profile-step-range)."""
        return iteration % self.interval == 0 and not torch._C._autograd._profiler_enabled()

    @contextmanager
    def around(self, iteration: int):
        self.pending = None  # two samples within one log interval: only the last one is reported
        _synchronize()
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        session = profile(activities=activities, record_shapes=False, with_stack=False)
        session.start()
        try:
            with record_function(SAMPLED_STEP):
                yield
                _synchronize()
        finally:
            started = time.perf_counter()
            session.stop()
            self.pending = (session, iteration, time.perf_counter() - started)

    def take(self) -> tuple[Optional[StepTimeline], int, float]:
        """Analyse the pending profile: (this rank's figures or None, its iteration, seconds spent on it besides the step)."""
        session, iteration, spent = self.pending
        self.pending = None
        started = time.perf_counter()
        try:
            with tempfile.TemporaryDirectory(prefix="hybridlm-monitor-") as folder:
                path = os.path.join(folder, "step.json")
                session.export_chrome_trace(path)
                with open(path) as f:
                    events = json.load(f).get("traceEvents", [])
            self.last = analyse(events, self.groups)
        except (OSError, ValueError, KeyError, TypeError) as e:  # the figures go missing, the run goes on
            print(f"warning: --log-comm-interval: the profile of iteration {iteration} could not be read ({e})",
                  file=sys.stderr, flush=True)
            self.last = None
        return self.last, iteration, spent + time.perf_counter() - started


def _nvml_ready() -> bool:
    """NVML through torch.cuda.utilization (it maps CUDA_VISIBLE_DEVICES), where nvidia-ml-py is installed."""
    if not torch.cuda.is_available():
        return False
    try:
        torch.cuda.utilization()
    except Exception:  # noqa: BLE001 - no pynvml, or no NVML on this machine: the figure is optional
        return False
    return True


# ---------------------------------------------------------------- the guide's thresholds

class GuideThresholds:
    """The Megatron-LM guide's thresholds over windows of logged records: each crossing is said once per run."""

    def __init__(self):
        self.warned: set[str] = set()
        self.logged = 0
        self.windows = {"mfu": deque(maxlen=MFU_WINDOW), "exposed_comm_share": deque(maxlen=SAMPLE_WINDOW),
                        "gpu_busy_share": deque(maxlen=SAMPLE_WINDOW)}

    def crossed(self, record: dict) -> list[str]:
        """The sentences of the thresholds this record's window crossed for the first time."""
        self.logged += 1
        sentences = []
        for key, window in self.windows.items():
            if record.get(key) is None or (key == "mfu" and self.logged == 1):  # the first interval holds warm-up and compilation
                continue
            window.append(record[key])
            if len(window) < window.maxlen or key in self.warned:
                continue
            sentence = self._judge(key, window)
            if sentence:
                self.warned.add(key)
                sentences.append(f"{sentence} ({SECTION}).")
        return sentences

    @staticmethod
    def _judge(key: str, window: deque) -> Optional[str]:
        if key == "mfu":
            median = statistics.median(window)
            return None if median >= MFU_TARGET else (
                f"MFU has been {100 * median:.1f}% (median of the last {len(window)} logged steps), below the "
                f"{100 * MFU_TARGET:.0f}% the Megatron-LM guide aims for; --log-comm-interval shows where the step's time goes")
        mean = sum(window) / len(window)
        if key == "exposed_comm_share" and mean > EXPOSED_COMM_LIMIT:
            return (f"exposed communication has been {100 * mean:.1f}% of the step (mean of the last {len(window)} sampled "
                    f"steps), above the {100 * EXPOSED_COMM_LIMIT:.0f}% the Megatron-LM guide allows")
        if key == "gpu_busy_share" and mean < BUSY_TARGET:
            return (f"the GPU ran kernels {100 * mean:.1f}% of the step (mean of the last {len(window)} sampled steps), "
                    f"below the {100 * BUSY_TARGET:.0f}% the Megatron-LM guide aims for")
        return None


# ---------------------------------------------------------------- the monitor the loop holds

class Monitor:
    """What the training loop calls: ``step`` around each training step, ``report`` in each logged step
    (collective), ``check`` on each logged record (rank 0 warns), ``close`` at the end."""

    def __init__(self, run, *, rank0: bool):
        t, ps = run.cfg.train, run.ps
        self.rank0, self.device = rank0, torch.device(run.engine.device)
        self.noise = None
        if t.log_grad_noise_scale:
            self.noise = GradNoiseScale(run.engine.module, ps.tp.rank, micro_batch_size=t.micro_batch_size,
                                        global_batch_size=t.global_batch_size,
                                        accumulation_steps=run.cfg.gradient_accumulation_steps, device=self.device)
        self.sampler = CommSampler(t.log_comm_interval, group_map(ps)) if t.log_comm_interval else None
        self.nvml: Optional[list[float]] = [] if self.sampler and _nvml_ready() else None
        sizes = {"tp": ps.tp.size, "cp": ps.cp.size, "dp": ps.grad_reduction.size, "pp": ps.pp.size, "ep": ps.ep.size}
        self.labels = [label for label in LABELS if sizes.get(label, 2) > 1]  # "other" always
        self.thresholds = GuideThresholds()
        if rank0 and (self.sampler or self.noise):
            print(f"hybridlm: {self.describe()}", flush=True)

    def describe(self) -> str:
        parts = []
        if self.sampler:
            parts.append(f"one step in {self.sampler.interval} profiled for its communication and GPU busy share"
                         + (", NVML utilisation every step" if self.nvml is not None else ""))
        if self.noise:
            n = self.noise
            parts.append(f"gradient noise scale from {n.small_batches} micro-batches of {n.ema.b_small} samples per step "
                         f"against the step's {n.ema.b_big} (EMA decay {n.ema.decay})")
        return "monitor: " + "; ".join(parts)

    @contextmanager
    def step(self, run):
        """Around one training step (``run.iteration`` is the count before it)."""
        scale = _loss_scale(run.engine) if self.noise else 1.0
        if self.sampler and self.sampler.wants(run.iteration + 1):
            with self.sampler.around(run.iteration + 1):
                yield
        else:
            yield
        if self.noise:
            self.noise.end_step(run.engine, scale)
        if self.nvml is not None:
            self.nvml.append(torch.cuda.utilization() / 100.0)

    def report(self) -> Optional[dict]:
        """The figures for this logged step. Collective: every rank calls it at every logged step."""
        values: dict = {}
        if self.sampler is not None and self.sampler.pending is not None:
            values.update(self._sample_figures(*self.sampler.take()))
        if self.nvml:
            values["nvml_gpu_utilization"] = sum(self.nvml) / len(self.nvml)
            self.nvml.clear()
        if self.noise is not None:
            values["grad_noise_scale"] = self.noise.value()
        return values or None

    def _sample_figures(self, timeline: Optional[StepTimeline], iteration: int, spent: float) -> dict:
        """Each rank's figures, averaged over the ranks (one all-gather), the exposed share's worst rank beside."""
        keys = ["sampled_step_ms", "comm_ms", "comm_share", "exposed_comm_share", "gpu_busy_share"]
        keys += [f"comm_{label}_ms" for label in self.labels]
        mine = [math.nan] * len(keys)
        if timeline is not None:
            mine = [timeline.step_ms, timeline.comm_ms, timeline.comm_share, timeline.exposed_comm_share, timeline.busy_share]
            mine += [timeline.by_group[label] for label in self.labels]
        local = torch.tensor([math.nan if v is None else v for v in mine] + [spent * 1e3], dtype=torch.float64,
                             device=self.device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            everyone = [torch.empty_like(local) for _ in range(dist.get_world_size())]
            dist.all_gather(everyone, local)
            table = torch.stack(everyone).cpu()
        else:
            table = local.cpu().unsqueeze(0)
        mean = table.nanmean(dim=0).tolist()
        known = ~table[:, 3].isnan()
        values = {"comm_sampled_iteration": iteration}
        values.update({key: None if math.isnan(v) else v for key, v in zip(keys, mean)})
        values["exposed_comm_share_max"] = float(table[known, 3].max()) if bool(known.any()) else None
        values["comm_sample_overhead_ms"] = float(table[:, -1].max())
        return values

    def check(self, record: dict) -> None:
        """Warn once per run where a logged figure crossed the guide's threshold over its window (rank 0)."""
        if self.rank0:
            for sentence in self.thresholds.crossed(record):
                print(f"warning: {sentence}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.noise is not None:
            self.noise.close()


def monitor_line(values: dict) -> str:
    """The log line of a logged step's monitor figures."""
    parts = []
    if values.get("comm_sampled_iteration") is not None:
        split = ", ".join(f"{k[5:-3]} {values[k]:.1f}" for k in values
                          if k.startswith("comm_") and k.endswith("_ms") and k[5:-3] in LABELS and values[k] is not None)
        part = f"iteration {values['comm_sampled_iteration']} sampled: collectives {_ms(values.get('comm_ms'))} ms ({split})"
        part += f", {_pct(values.get('comm_share'))} of the step"
        if values.get("exposed_comm_share") is not None:
            part += f", exposed {_pct(values['exposed_comm_share'])} (worst rank {_pct(values.get('exposed_comm_share_max'))})"
        if values.get("gpu_busy_share") is not None:
            part += f" | GPU busy {_pct(values['gpu_busy_share'])}"
        parts.append(part)
    if values.get("nvml_gpu_utilization") is not None:
        parts.append(f"NVML utilisation {_pct(values['nvml_gpu_utilization'])}")
    if "grad_noise_scale" in values:
        noise = values["grad_noise_scale"]
        parts.append(f"grad noise scale {'n/a' if noise is None else f'{noise:,.0f}'} samples")
    return "    monitor | " + " | ".join(parts)


def _pct(value) -> str:
    return "n/a" if value is None else f"{100 * value:.1f}%"


def _ms(value) -> str:
    return "n/a" if value is None else f"{value:.1f}"
