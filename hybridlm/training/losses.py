"""Fine-tuning losses on the model's vocab-split logits: masked next-token loss (SFT), DPO and GRPO.

Both follow the loss contract of ``hybridlm.parallel.loss``: a micro-batch computes its loss sums
and the task counts what they are normalised by (loss tokens; pairs and chosen reply tokens) before
the step, reduced once over the step's micro-batches and DP x CP; the labels then carry the step's
scales (GAS x reduction ranks / global count), which give the global-batch objective at any
layout. Under context parallelism a CP rank holds a slice of every row: token sums and counts are
its slice's, while a DPO pair's loss needs the whole rows' log-probabilities, summed over CP first
(``LossReducer.sequence_sum``), and is then held, and counted, by every CP rank.

SFT:   loss = sum of -log p(label) over every label that is not IGNORE_INDEX in the global batch
             / the number of such labels in the global batch.

DPO (pinned here: TRL's names have changed meaning across releases). For pair (c, r) with policy
and reference log-probabilities pi_c, pi_r, ref_c, ref_r (sums over the reply's tokens; for IPO
their means per reply token), h = (pi_c - ref_c) - (pi_r - ref_r) and beta = --dpo-beta:

    sigmoid  -(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h)     eps = --dpo-label-smoothing
    ipo      (h - 1 / (2 beta))^2
    hinge    max(0, 1 - beta h)

loss = mean over the global batch's pairs, plus with --rpo-alpha a: a x (sum of the chosen replies'
token losses / number of chosen reply tokens, over the global batch). Metrics (means over pairs):
rewards/chosen = beta (pi_c - ref_c), rewards/rejected = beta (pi_r - ref_r), rewards/accuracies =
fraction with rewards/chosen > rewards/rejected, rewards/margins = their mean difference,
logps/chosen = pi_c, logps/rejected = pi_r (the same log-probabilities the loss uses). With
``--reference none`` every ref is 0. A micro-batch holds its pairs' chosen rows first, then their
rejected rows.

GRPO (the definitions of TRL 1.16.0's ``GRPOTrainer._compute_loss`` with token-level importance
sampling, read in its source). For completion token t of completion i, with log-probability
logp = log softmax(logits / temperature)[token], the log-probability when it was sampled old (the
current one, detached, when each batch of rollouts is trained once: the ratio is then 1 and its
gradient the policy gradient), the reference's ref, and advantage A_i:

    r = exp(logp - old),   term = -min(r A_i, clip(r, 1 - eps_low, 1 + eps_high) A_i) + beta (exp(ref - logp) - (ref - logp) - 1)

over the completion tokens (prompt, padding and, with --mask-truncated-completions, truncated
completions excluded), aggregated as TRL aggregates each --loss-type. In TRL every micro-batch of
B completions computes its loss, divides it by the accumulation steps and DDP averages the
gradients over the P processes; dapo's normaliser is the generation batch's completion tokens
(all processes, all accumulation steps: the global batch) over P. So over the global batch:

    grpo     mean over completions of (sum of the completion's terms / its tokens)
    bnpo     mean over micro-batches of (sum of the micro-batch's terms / its tokens)
    dr_grpo  sum of all terms / (completions x --max-completion-length)
    dapo     sum of all terms / all completion tokens

Under the loss contract a micro-batch returns one sum, the terms times a per-completion weight,
counted as ``grpo_weights`` says (per type: completions, 1 per micro-batch, completions x the
maximum length, tokens), which gives exactly these. Weights and counts come from whole
completions, so under CP every rank of a row uses the same ones (the counts are credited once).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..parallel.loss import LossReducer, scaled_loss
from ..parallel.tensor_parallel import IGNORE_INDEX

DPO_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen", "logps/rejected")


class MaskedLMLoss:
    """labels = (labels [b, s] with IGNORE_INDEX, the step's scale [1]) -> the sum of the token losses,
    one term counted by the tokens with a label, times the scale."""

    def __init__(self, reducer: LossReducer, vocab_size: int | None = None):
        self.reducer, self.vocab_size = reducer, vocab_size

    @staticmethod
    def counts(labels: torch.Tensor) -> torch.Tensor:
        """[1]: the positions with a label."""
        return (labels != IGNORE_INDEX).sum().to(torch.float64).reshape(1)

    def __call__(self, logits, labels):
        labels, scales = labels
        return scaled_loss(self.reducer.cross_entropy(logits, labels.t(), self.vocab_size).sum().reshape(1), scales)

    def select_positions(self, hidden, labels):
        """The final hidden states [s, b, h] and labels cut to the positions with a label, as one
        row [n, 1, h] and labels [1, n]: the sum is the same, and the output head and cross-entropy
        skip the prompts and padding (half of a typical chat row). Under sequence parallelism the
        hidden states are a sequence slice that the head gathers, so they stay whole there. The
        positions' count is data (a host sync per micro-batch, after the layers are queued)."""
        if self.reducer.sequence_parallel:
            return hidden, labels
        labels, scale = labels
        flat = labels.t().reshape(-1)
        keep = (flat != IGNORE_INDEX).nonzero().squeeze(1)
        if keep.numel() == 0:  # keep one ignored position: the head and loss still run (and give 0)
            keep = keep.new_zeros(1)
        rows = hidden.reshape(-1, hidden.shape[-1]).index_select(0, keep).unsqueeze(1)
        return rows, (flat.index_select(0, keep).unsqueeze(0), scale)


def dpo_pair_losses(h: torch.Tensor, beta: float, kind: str, smoothing: float = 0.0) -> torch.Tensor:
    """The pinned pair losses of h = (pi_c - ref_c) - (pi_r - ref_r)."""
    if kind == "sigmoid":
        return -(1 - smoothing) * F.logsigmoid(beta * h) - smoothing * F.logsigmoid(-beta * h)
    if kind == "ipo":
        return (h - 1 / (2 * beta)) ** 2
    if kind == "hinge":
        return torch.relu(1 - beta * h)
    raise ValueError(kind)


class DPOLoss:
    """labels = (labels [2m, s], reference log-probs [2m], the step's scales [2]): two terms, the pair
    losses counted by pairs and (with ``rpo_alpha``) the chosen replies' token losses counted by
    their tokens.

    ``recording``: the reference pass, which returns 0 and keeps each pair's (pair id, chosen and
    rejected log-probability sums) in ``records`` (labels = (labels, pair ids) then). Metric sums of
    the micro-batches since ``take_sums`` are kept in ``sums`` (on the last pipeline stage)."""

    def __init__(self, reducer: LossReducer, vocab_size: int | None, *, beta: float, kind: str, smoothing: float = 0.0,
                 rpo_alpha: float | None = None):
        self.reducer, self.vocab_size = reducer, vocab_size
        self.beta, self.kind, self.smoothing, self.rpo_alpha = beta, kind, smoothing, rpo_alpha
        self.recording = False
        self.records: list = []
        self.sums = None

    @staticmethod
    def counts(labels: torch.Tensor, pair_ids: torch.Tensor) -> torch.Tensor:
        """[2]: the micro-batch's pairs (every CP rank holds their losses whole, and counts them) and
        its chosen replies' tokens with a label (this rank's slice of them under CP)."""
        chosen_tokens = (labels[: len(pair_ids)] != IGNORE_INDEX).sum().to(torch.float64)
        return torch.stack([torch.full_like(chosen_tokens, float(len(pair_ids))), chosen_tokens])

    def row_logps(self, logits, labels) -> tuple[torch.Tensor, torch.Tensor]:
        """(sum of log-probs of each row's labels [2m], token losses [s, 2m]); under context
        parallelism the sums are the whole rows', the token losses this rank's."""
        token_loss = self.reducer.cross_entropy(logits, labels.t(), self.vocab_size)
        return self.reducer.sequence_sum(-token_loss.sum(0)), token_loss

    def __call__(self, logits, labels):
        if self.recording:
            labels, pair_ids = labels
            with torch.no_grad():
                sums, _ = self.row_logps(logits, labels)
            m = len(pair_ids)
            self.records.append((pair_ids.cpu(), sums[:m].double().cpu(), sums[m:].double().cpu()))
            return logits.new_zeros((), dtype=torch.float32)
        labels, reference, scales = labels
        logps, token_loss = self.row_logps(logits, labels)
        if self.kind == "ipo":  # IPO compares per-token means (the whole rows' counts: a CP collective only IPO needs)
            counts = self.reducer.sequence_sum((labels != IGNORE_INDEX).sum(-1))
            logps, reference = logps / counts, reference / counts
        m = len(logps) // 2
        chosen, rejected = logps[:m] - reference[:m], logps[m:] - reference[m:]
        losses = dpo_pair_losses(chosen - rejected, self.beta, self.kind, self.smoothing)
        rpo = self.rpo_alpha * token_loss[:, :m].sum() if self.rpo_alpha else losses.new_zeros(())
        loss = scaled_loss(torch.stack([losses.sum(), rpo.to(losses.dtype)]), scales)
        with torch.no_grad():
            chosen_reward, rejected_reward = self.beta * chosen, self.beta * rejected
            sums = torch.stack([chosen_reward.sum(), rejected_reward.sum(), (chosen_reward > rejected_reward).float().sum(),
                                (chosen_reward - rejected_reward).sum(), logps[:m].sum(), logps[m:].sum(),
                                torch.full((), float(m), device=logps.device)]).double()
            self.sums = sums if self.sums is None else self.sums + sums
        return loss

    def take_sums(self, device) -> torch.Tensor:
        """The metric sums (and pair count, last) since the last call; zeros where none were computed."""
        sums = self.sums if self.sums is not None else torch.zeros(len(DPO_METRICS) + 1, dtype=torch.float64, device=device)
        self.sums = None
        return sums


GRPO_METRICS = ("kl", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")


def grpo_weights(loss_type: str, lengths, max_completion_length: int) -> tuple[list[float], float]:
    """(a weight per completion, the count the micro-batch adds to the step's) for completions of
    ``lengths`` trained tokens (0 for one masked out) forming one micro-batch: see the module docstring."""
    tokens = float(sum(lengths))
    if loss_type == "grpo":
        return [1.0 / max(n, 1) for n in lengths], float(len(lengths))
    if loss_type == "bnpo":
        return [1.0 / max(tokens, 1.0)] * len(lengths), 1.0
    if loss_type == "dr_grpo":
        return [1.0] * len(lengths), float(len(lengths) * max_completion_length)
    if loss_type == "dapo":
        return [1.0] * len(lengths), tokens
    raise ValueError(loss_type)


class GRPOLoss:
    """labels = (labels [b, s], old log-probs [b, s], reference log-probs [b, s], advantages [b, s],
    completion weights [b, s], the step's scale [1]): one term, the weighted token terms.

    ``on_policy``: the old log-probs are the current ones (the tensor passed is not read).
    ``recording``: a log-prob pass (old or reference), which returns 0 and appends each micro-batch's
    log-probs [b, s] (0 off the labels) to ``records``. Metric sums since ``take_sums``: ``sums``.
    ``fused_head``: the model hands over ``HeadLogits`` where its head allows, and the log-probabilities are
    computed with the head chunk by chunk: the completions' logits (4,096 x 151,936 for Qwen2's vocabulary
    in a micro-batch of 8 x 512) and their gradient never exist whole."""

    fused_head = True

    def __init__(self, reducer: LossReducer, vocab_size: int | None, *, beta: float, epsilon: float, epsilon_high: float,
                 temperature: float):
        self.reducer, self.vocab_size = reducer, vocab_size
        self.beta, self.low, self.high, self.temperature = beta, 1.0 - epsilon, 1.0 + epsilon_high, temperature
        self.on_policy = True
        self.recording = False
        self.records: list = []
        self.sums = None

    def token_logps(self, logits, labels) -> torch.Tensor:
        """Log-probabilities [s, b] of the labels under the logits divided by the temperature (0 off the labels)."""
        if self.temperature != 1.0:
            logits = logits / self.temperature
        return -self.reducer.cross_entropy(logits, labels.t(), self.vocab_size)

    def select_positions(self, hidden, labels):
        """The positions with a label only (as ``MaskedLMLoss.select_positions``), every per-token
        tensor cut the same way; the placement goes along for the recording pass to put them back."""
        if self.reducer.sequence_parallel:
            return hidden, labels
        *tensors, scale = labels
        rows, length = tensors[0].shape
        flat = [x.t().reshape(-1) for x in tensors]  # position-major, as the hidden states [s, b, h]
        keep = (flat[0] != IGNORE_INDEX).nonzero().squeeze(1)
        if keep.numel() == 0:
            keep = keep.new_zeros(1)
        selected = hidden.reshape(-1, hidden.shape[-1]).index_select(0, keep).unsqueeze(1)
        return selected, (*(x.index_select(0, keep).unsqueeze(0) for x in flat), scale, (keep, rows, length))

    def __call__(self, logits, labels):
        labels, old, ref, advantages, weights, scale, *placement = labels
        logp = self.token_logps(logits, labels)
        if self.recording:
            values = logp.detach().float()
            if placement:
                keep, rows, length = placement[0]
                values = values.new_zeros(length * rows).index_copy_(0, keep, values.reshape(-1)).view(length, rows)
            self.records.append(values.t())
            return logp.new_zeros((), dtype=torch.float32)
        mask = labels.t() != IGNORE_INDEX
        old, ref, advantages, weights = (x.t() for x in (old, ref, advantages, weights))
        old = logp.detach() if self.on_policy else old
        ratio = torch.exp(logp - old)
        term = -torch.min(ratio * advantages, ratio.clamp(self.low, self.high) * advantages)
        if self.beta:
            delta = ref - logp
            kl = torch.exp(delta) - delta - 1
            term = term + self.beta * kl
        loss = scaled_loss(torch.where(mask, term * weights, 0.0).sum().reshape(1), scale)
        with torch.no_grad():
            low = (ratio < self.low) & (advantages < 0) & mask
            high = (ratio > self.high) & (advantages > 0) & mask
            sums = torch.stack([torch.where(mask, kl, 0.0).sum() if self.beta else ratio.new_zeros(()),
                                low.sum(), high.sum(), (low | high).sum(), mask.sum()]).double()
            self.sums = sums if self.sums is None else self.sums + sums
        return loss

    def take_sums(self, device) -> torch.Tensor:
        """The metric sums (and token count, last) since the last call; zeros where none were computed."""
        sums = self.sums if self.sums is not None else torch.zeros(len(GRPO_METRICS) + 1, dtype=torch.float64, device=device)
        self.sums = None
        return sums
