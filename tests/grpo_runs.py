"""What the GRPO tests share: a tiny imported Qwen2 with a chat tokenizer, prompt files, fixed
rollouts (prompts, completions, rewards, old and reference log-probabilities), the rank functions
that train on them, and the oracle: TRL 1.16.0's loss written out in plain torch on transformers'
log-probabilities, micro-batch by micro-batch and process by process as TRL computes it.
"""
from __future__ import annotations

import os
import random

import torch

from chat_fixtures import write_jsonl
from finetune_runs import OPTIM, hf_model_dir, imported

# the settings every GRPO test run shares (the loss's; each test adds its layout and rewards)
GRPO = ["--task", "grpo", "--num-generations", "4", "--max-completion-length", "8", "--temperature", "0.7", "--beta", "0.04",
        "--epsilon", "0.2", "--epsilon-high", "0.28", "--micro-batch-size", "2", "--global-batch-size", "16",
        "--reward-funcs", "accuracy", "format"]
FROZEN = ["--lr", "0", "--min-lr", "0"]  # an optimizer step that leaves the weights: several losses, one model


def model_and_prompts(directory, **config) -> tuple[str, str, str]:
    """(HF model directory, its import, a prompts file) in ``directory``, made once (``config``: HF config values)."""
    hf, ckpt, prompts = (os.path.join(str(directory), name) for name in ("hf", "ckpt", "prompts.jsonl"))
    if not os.path.isdir(ckpt):
        hf_model_dir(hf, "qwen2", **config)
        imported(hf, ckpt)
        write_jsonl(prompts, [{"messages": [{"role": "user", "content": word}], "solution": "1"}
                              for word in ("cat", "dog sat", "the mat", "far away", "home", "a dog ran")])
        with open(os.path.join(str(directory), "rewards.py"), "w") as f:
            f.write("def even_tokens(completion_ids, **kwargs):\n"
                    "    return [sum(t % 2 == 0 for t in ids) / len(ids) for ids in completion_ids]\n")
    return hf, ckpt, prompts


def even_tokens(directory) -> str:
    """--reward-funcs of the share of a completion's token ids that are even (a learnable reward, chance 0.5)."""
    return os.path.join(str(directory), "rewards.py") + ":even_tokens"


def run_flags(directory, *extra: str) -> list[str]:
    _, ckpt, prompts = model_and_prompts(directory)
    return [*GRPO, "--load", ckpt, "--data-path", prompts, *OPTIM, *extra]


def fixed_rollouts(seed: int = 0, rows: int = 16, generations: int = 4, longest: int = 8) -> dict:
    """Prompts of 3-9 tokens, completions of 1-8 (those of 8 truncated), two reward columns (one
    unscored completion), and log-prob offsets for old and reference (added to the true ones)."""
    rng = random.Random(seed)
    completions = [[rng.randrange(5, 390) for _ in range(rng.randint(1, longest))] for _ in range(rows)]
    completions[3] = completions[3][:2] + [0] * (longest - 2)  # truncated, and the padding id is a token too
    rewards = [[rng.choice([0.0, 0.5, 1.0]), rng.uniform(-1, 1)] for _ in range(rows)]
    rewards[5][1] = float("nan")
    return {"prompts": [p for p in ([rng.randrange(5, 390) for _ in range(rng.randint(3, 9))] for _ in range(rows // generations))
                        for _ in range(generations)],
            "completions": completions, "truncated": [len(c) == longest for c in completions], "rewards": rewards,
            "old_offsets": [[rng.uniform(-0.25, 0.25) for _ in c] for c in completions],
            "ref_offsets": [[rng.uniform(-0.5, 0.5) for _ in c] for c in completions], "generations": generations}


def completion_logps(model, data: dict, temperature: float) -> list[torch.Tensor]:
    """transformers' log-probabilities of each completion's tokens (logits / temperature), with their graph."""
    out = []
    for prompt, completion in zip(data["prompts"], data["completions"]):
        ids = torch.tensor([prompt + completion])
        logits = model(ids).logits[0, len(prompt) - 1: -1] / temperature
        out.append(torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(completion).unsqueeze(-1)).squeeze(-1))
    return out


def with_logps(data: dict, logps: list[torch.Tensor]) -> dict:
    """The fixed rollouts with old and reference log-probs: the true ones plus the fixed offsets."""
    return {**data, "old": [(p.detach() + torch.tensor(o)).tolist() for p, o in zip(logps, data["old_offsets"])],
            "reference": [(p.detach() + torch.tensor(o)).tolist() for p, o in zip(logps, data["ref_offsets"])]}


# ---------------------------------------------------------------- the oracle: TRL 1.16.0's definitions

def _nanstd(x: torch.Tensor, dim=None) -> torch.Tensor:
    """trl.trainer.utils.nanstd: NaN ignored, Bessel-corrected."""
    mean = torch.nanmean(x, dim=dim, keepdim=True)
    count = (~torch.isnan(x)).sum(dim=dim, keepdim=True)
    variance = torch.nanmean((x - mean) ** 2, dim=dim, keepdim=True) * count / (count - 1)
    return variance.sqrt().squeeze() if dim is None else variance.sqrt().squeeze(dim)


def trl_advantages(rewards: torch.Tensor, weights: torch.Tensor, generations: int, scale: str) -> torch.Tensor:
    """_generate_and_score_completions (sum_then_normalize) over the global batch."""
    total = (rewards * weights).nansum(dim=1)
    total[torch.isnan(rewards).all(dim=1)] = float("nan")
    mean = torch.nanmean(total.view(-1, generations), dim=1).repeat_interleave(generations)
    if scale == "batch":
        std = _nanstd(total).expand_as(total)
    else:
        std = _nanstd(total.view(-1, generations), dim=1).repeat_interleave(generations)
    advantages = total - mean
    if scale != "none":
        advantages = advantages / (std + 1e-4)
    return torch.nan_to_num(advantages, nan=0.0)


def trl_loss(logps: list, data: dict, advantages: torch.Tensor, *, loss_type: str, mask_truncated: bool, beta: float,
             epsilon: float, epsilon_high: float, longest: int, micro_batch: int, processes: int) -> torch.Tensor:
    """_compute_loss per micro-batch of each process (rows split in order), divided by the accumulation
    steps (dapo: by the global tokens over the processes), summed over a process's micro-batches and
    averaged over the processes as DDP averages gradients."""
    rows = len(logps)
    per_process = rows // processes
    accumulation = per_process // micro_batch
    keep = [not (mask_truncated and cut) for cut in data["truncated"]]
    global_tokens = sum(len(c) for c, k in zip(data["completions"], keep) if k)
    total = 0.0
    for first in range(0, rows, micro_batch):
        chunk = range(first, first + micro_batch)
        width = max(len(data["completions"][i]) for i in chunk)

        def padded(values):
            return torch.stack([torch.cat([v, v.new_zeros(width - len(v))]) for v in values])
        logp = padded([logps[i] for i in chunk])
        old, ref = (padded([torch.tensor(data[key][i]) for i in chunk]) for key in ("old", "reference"))
        mask = padded([torch.full((len(data["completions"][i]),), float(keep[i])) for i in chunk])
        a = advantages[list(chunk)].unsqueeze(1)
        ratio = torch.exp(logp - old)
        term = -torch.min(ratio * a, torch.clamp(ratio, 1 - epsilon, 1 + epsilon_high) * a)
        term = term + beta * (torch.exp(ref - logp) - (ref - logp) - 1)
        if loss_type == "grpo":
            loss = ((term * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean() / accumulation
        elif loss_type == "bnpo":
            loss = (term * mask).sum() / mask.sum().clamp(min=1.0) / accumulation
        elif loss_type == "dr_grpo":
            loss = (term * mask).sum() / (micro_batch * longest) / accumulation
        else:  # dapo
            loss = (term * mask).sum() / (global_tokens / processes)
        total = total + loss
    return total / processes


def transformers_rollouts(hf_dir: str, prompts: list, stops, new_tokens: int = 8) -> list[list[int]]:
    """transformers' greedy completions of ``prompts`` (left-padded, an attention mask), each cut after its first
    token in ``stops``: what GRPO's rollouts with ``--top-k 1`` must produce."""
    from finetune_runs import hf_model
    model = hf_model(hf_dir).eval()
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = (torch.arange(width) >= torch.tensor([width - len(p) for p in prompts]).unsqueeze(1)).long()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False, eos_token_id=list(stops),
                             pad_token_id=0)[:, width:].tolist()
    return [row[: next((i + 1 for i, t in enumerate(row) if t in stops), len(row))] for row in out]


# ---------------------------------------------------------------- inside the ranks

def _probe_grads(run) -> dict:
    """Every step's full gradients, read when DeepSpeed is about to apply them (tests/oracle.py's probe)."""
    from deepspeed.utils import safe_get_full_grad

    from hybridlm.model.weights import gather_full_state_dict
    module, probe, original = run.engine.module, {}, run.engine._take_model_step

    def step_with_probe(*args, **kwargs):
        local = {name: safe_get_full_grad(p) for name, p in module.named_parameters()}
        probe["grads"] = gather_full_state_dict(local, module, run.ps.tp, run.ps.grad_reduction, run.ps.ep)
        return original(*args, **kwargs)
    run.engine._take_model_step = step_with_probe
    return probe


def build(flags: list[str]):
    import logging

    from deepspeed.utils import logger

    from hybridlm.training.finetune import parse_finetune_args
    from hybridlm.training.trainer import build_run, prepare_config
    logger.setLevel(logging.WARNING)
    cfg, ds = prepare_config(parse_finetune_args(flags))
    return build_run(cfg, ds)


def train_on_fixed_rollouts(flags: list[str], data: dict, variants: list) -> list[dict]:
    """In each rank: for each (loss type, reward scaling, mask truncated) one step on this replica's share
    of ``data`` (advantages computed by the task from the rewards); the step's loss and full gradients, and how many
    times so far the loss took the fused head's path."""
    import numpy as np

    from hybridlm.training.grpo import RolloutRows, advantages_of
    from hybridlm.training.trainer import data_iterator, train_step
    from hybridlm.parallel import loss as loss_module
    fused_calls = []  # the model hands the loss HeadLogits (hybridlm.parallel.fused_head): the path these steps check
    fused = loss_module.fused_head_cross_entropy
    loss_module.fused_head_cross_entropy = lambda *args: fused_calls.append(1) or fused(*args)
    run = build(flags)
    probe = _probe_grads(run)
    f, dp = run.cfg.posttrain, run.ps.dp
    per = len(data["completions"]) // dp.size
    mine = range(dp.rank * per, (dp.rank + 1) * per)
    results = []
    for loss_type, scale, mask_truncated in variants:
        f.loss_type, f.scale_rewards, f.mask_truncated_completions = loss_type, scale, mask_truncated
        rewards = np.asarray([data["rewards"][i] for i in mine])
        advantages, _ = advantages_of(rewards, np.ones(rewards.shape[1]), data["generations"], scale, dp)
        rows = RolloutRows(*([data[k][i] for i in mine] for k in ("prompts", "completions", "truncated")), advantages.tolist(),
                           *([data[k][i] for i in mine] for k in ("old", "reference")))
        run.task.batch = run.task.use_rollout(run, rows)
        loss = train_step(run, data_iterator(run)).item()
        results.append({"loss": loss, "grads": probe.pop("grads"), "fused_head_calls": len(fused_calls)})
    return results


def train_steps(flags: list[str], steps: int, save: bool = False) -> dict:
    """In each rank: ``steps`` GRPO steps (rollouts and all); the log records, losses and live weights."""
    from hybridlm.training.trainer import data_iterator, save_checkpoint, train_step
    from interop_runs import _live_state
    run = build(flags)
    batches = data_iterator(run)
    losses, records = [], []
    for _ in range(steps):
        losses.append(train_step(run, batches).item())
        records.append(run.task.log_values(run, 1.0))
    if save:
        save_checkpoint(run)
    return {"losses": losses, "records": records, "weights": _live_state(run, False)["weight"], "iteration": run.iteration,
            "frozen": run.task.frozen is not None, "reference": run.task.reference_tag}


def rollout_then_step(flags: list[str], prompts: list) -> dict:
    """In each rank: the task's sampler on ``prompts`` (this replica's rows), then one training step."""
    from hybridlm.training.trainer import data_iterator, train_step
    run = build(flags)
    out = run.task.sampler.sample(run, prompts)
    loss = train_step(run, data_iterator(run)).item()
    return {"tokens": out.tokens, "truncated": out.truncated, "stops": run.task.stops, "loss": loss,
            "frozen": run.task.frozen is not None}


def graphed_rollout_then_step(flags: list[str], prompts: list) -> dict:
    """``rollout_then_step``, with the batch sizes whose decode step was captured as a CUDA graph."""
    from hybridlm.model import decode_state
    captured, capture = [], decode_state.StepRunner._capture

    def counted(runner, batch):
        captured.append(batch)
        return capture(runner, batch)
    decode_state.StepRunner._capture = counted
    return {**rollout_then_step(flags, prompts), "captured": captured}
