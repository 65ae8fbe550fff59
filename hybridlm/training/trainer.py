"""From a validated config to a trained model: ``prepare_config`` (flags + DeepSpeed JSON -> a
validated RunConfig, before any process group: bad input fails there), ``build_run`` (the set-up,
each part made from the ones before it), then the loop.
"""
from __future__ import annotations

import importlib.util
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Iterator, Optional

import deepspeed
import torch
import torch.distributed as dist
from torch.profiler import record_function
from deepspeed.accelerator import get_accelerator

from ..config import ConfigError, RunConfig, parse_args, pipeline_stage_layers, world_size_from_env
from ..data.samples import micro_batches
from ..data.tokenizers import build_tokenizer
from ..model.attention_backends import block_kernel_name, describe_block_kernel, resolve_backend
from ..model.cuda_graphs import capture_layers
from ..model.execution import apply_recompute, apply_selective_recompute, compile_layers
from ..model.specs import build_model, transformer_layers
from ..model.transformer_engine import (MicroBatchPhase, TEGroupedExperts, TELocalMatmul, TELocalNormMatmul, TELocalNormMLP,
                                        fp8_context, fp8_recipe, te_modules_in)
from ..model.wgrad_fusion import MainGrads
from ..model.weights import init_parameters
from ..ops import select_kernels
from ..parallel.lora import describe_adapters
from ..parallel.loss import LossReducer, aux_loss_scale
from ..parallel.moe import end_moe_step, set_aux_loss_scale
from ..parallel.plan import LayerFactory, LocalOps, ModelGroups
from ..parallel.random import seed_everything
from ..parallel.state import ParallelState
from ..planner.fit import check_fits, checked, device_memory_bytes
from . import checkpoint
from .deepspeed_muon import answer_muon_checks
from .distributed import device, init_distributed, on_gpu
from .ds_config import (check_gradient_accumulation_fusion, ds_config_of, finalize_ds_config, model_dtype, offload_device)
from .manual_gc import ManualGC
from .metrics import StepLog, peak_tflops
from .monitor import Monitor, check_config as check_monitor_config
from .moe_metrics import collect_moe_stats, tracker_metrics
from .optim import WarmupDecayLR, build_optimizer, check_optimizer_choice, continue_schedule, drop_startup_step
from .checkpoint_io import CheckpointSaveFailed
from .preemption import EXIT_CODE as REQUEUE_EXIT_CODE, EarlyExit, Interrupted, Preempted
from .profiling import StepProfiler
from .replicas import ReplicaCheck, ReplicasDiverged
from .save_lock import SaveLock
from .setup_clock import SetupClock
from .step import release_cached_memory, run_step
from .tasks import PretrainTask, build_task
from .tracking import build_trackers, check_backends, close_all, log_all, wandb_run_id


def prepare_config(cfg: RunConfig, world_size: Optional[int] = None) -> tuple[RunConfig, dict]:
    """Reconcile flags with the JSON and validate the layout. Raises ConfigError; touches no process group."""
    ds = ds_config_of(cfg)
    d = cfg.data
    if d.mock_data and d.data_path is not None:
        raise ConfigError("--mock-data cannot be combined with --data-path; give one of them.")
    if d.data_path is None and not d.mock_data and d.tokenizer_type != "ByteTokenizer" and cfg.posttrain.task == "pretrain":
        raise ConfigError(f"--tokenizer-type {d.tokenizer_type} needs --data-path (or --mock-data): the built-in corpus is stored as bytes.")
    tokenizer = build_tokenizer(d.tokenizer_type, d.tokenizer_model, d.vocab_file, d.merge_file, cfg.model.vocab_size)
    if cfg.model.vocab_size is None:
        cfg.model.vocab_size = tokenizer.vocab_size
    elif cfg.model.vocab_size < tokenizer.vocab_size:
        raise ConfigError(f"--vocab-size {cfg.model.vocab_size} is smaller than the tokenizer's {tokenizer.vocab_size}.")
    cfg.validate(world_size if world_size is not None else world_size_from_env())
    accelerator = get_accelerator()
    if cfg.train.fp16 and not accelerator.is_fp16_supported():
        raise ConfigError(f"--fp16 is not supported by DeepSpeed on this device ({accelerator.device_name()}); use --bf16 or fp32.")
    if cfg.train.bf16 and not accelerator.is_bf16_supported():
        raise ConfigError(f"--bf16 is not supported by DeepSpeed on this device ({accelerator.device_name()}); use fp32.")
    check_model_impl(cfg)
    build_task(cfg).check()
    checkpoint.refuse_overwrite(cfg.train.save, cfg.train.load)
    checkpoint.check_load(cfg.train.load, cfg.train.ckpt_step, cfg)
    cfg.train.base_checkpoint = checkpoint.quantized_base(cfg)
    StepProfiler.parse(cfg.train.profile_step_range)
    check_monitor_config(cfg)
    check_backends(wandb_project=cfg.train.wandb_project, tensorboard_dir=cfg.train.tensorboard_dir)
    ds = finalize_ds_config(ds, cfg)
    offloaded = [w for w in ("optimizer", "param") if offload_device(ds, w)]
    check_optimizer_choice(cfg.train, ds, offloaded)
    if cfg.model.cuda_graphs and offloaded:
        raise ConfigError(f"--cuda-graphs cannot be combined with offload_{offloaded[0]} (in {cfg.train.deepspeed_config}): "
                          "captured graphs with offloaded ZeRO state have not been checked.")
    if cfg.model.gradient_accumulation_fusion:
        check_gradient_accumulation_fusion(ds, cfg, offloaded)
    device_bytes = device_memory_bytes()
    if device_bytes is not None and checked(cfg):
        check_fits(cfg, ds, device_bytes)
    return cfg, ds


def check_model_impl(cfg: RunConfig) -> str:
    """The attention kernels and linear-layer library are usable here: resolves the attention core and
    (under CP's ring or all-gather) its block kernel once, and returns the attention line for the log."""
    m = cfg.model
    try:
        backend, why = resolve_backend(m.attention_backend, m.attention_dropout, m.graphed_attention_shape,
                                       packing=m.packed_samples, half_precision=m.half_precision)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    line = f"attention {backend} ({why})"
    if cfg.parallel.context_parallel_size > 1 and cfg.parallel.cp_comm_type != "a2a":
        m.attention_block_kernel = block_kernel_name(backend, m.half_precision, on_gpu())
        line += f"; CP {cfg.parallel.cp_comm_type} blocks on {describe_block_kernel(m.attention_block_kernel)} kernel"
    te_usable = importlib.util.find_spec("transformer_engine") is not None and torch.cuda.is_available()
    if m.cuda_graphs and not te_usable:
        raise ConfigError("--cuda-graphs needs a CUDA GPU and Transformer Engine, whose make_graphed_callables captures the layers "
                          "(pip install transformer-engine[pytorch]).")
    if m.transformer_impl == "transformer_engine":
        if not te_usable:
            raise ConfigError("--transformer-impl transformer_engine needs Transformer Engine and a CUDA GPU "
                              "(pip install transformer-engine[pytorch]).")
        if m.fp8_format and cfg.parallel.recompute_granularity:
            raise ConfigError("--fp8-format cannot be combined with --recompute-granularity yet: recomputing an FP8 "
                              "layer needs Transformer Engine's own checkpointing to replay its scaling state.")
    return line


SAVE_FAILED_EXIT_CODE = 74  # sysexits.h EX_IOERR: the run stopped because a checkpoint could not be written


class TrainingStopped(RuntimeError):
    """The run cannot usefully go on (e.g. too many skipped steps); the message says why."""


@dataclass
class Run:
    cfg: RunConfig
    ps: ParallelState
    engine: object
    is_pipeline: bool
    train_data: object = None  # anything with .batch(first, count) -> (inputs, labels)
    valid_data: object = None
    task: Optional[PretrainTask] = None  # what the loop trains (--task; default pretraining): data, loss, step micro-batches, log values
    iteration: int = 0
    phase: MicroBatchPhase = field(default_factory=MicroBatchPhase)  # read by TE's FP8 weight cache
    main_grads: Optional[MainGrads] = None  # --gradient-accumulation-fusion: zeroed before each step
    wandb_run_id: Optional[str] = None  # rank 0's W&B run, stored in checkpoints so a resume continues it
    setup: Optional[SetupClock] = None  # how long build_run's parts took (printed before the first step)

    def __post_init__(self):
        if self.task is None:
            self.task = PretrainTask(self.cfg)

    @property
    def tokens_per_step(self) -> int:
        return self.cfg.train.global_batch_size * self.task.rows_per_sample * self.cfg.model.seq_length


def build_run(cfg: RunConfig, ds_config: dict, clock: Optional[SetupClock] = None) -> Run:
    """Everything after validation, each part built from the ones before it: process groups, the
    model (its layers, weights and execution policy), the engine around it, the resumed state,
    and CUDA graphs of the layers where the engine placed them; ``clock`` times each part."""
    clock = clock or SetupClock()
    task = build_task(cfg)
    with clock.phase("process groups"):
        ps = start_process_groups(cfg)
    with clock.phase("model"):
        phase = MicroBatchPhase()  # where a forward sits in the step: TE's FP8 weight cache reads it
        factory = layer_factory(cfg, ps, phase)
        reducer = LossReducer(ps.tp, ps.cp, factory.sequence_parallel)
        recipe = fp8_recipe(cfg.model)
        model = build_model(cfg.model, factory, topology=ps.topology, loss=task.loss(reducer),
                            layer_context=lambda: fp8_context(recipe), stage_layers=uneven_stage_layers(cfg))
        init_parameters(model, cfg.train.seed, ps.tp, ps.ep)
        set_aux_loss_scale(model, aux_loss_scale(cfg.gradient_accumulation_steps))
        apply_execution_policy(cfg, model, reducer)
        # before deepspeed.initialize: its gradient hooks must come after the fusion's
        main_grads = MainGrads(te_modules_in(model), model_dtype(cfg)) if cfg.model.gradient_accumulation_fusion else None
    with clock.phase("engine"):
        engine = start_engine(cfg, ds_config, model, ps)
    with clock.phase("data"):
        datasets = task.datasets()
    run = Run(cfg, ps, engine, cfg.parallel.pipeline_model_parallel_size > 1, *datasets, task, phase=phase,
              main_grads=main_grads, setup=clock)
    with clock.phase("checkpoint" if cfg.train.load else "task"):
        resume(run)
    if cfg.model.cuda_graphs:
        with clock.phase("CUDA graphs"):
            capture(run, recipe)
    return run


def start_process_groups(cfg: RunConfig) -> ParallelState:
    """The process group, the layout's groups, the seeds, and DeepSpeed's activation checkpointing."""
    init_distributed(cfg.train.distributed_timeout_minutes)
    p = cfg.parallel
    ps = ParallelState(tp=p.tensor_model_parallel_size, pp=p.pipeline_model_parallel_size,
                       dp=p.data_parallel_size, ep=p.expert_model_parallel_size, cp=p.context_parallel_size)
    seed_everything(cfg.train.seed, ps.tp.rank, ps.pp.rank)
    if p.recompute_granularity:
        deepspeed.checkpointing.configure(ps, partition_activations=p.partition_activations)
    return ps


def layer_factory(cfg: RunConfig, ps: ParallelState, phase: MicroBatchPhase) -> LayerFactory:
    """The factory the blocks are built with: this layout's groups, and the rank-local implementations
    (--transformer-impl's GEMMs, --fused-ops' kernels)."""
    p = cfg.parallel
    kernels = select_kernels(cfg.model.fused_op_names(), require=cfg.model.require_fused_ops, device=device())
    ops = LocalOps(kernels=kernels)
    if cfg.model.transformer_impl == "transformer_engine":
        # the experts through TE only in FP8: in bf16 torch's one grouped GEMM needs no host sync and no padding
        experts = partial(TEGroupedExperts, phase=phase) if cfg.model.fp8_format else None
        ops = LocalOps(kernels=kernels, matmul=partial(TELocalMatmul, phase=phase),
                       norm_matmul=partial(TELocalNormMatmul, phase=phase), norm_mlp=partial(TELocalNormMLP, phase=phase),
                       grouped_experts=experts)
    return LayerFactory(ModelGroups.of(ps), sequence_parallel=p.sequence_parallel, cp_comm_type=p.cp_comm_type, ops=ops,
                        device=device())


def uneven_stage_layers(cfg: RunConfig) -> Optional[list[int]]:
    """Transformer layers per pipeline stage when the run asks for an uneven split, else None."""
    p = cfg.parallel
    if p.decoder_first_pipeline_num_layers is None and p.decoder_last_pipeline_num_layers is None:
        return None
    return pipeline_stage_layers(cfg.model.num_layers, p.pipeline_model_parallel_size,
                                 p.decoder_first_pipeline_num_layers, p.decoder_last_pipeline_num_layers)


def apply_execution_policy(cfg: RunConfig, model, reducer: LossReducer) -> None:
    """Recompute, then compile (hybridlm.model.execution), on the initialised model."""
    p = cfg.parallel
    if p.recompute_granularity == "full":
        apply_recompute(model, p.recompute_num_layers, p.recompute_method)
    if p.recompute_granularity == "selective":
        apply_selective_recompute(model, p.recompute_modules)
    if cfg.model.torch_compile:
        compile_layers(model, cfg.model.torch_compile_backend)
        reducer.compile(cfg.model.torch_compile_backend)


def start_engine(cfg: RunConfig, ds_config: dict, model, ps: ParallelState):
    """The optimizer (ours unless the JSON names one) and deepspeed.initialize around the model."""
    p, t = cfg.parallel, cfg.train
    answer_muon_checks(ds_config)
    offloading = offload_device(ds_config, "optimizer") is not None
    optimizer = None
    if "optimizer" not in ds_config:
        optimizer, clips_itself = build_optimizer(model, t, ps, zero_stage=p.zero_stage, offloading=offloading, on_gpu=on_gpu())
        if clips_itself:
            ds_config["gradient_clipping"] = 0.0
        if offloading and not type(optimizer).__name__.startswith("DeepSpeed"):
            ds_config["zero_force_ds_cpu_optimizer"] = False
        if t.use_precision_aware_optimizer:  # ZeRO runs the optimizers it knows by name unless told (moment_adamw.py)
            ds_config["zero_allow_untested_optimizer"] = True
    engine, _, _, _ = deepspeed.initialize(
        model=model, optimizer=optimizer, config=ds_config,
        model_parameters=None if optimizer is not None else [q for q in model.parameters() if q.requires_grad],
        lr_scheduler=lambda opt: WarmupDecayLR.from_config(opt, t), mpu=None if p.pipeline_model_parallel_size > 1 else ps)
    drop_startup_step(engine)
    return engine


def resume(run: Run) -> None:
    """What the task computes before the weights are loaded, --load, and what it computes after."""
    t = run.cfg.train
    run.task.prepare(run)  # DPO: the reference log-probabilities, before the policy is loaded
    if t.load:
        client_state = checkpoint.load(run.engine, t.load, t.ckpt_step, cfg=run.cfg, ps=run.ps)
        if client_state is None:
            if dist.get_rank() == 0:  # Megatron's start from scratch, on which a requeued job's first run relies
                print(f"warning: {checkpoint.no_checkpoint_reason(t.load)}: training starts from scratch at iteration 0, "
                      "as Megatron-LM does; check the path if this run was meant to resume.", file=sys.stderr, flush=True)
        else:
            run.iteration = client_state["iteration"]
            run.wandb_run_id = client_state.get("wandb_run_id")
            line = continue_schedule(run.engine.lr_scheduler, run.iteration, skipped=run.engine.skipped_steps,
                                     load_optim=t.load_optim)
            if line and dist.get_rank() == 0:
                print(f"hybridlm: --load {t.load}: {line}.", flush=True)
    run.task.loaded(run)


def capture(run: Run, recipe) -> None:
    """Capture the layers as CUDA graphs, after DeepSpeed placed the parameters and any resume loaded them."""
    m, t = run.cfg.model, run.cfg.train
    layers = transformer_layers(run.engine.module)
    release_parameter_views(p for layer in layers for p in layer.parameters())
    start = time.perf_counter()
    capture_layers(layers, (m.seq_length, t.micro_batch_size, m.hidden_size), recipe=recipe, phase=run.phase)
    if dist.get_rank() == 0:
        print(f"captured {len(layers)} layers as CUDA graphs in {time.perf_counter() - start:.1f} s", flush=True)


def release_parameter_views(params) -> None:
    """Detach the views of parameters that DeepSpeed's ZeRO 1/2 keep for their fp32 mapping
    (``param._hp_mapping.lp_fragment = param.flatten().narrow(...)``, made with grad enabled).

    Such a view keeps the parameter's gradient-accumulation node alive, and with it the stream
    it was made on (the default stream); a backward pass captured on another stream then has
    to wait on the default stream, which capture forbids. The detached view is the same memory."""
    for param in params:
        mapping = getattr(param, "_hp_mapping", None)
        fragment = getattr(mapping, "lp_fragment", None)
        if fragment is not None and fragment.grad_fn is not None:
            mapping.lp_fragment = fragment.detach()


def build_datasets(cfg: RunConfig) -> tuple:
    """Train and validation data of the run's task (collective: one rank builds index caches, the others wait)."""
    return build_task(cfg).datasets()


def data_iterator(run: Run, data=None, start_iteration: int | None = None) -> Iterator:
    """Micro-batches of this DP rank, from the training data at the current iteration by default."""
    t = run.cfg.train
    return micro_batches(data if data is not None else run.train_data, micro_batch_size=t.micro_batch_size,
                         global_batch_size=t.global_batch_size, dp_rank=run.ps.dp.rank, dp_size=run.ps.dp.size,
                         start_iteration=run.iteration if start_iteration is None else start_iteration, device=device(),
                         cp_rank=run.ps.cp.rank, cp_size=run.ps.cp.size)


def evaluations_before(iteration: int, eval_interval: int) -> int:
    """How many evaluations a run made before the one at ``iteration`` (one every ``eval_interval``
    steps, and one at the end when that is not on the interval)."""
    return -(-iteration // eval_interval) - 1


@torch.no_grad()
def evaluate(run: Run, data=None, iters: Optional[int] = None) -> float:
    """Mean loss over ``iters`` (``--eval-iters``) global batches of ``data`` (every rank), each global
    batch as the task's loss sees it in training. On the validation split (the default), as in
    Megatron-LM, each evaluation draws the batches after the previous one's, so the validation samples
    are fresh each time (and the same after a resume); other data is read from its start."""
    t = run.cfg.train
    first = evaluations_before(run.iteration, t.eval_interval) * t.eval_iters if data is None else 0
    batches = data_iterator(run, run.valid_data if data is None else data, start_iteration=first)
    losses = []
    for _ in range(t.eval_iters if iters is None else iters):
        release_cached_memory(run, 1)
        losses.append(run_step(run, run.task.step_batches(run, batches), train=False).float())
    return torch.stack(losses).mean().item()


def train_step(run: Run, batches: Iterator) -> torch.Tensor:
    """One optimizer step over the global batch; returns the loss averaged over it (every rank)."""
    loss = run_step(run, run.task.step_batches(run, batches), train=True)
    if run.cfg.model.num_experts is not None:
        end_moe_step(run.engine.module, run.ps.grad_reduction, run.cfg.model.moe_router_bias_update_rate)
    run.iteration += 1
    return loss


def check_replicas_at_start(run: Run) -> Optional[ReplicaCheck]:
    """--check-weight-hash-across-dp-replicas-interval: the check, made once before the first step (after a resume
    too, as Megatron does); None when the flag is off."""
    if run.cfg.train.check_weight_hash_across_dp_replicas_interval is None:
        return None
    replicas = ReplicaCheck(run.engine.module, run.ps.grad_reduction, run.ps.expert_dp)
    replicas.check(run.iteration)
    if dist.get_rank() == 0:
        print(f"hybridlm: replica check every {run.cfg.train.check_weight_hash_across_dp_replicas_interval} steps: "
              f"{replicas.describe()}; the replicas agree at iteration {run.iteration} ({1000 * replicas.last_seconds:.1f} ms)",
              flush=True)
    return replicas


def save_checkpoint(run: Run) -> None:
    t = run.cfg.train
    checkpoint.save(run.engine, t.save, iteration=run.iteration, keep_last=t.keep_last_n_checkpoints,
                    client_state={"consumed_samples": run.iteration * t.global_batch_size,
                                  "wandb_run_id": run.wandb_run_id}, cfg=run.cfg, ps=run.ps, text_files=run.task.checkpoint_files(),
                    rank_state=run.task.rank_state())


def pretrain(argv: Optional[list[str]] = None, parse=parse_args) -> list[dict]:
    """The whole job (any --task). Returns the logged records (for tests and benchmarks)."""
    started = time.monotonic()  # --exit-duration-in-mins counts from here, as Megatron's from its start-up
    clock = SetupClock()
    with clock.phase("flags"):
        cfg, ds_config = prepare_config(parse(argv))
    lock = SaveLock.for_run(cfg)
    early_exit = EarlyExit(cfg.train, started)  # before the slow set-up: a signal may come during it
    try:
        return train(cfg, ds_config, early_exit, clock)
    finally:  # whatever ended the run: the signal dispositions it found, and --save free for the next run
        early_exit.restore()
        if lock is not None:
            lock.release()


def train(cfg: RunConfig, ds_config: dict, early_exit: EarlyExit, clock: Optional[SetupClock] = None) -> list[dict]:
    """The job after validation: set-up, the loop, the final save."""
    run = build_run(cfg, ds_config, clock)
    t = cfg.train
    rank0 = dist.get_rank() == 0
    if run.iteration >= t.train_iters:  # a requeue after the end, or a shorter --train-iters: exit 0 as Megatron does
        if rank0:
            samples = t.train_samples is not None
            flag = "--train-samples" if samples else "--train-iters"
            end = f"{flag} {t.train_samples}, {t.train_iters} iterations" if samples else f"{flag} {t.train_iters}"
            print(f"hybridlm: --load {t.load} is at iteration {run.iteration}, at or past this run's end ({end}): nothing to "
                  f"train; raise {flag} to train further.", flush=True)
        return []
    log = StepLog(cfg.model, world_size=dist.get_world_size(), tokens_per_step=run.tokens_per_step,
                  peak=peak_tflops(t.peak_tflops), metrics_file=t.metrics_file, enabled=rank0)
    if rank0:
        print(f"hybridlm: {run.ps} | TP={cfg.parallel.tensor_model_parallel_size} PP={cfg.parallel.pipeline_model_parallel_size} "
              f"DP={cfg.parallel.data_parallel_size} CP={cfg.parallel.context_parallel_size} EP={cfg.parallel.expert_model_parallel_size} "
              f"SP={cfg.parallel.sequence_parallel} ZeRO={cfg.parallel.zero_stage} | "
              f"global batch {t.global_batch_size} x {cfg.model.seq_length} tokens | {t.train_iters} steps | "
              f"{check_model_impl(cfg)}", flush=True)
        for line in cfg.notes:  # what the Megatron-LM flags given map to here
            print(f"hybridlm: {line}", flush=True)
        if run.task.describe():
            print(f"hybridlm: {run.task.describe()}", flush=True)
        if cfg.model.lora_rank:
            print(f"hybridlm: {describe_adapters(run.engine.module, cfg.model)}", flush=True)
        print(f"hybridlm: {run.setup.line()}", flush=True)
    if t.save and rank0:
        checkpoint.write_run_files(t.save, cfg, ds_config)
    trackers = build_trackers(rank=dist.get_rank(), wandb_project=t.wandb_project, wandb_name=t.wandb_name,
                              wandb_dir=t.wandb_dir or t.save, tensorboard_dir=t.tensorboard_dir,
                              config=cfg.to_dict(), wandb_resume_id=run.wandb_run_id)
    run.wandb_run_id = wandb_run_id(trackers) or run.wandb_run_id
    replicas = check_replicas_at_start(run)
    profiler = StepProfiler(t.profile_step_range, t.profile_dir, dist.get_rank())
    profiler.step(run.iteration)  # a range starting at the first iteration starts here
    monitor = Monitor(run, rank0=rank0)  # --log-comm-interval, --log-grad-noise-scale, the guide's thresholds
    batches = data_iterator(run)
    records = []
    collector = ManualGC(t.manual_gc, t.manual_gc_interval)
    last_logged, started = run.iteration, time.perf_counter()
    consecutive_bad = 0
    stop = None
    while run.iteration < t.train_iters:
        lr = run.engine.get_lr()[0]
        with monitor.step(run):
            loss = train_step(run, batches)
        release_cached_memory(run, 1)
        collector.after_step(run.iteration)
        profiler.step(run.iteration)
        if run.engine.was_step_applied():
            consecutive_bad = 0
        else:
            consecutive_bad += 1
            if rank0:
                print(f"iteration {run.iteration}: step skipped (overflowing or non-finite gradients), "
                      f"{consecutive_bad} in a row, {run.engine.skipped_steps} in all", flush=True)
            if t.max_bad_steps and consecutive_bad >= t.max_bad_steps:
                raise TrainingStopped(f"{consecutive_bad} consecutive steps were skipped for overflowing or non-finite "
                                      f"gradients (the last at iteration {run.iteration}); stopping as --max-bad-steps "
                                      f"{t.max_bad_steps} says. Lower --lr or check the data.")
        if run.iteration % t.log_interval == 0 or run.iteration == t.train_iters:
            with record_function("hybridlm.log"):
                loss_value = loss.item()  # synchronises the device, so the clock below is honest
                now = time.perf_counter()
                grad_norm = run.engine.get_global_grad_norm()
                moe = collect_moe_stats(run.engine.module, cfg, run.ps)  # collective; None for a dense model
                extra = run.task.log_values(run, now - started)  # collective
                monitored = monitor.report()  # collective
                records.append(log.record(iteration=run.iteration, loss=loss_value, lr=lr, skipped_steps=run.engine.skipped_steps,
                                          grad_norm=float(grad_norm) if grad_norm is not None else None,
                                          step_seconds=(now - started) / (run.iteration - last_logged),
                                          total_iters=t.train_iters, moe=moe, monitor=monitored, extra=extra))
                log_all(trackers, tracker_metrics(records[-1]), run.iteration)
                monitor.check(records[-1])
                last_logged, started = run.iteration, time.perf_counter()
        if t.eval_interval and (run.iteration % t.eval_interval == 0 or run.iteration == t.train_iters):
            collector.collect()
            valid_loss = evaluate(run)
            collector.collect()
            records.append(log.record_eval(iteration=run.iteration, loss=valid_loss))
            log_all(trackers, {"valid_loss": valid_loss, "valid_ppl": records[-1]["valid_ppl"]}, run.iteration)
            started = time.perf_counter()  # evaluation time is not training time
        if replicas is not None and run.iteration % t.check_weight_hash_across_dp_replicas_interval == 0:
            replicas.check(run.iteration)  # before a save: diverged replicas are never written as one model
        if t.save and t.save_interval and run.iteration % t.save_interval == 0:
            save_checkpoint(run)
        stop = early_exit.reason(run.iteration, device()) if run.iteration < t.train_iters else None
        if stop:
            break  # every rank saves below, at the same iteration
    early_exit.saving()  # a stop signal from here on waits for this save
    if t.save and checkpoint.latest_tag(t.save) != checkpoint.tag_for(run.iteration):
        save_checkpoint(run)
    profiler.close()
    monitor.close()
    collector.close()
    close_all(trackers)
    log.close()
    if run.iteration < t.train_iters and early_exit.stopped_by:
        raise Interrupted(f"{early_exit.stopped_by} received: saved {checkpoint.tag_for(run.iteration)} to {t.save} and stopped at "
                          f"iteration {run.iteration} of {t.train_iters}; continue with --load {t.save}",
                          signal.Signals[early_exit.stopped_by])
    if run.iteration < t.train_iters and stop == "signal":
        raise Preempted(f"{t.exit_signal} received: saved {checkpoint.tag_for(run.iteration)} in {t.save} and stopped "
                        f"at iteration {run.iteration} of {t.train_iters}")
    if run.iteration < t.train_iters and rank0:
        saved = f"saved {checkpoint.tag_for(run.iteration)} in {t.save} and " if t.save else ""
        print(f"hybridlm: {stop}: {saved}stopped at iteration {run.iteration} of {t.train_iters}", flush=True)
    return records


def main(argv: Optional[list[str]] = None, parse=parse_args) -> int:
    """Entry point for scripts/pretrain.py (and finetune.py, with its ``parse``): bad input is one
    sentence and exit code 2 on every rank."""
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    try:
        pretrain(argv, parse)
    except (ConfigError, TrainingStopped, ReplicasDiverged, CheckpointSaveFailed) as e:
        print(f"error: {e}", flush=True, file=sys.stderr)
        return 2 if isinstance(e, ConfigError) else SAVE_FAILED_EXIT_CODE if isinstance(e, CheckpointSaveFailed) else 3
    except Preempted as e:
        if dist.get_rank() == 0:
            print(f"hybridlm: {e}; exit code {REQUEUE_EXIT_CODE} asks for a requeue", flush=True)
        code = REQUEUE_EXIT_CODE
    except Interrupted as e:
        if dist.get_rank() == 0:
            print(f"hybridlm: {e}.", flush=True)
        code = e.exit_code
    else:
        code = 0
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return code
