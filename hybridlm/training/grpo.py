"""GRPO's batches: prompts -> completions (``rollout.Sampler``) -> rewards -> advantages -> the
rows the engine trains on, with the log-probabilities the loss compares against.

Definitions follow TRL 1.16.0's ``GRPOTrainer`` (``_generate_and_score_completions``, read in its
source): the reward is the weighted sum of the functions' rewards (NaN-skipping; a completion no
function scores gets advantage 0); the advantage is the reward minus its group's mean (the G
completions of one prompt), divided by the group's standard deviation (``group``, Bessel-corrected)
or the whole global batch's (``batch``) plus 1e-4, or not divided (``none``). The aggregation of
each ``--loss-type`` is in ``hybridlm.training.losses``.

What differs from TRL: a DP replica samples all G completions of its prompts (TRL spreads them over
processes), so groups never cross ranks and only ``batch`` scaling talks to the other replicas;
``--global-batch-size`` is the number of completions one optimizer step trains on, and rollouts are
made once per ``--num-iterations`` steps (TRL's ``steps_per_generation`` is the accumulation steps
here: one rollout batch is one global batch). A completion row is the prompt followed by the
completion, right-padded to the micro-batch's longest (a multiple of what CP and SP need): the
labels are the completion's tokens, the stop token included, so prompt and padding take no part.
"""
from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from ..config import ConfigError
from ..data.prompts import completion_text
from ..data.samples import context_slice, to_device, with_positions
from ..parallel.tensor_parallel import IGNORE_INDEX
from .distributed import device, on_gpu
from .losses import GRPO_METRICS, grpo_weights
from .rewards import RewardError, score
from .step import run_step

ROW_ALIGNMENT = 8  # rows are padded to a multiple of this (and of what CP and SP need): fewer distinct shapes


@dataclass
class RolloutRows:
    """A DP replica's completions of one rollout, in order (a prompt's G completions together). ``old``
    and ``reference``: log-probabilities per completion token, when given rather than computed (tests)."""
    prompts: list  # token ids of each completion's prompt
    completions: list  # token ids of each completion (its stop token, when one ended it, last)
    truncated: list  # no stop token within --max-completion-length
    advantages: list
    old: Optional[list] = None
    reference: Optional[list] = None


@dataclass
class RolloutBatch:
    """The engine's micro-batches of one rollout: valid for ``--num-iterations`` steps from ``first_iteration``."""
    micro_batches: list  # (inputs, (labels, old, reference, advantages, weights)) on the device, this rank's CP slice
    counts: torch.Tensor  # [1] this rank's share of the step's count (the loss type's)
    first_iteration: int
    on_policy: bool  # no old log-probs: the ratio is 1 (one step per rollout)
    trained_tokens: int  # positions of this replica's rows, padding left out (for the training rate)
    scales: Optional[torch.Tensor] = None  # the step's loss scale, once the counts are reduced


@dataclass
class RolloutStats:
    """Sums over the rollouts since the last log (this DP replica's), read by ``log_values``."""
    names: list
    completions: float = 0.0
    tokens: float = 0.0
    truncated: float = 0.0
    longest: float = 0.0
    rewards: np.ndarray = None  # [functions + 1 (the weighted sum), 3]: count, sum, sum of squares
    trained_tokens: float = 0.0
    rollout_seconds: float = 0.0
    logprob_seconds: float = 0.0
    steps: int = 0

    def __post_init__(self):
        if self.rewards is None:
            self.rewards = np.zeros((len(self.names) + 1, 3))

    def add(self, completions, rewards: np.ndarray, weighted: np.ndarray) -> None:
        """One rollout's completions and their rewards [n, functions] and weighted sums [n]."""
        lengths = [len(c) for c in completions.tokens]
        self.completions += len(lengths)
        self.tokens += sum(lengths)
        self.truncated += sum(completions.truncated)
        self.longest = max(self.longest, max(lengths))
        for j, column in enumerate(list(rewards.T) + [weighted]):
            valid = column[~np.isnan(column)]
            self.rewards[j] += (len(valid), valid.sum(), (valid ** 2).sum())


def advantages_of(rewards: np.ndarray, weights: np.ndarray, generations: int, scale: str, dp) -> tuple[np.ndarray, np.ndarray]:
    """(advantages [n], weighted rewards [n]) of rewards [n, functions] (NaN: unscored) for a replica's
    rows in groups of ``generations``; ``batch`` scaling reduces over ``dp`` (every replica calls)."""
    weighted = np.nansum(rewards * weights, axis=1)
    weighted[np.isnan(rewards).all(axis=1)] = np.nan
    grouped = weighted.reshape(-1, generations)
    mean = np.repeat(_nanmean(grouped), generations)
    if scale == "group":
        std = np.repeat(_nanstd(grouped), generations)
    elif scale == "batch":
        valid = ~np.isnan(weighted)
        moments = torch.tensor([valid.sum(), weighted[valid].sum(), (weighted[valid] ** 2).sum()], dtype=torch.float64,
                               device=device())
        if dp.size > 1:
            dist.all_reduce(moments, group=dp.group)
        n, total, squares = moments.tolist()
        std = np.full(len(weighted), math.sqrt(max(squares - total * total / n, 0.0) / (n - 1)) if n > 1 else np.nan)
    advantages = weighted - mean
    if scale != "none":
        advantages = advantages / (std + 1e-4)
    return np.nan_to_num(advantages, nan=0.0), weighted


def _nanmean(grouped: np.ndarray) -> np.ndarray:
    counts = (~np.isnan(grouped)).sum(axis=1)
    return np.where(counts > 0, np.nansum(grouped, axis=1) / np.maximum(counts, 1), np.nan)


def _nanstd(grouped: np.ndarray) -> np.ndarray:
    """Bessel-corrected standard deviation per row, NaN ignored (NaN with fewer than 2 values)."""
    counts = (~np.isnan(grouped)).sum(axis=1)
    deviations = np.nansum((grouped - _nanmean(grouped)[:, None]) ** 2, axis=1)
    return np.where(counts > 1, np.sqrt(deviations / np.maximum(counts - 1, 1)), np.nan)


def reward_inputs(tokenizer, stops, prompt_set, prompts: list, completions) -> dict:
    """What the reward functions are called with (``hybridlm.training.rewards``) for a replica's rows."""
    texts = [completion_text(tokenizer, ids, stops) for ids in completions.tokens]
    return {"prompts": [p.given for p in prompts], "completion_ids": completions.tokens,
            "completions": [[{"role": "assistant", "content": x}] if p.conversational else x for p, x in zip(prompts, texts)],
            "columns": {name: [p.columns.get(name) for p in prompts] for name in prompt_set.column_names}}


def shared_rewards(run, compute, functions: int) -> np.ndarray:
    """``compute()``'s [rows, functions] rewards, called on the replica's first rank (TP and CP rank 0)
    and broadcast to its others: a reward function runs once per row, and every rank of the replica
    trains on the same numbers even if the function is not deterministic. A failure there is raised
    on every rank of the replica (the others would otherwise wait for it until the timeout)."""
    ps = run.ps
    rows = run.cfg.train.global_batch_size // ps.dp.size
    shared = torch.full((rows, functions + 1), float("nan"), dtype=torch.float64, device=device())
    failure = None
    if ps.tp.rank == 0 and ps.cp.rank == 0:
        try:
            shared[:, :functions] = torch.from_numpy(compute())
            shared[:, functions] = 1.0
        except Exception as e:  # noqa: BLE001 - raised below, after the others have heard of it
            failure, shared[:, functions] = e, 0.0
    for group in (ps.cp, ps.tp):  # TP rank 0's CP rank 0 to its CP ranks, then each TP rank 0 to its TP ranks
        if group.size > 1:
            dist.broadcast(shared, src=dist.get_global_rank(group.group, 0), group=group.group)
    if failure is not None:
        raise failure
    if shared[0, functions].item() != 1.0:
        raise RewardError("a reward function failed on the first rank of this data-parallel replica (its error is in that "
                          "rank's output).")
    return shared[:, :functions].cpu().numpy()


def dry_run_rewards(functions, tokenizer, stops, prompt_set, generations: int) -> None:
    """Call each reward function once at start-up (before any process group or model exists) on ``generations``
    made-up completions of the first prompt (its first 1, 2, ... tokens), so that one returning the wrong count or
    type, or not accepting the calling convention, stops the run in one sentence instead of after the model loads."""
    prompts = [prompt_set.prompt(0)] * generations
    made_up = SimpleNamespace(tokens=[list(prompts[0].ids[: i + 1]) for i in range(generations)])
    inputs = reward_inputs(tokenizer, stops, prompt_set, prompts, made_up)
    where = f"called at start-up on {generations} made-up completions of the first prompt"
    for function in functions:
        try:
            score([function], **inputs)
        except RewardError as e:
            raise ConfigError(f"--reward-funcs: {str(e).rstrip('.')} ({where}).") from None
        except Exception as e:  # noqa: BLE001 - the user's code: name it and what it raised
            first = str(e).splitlines()[0] if str(e) else ""
            raise ConfigError(f"--reward-funcs: reward function {function.name} raised {type(e).__name__}: {first} ({where}; "
                              "it is called with keyword arguments prompts, completions, completion_ids and the prompt "
                              "file's columns, and should take **kwargs).") from None


def signal_counts(weighted: np.ndarray, advantages: np.ndarray, truncated, mask_truncated: bool) -> list[int]:
    """What a replica's rollout gives the loss: [completions, scored by some function, trained (not masked as
    truncated), trained with a non-zero advantage]."""
    trained = ~(np.asarray(truncated, dtype=bool) & mask_truncated)
    return [len(weighted), int((~np.isnan(weighted)).sum()), int(trained.sum()), int((trained & (advantages != 0)).sum())]


def no_signal_reason(counts) -> Optional[str]:
    """Why a rollout batch (``signal_counts`` summed over DP) teaches the policy nothing, or None when it does."""
    completions, scored, trained, moving = counts
    if moving:
        return None
    if not trained:
        return f"all {completions} completions were truncated and --mask-truncated-completions leaves none to train on"
    if not scored:
        return f"no reward function scored any of the {completions} completions (every reward None or NaN)"
    return "every group's completions got equal rewards, so every advantage is 0"


def warn_if_no_signal(run, counts: list, warned: set) -> None:
    """Rank 0 says once per reason when a rollout batch (all DP replicas') carries no learning signal: its steps log
    loss 0 and gradient norm 0 (apart from the KL term), which would otherwise look like a normal run."""
    total = torch.tensor(counts, dtype=torch.float64, device=device())
    if run.ps.dp.size > 1:
        dist.all_reduce(total, group=run.ps.dp.group)
    reason = no_signal_reason([int(v) for v in total.tolist()])
    if reason is None or reason in warned:
        return
    warned.add(reason)
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"grpo: warning: the rollout batch of iteration {run.iteration + 1} carries no learning signal: {reason}; "
              "its steps change nothing through the rewards (said once).", flush=True)


def moved(batch: Optional[RolloutBatch], where) -> Optional[RolloutBatch]:
    """``batch`` with its tensors on ``where`` and no step scales (reduced again where it is used):
    how a checkpoint keeps an unfinished rollout batch, and how a resume brings it back."""
    if batch is None:
        return None
    return dataclasses.replace(batch, micro_batches=[to_device(m, where) for m in batch.micro_batches],
                               counts=batch.counts.to(where), scales=None)


def row_multiple(cfg) -> int:
    """What a row's length must divide by: 2 x CP chunks under CP, TP slices under SP, and ROW_ALIGNMENT."""
    p = cfg.parallel
    need = (2 * p.context_parallel_size if p.context_parallel_size > 1 else 1) * \
           (p.tensor_model_parallel_size if p.sequence_parallel else 1)
    return need * ROW_ALIGNMENT // math.gcd(need, ROW_ALIGNMENT)


def build_micro_batches(run, rows: RolloutRows, *, pad_id: int, first_iteration: int) -> RolloutBatch:
    """The engine's micro-batches of ``rows`` (this replica's, cut for this CP rank), with the loss
    type's completion weights and this rank's count; old and reference log-probs as given (else 0)."""
    cfg, ps = run.cfg, run.ps
    f, size = cfg.posttrain, cfg.train.micro_batch_size
    multiple = row_multiple(cfg)
    micro, count, trained = [], 0.0, 0
    for first in range(0, len(rows.completions), size):
        chunk = range(first, min(first + size, len(rows.completions)))
        masked = [f.mask_truncated_completions and rows.truncated[i] for i in chunk]
        lengths = [0 if cut else len(rows.completions[i]) for i, cut in zip(chunk, masked)]
        weights, chunk_count = grpo_weights(f.loss_type, lengths, f.max_completion_length)
        count += chunk_count
        width = max(len(rows.prompts[i]) + len(rows.completions[i]) - 1 for i in chunk)
        width = -(-width // multiple) * multiple
        tokens = torch.full((len(chunk), width), pad_id, dtype=torch.long)
        labels = torch.full((len(chunk), width), IGNORE_INDEX, dtype=torch.long)
        old, reference, advantages, weight = (torch.zeros(len(chunk), width) for _ in range(4))
        for r, i in enumerate(chunk):
            prompt, completion = rows.prompts[i], rows.completions[i]
            ids = list(prompt) + list(completion)
            trained += len(ids) - 1  # the row's positions
            tokens[r, : len(ids) - 1] = torch.tensor(ids[:-1])
            if masked[r]:
                continue
            span = slice(len(prompt) - 1, len(ids) - 1)  # the positions whose next token is a completion token
            labels[r, span] = torch.tensor(completion)
            advantages[r, span], weight[r, span] = float(rows.advantages[i]), weights[r]
            if rows.old is not None:
                old[r, span] = torch.tensor(rows.old[i], dtype=torch.float32)
            if rows.reference is not None:
                reference[r, span] = torch.tensor(rows.reference[i], dtype=torch.float32)
        inputs = context_slice(with_positions(tokens, ps.cp.size), ps.cp.rank, ps.cp.size)
        per_token = context_slice((labels, old, reference, advantages, weight), ps.cp.rank, ps.cp.size)
        micro.append((to_device(inputs, device()), to_device(per_token, device())))
    credited = count if ps.cp.rank == 0 else 0.0  # whole completions' counts: once per CP group
    return RolloutBatch(micro, torch.tensor([credited], dtype=torch.float64, device=device()), first_iteration,
                        on_policy=rows.old is None, trained_tokens=trained)


@torch.no_grad()
def record_logps(run, batch: RolloutBatch, loss) -> list:
    """Log-probabilities [b, s] of every micro-batch's labels under the engine's weights as they are
    now (the caller's context: the reference's), by the one step loop without training."""
    loss.recording, loss.records = True, []
    try:
        steps = run.cfg.gradient_accumulation_steps
        zeros = torch.zeros(1, device=device())
        run_step(run, iter([(inputs, (*labels, zeros)) for inputs, labels in batch.micro_batches[:steps]]), train=False)
        return loss.records
    finally:
        loss.recording, loss.records = False, []


def with_logps(batch: RolloutBatch, *, old: Optional[list] = None, reference: Optional[list] = None) -> RolloutBatch:
    """``batch`` with recorded old and reference log-probs in place of the given ones."""
    micro = []
    for m, (inputs, (labels, given_old, given_reference, advantages, weights)) in enumerate(batch.micro_batches):
        micro.append((inputs, (labels, given_old if old is None else old[m], given_reference if reference is None else reference[m],
                               advantages, weights)))
    batch.micro_batches = micro
    return batch


def synchronize() -> float:
    """The clock after the device's queued work (honest timings of the rollout's parts)."""
    if on_gpu():
        torch.cuda.synchronize()
    return time.perf_counter()


def metric_values(stats: RolloutStats, loss_sums: torch.Tensor, run, seconds: float, beta: float) -> dict:
    """The log's GRPO values since the last log (collective over DP): rewards per function, KL, clip
    ratios, completion lengths and rates, TRL's names where TRL logs the same value."""
    reward_rows = torch.tensor(stats.rewards, dtype=torch.float64, device=device())
    counts = torch.tensor([stats.completions, stats.tokens, stats.truncated, stats.trained_tokens], dtype=torch.float64,
                          device=device())
    longest = torch.tensor([stats.longest], dtype=torch.float64, device=device())
    dp = run.ps.dp  # a replica's TP and CP ranks hold the same rollouts: summed over DP only
    if dp.size > 1:
        for t in (reward_rows, counts):
            dist.all_reduce(t, group=dp.group)
        dist.all_reduce(longest, op=dist.ReduceOp.MAX, group=dp.group)
    if run.ps.grad_reduction.size > 1:  # token sums are each CP rank's slice: summed over DP x CP
        dist.all_reduce(loss_sums, group=run.ps.grad_reduction.group)
    values = {}
    completions, generated, truncated, trained = counts.tolist()
    if completions:  # else no rollout since the last log (--num-iterations > 1): nothing to say of rewards and lengths
        for name, (n, total, squares) in zip([f"rewards/{n}" for n in stats.names] + ["reward"], reward_rows.tolist()):
            mean = total / n if n else float("nan")
            std = math.sqrt(max(squares - total * total / n, 0.0) / (n - 1)) if n > 1 else float("nan")
            values.update({f"{name}/mean": mean, f"{name}/std": std} if name != "reward" else {"reward": mean, "reward_std": std})
        values.update({"completions/mean_length": generated / completions, "completions/max_length": longest.item(),
                       "completions/clipped_ratio": truncated / completions,
                       "rollout_tokens_per_sec": generated / max(stats.rollout_seconds, 1e-9)})
    tokens = max(loss_sums[-1].item(), 1.0)
    if beta:
        values["kl"] = loss_sums[0].item() / tokens
    for i, name in enumerate(GRPO_METRICS[1:], start=1):
        values[name] = loss_sums[i].item() / tokens
    train_seconds = max(seconds - stats.rollout_seconds - stats.logprob_seconds, 1e-9)
    values.update({"train_tokens_per_sec": trained / train_seconds,
                   "completions_per_sec": run.cfg.train.global_batch_size * stats.steps / max(seconds, 1e-9),
                   "rollout_seconds": stats.rollout_seconds, "logprob_seconds": stats.logprob_seconds, "train_seconds": train_seconds})
    return values
