"""Fine-tuning losses on the model's vocab-split logits: masked next-token loss (SFT) and DPO.

Both are written so that DeepSpeed's bookkeeping gives the global-batch objective at any layout.
DeepSpeed divides each micro-batch's loss by the gradient-accumulation steps (GAS) and averages
gradients over the ranks that reduce them (DP, and DP x CP with context parallelism), so a
micro-batch returns its *sum* times ``scale = GAS x reduction ranks / global count``; the sum
of every micro-batch's contribution is then exactly "sum over the global batch / global count",
whatever GAS, DP and micro-batch size are. The count (loss tokens, or pairs) comes with the
labels, computed by the task before the step. Under context parallelism a CP rank holds a slice
of every row: token sums are its slice's (the count, summed over DP x CP, covers every slice),
while a DPO pair's loss needs the whole rows' log-probabilities, summed over CP first
(``ParallelPlan.sequence_sum``), and is then held by every CP rank, so it counts 1/CP on each.

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
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..parallel.plan import ParallelPlan
from ..parallel.tensor_parallel import IGNORE_INDEX

DPO_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen", "logps/rejected")


class MaskedLMLoss:
    """labels = (labels [b, s] with IGNORE_INDEX, scale [1]) -> sum of the token losses x scale."""

    def __init__(self, plan: ParallelPlan, vocab_size: int | None = None):
        self.plan, self.vocab_size = plan, vocab_size

    def __call__(self, logits, labels):
        labels, scale = labels
        return self.plan.cross_entropy(logits, labels.t(), self.vocab_size).sum() * scale.squeeze()

    def select_positions(self, hidden, labels):
        """The final hidden states [s, b, h] and labels cut to the positions with a label, as one
        row [n, 1, h] and labels [1, n]: the sum is the same, and the output head and cross-entropy
        skip the prompts and padding (half of a typical chat row). Under sequence parallelism the
        hidden states are a sequence slice that the head gathers, so they stay whole there. The
        positions' count is data (a host sync per micro-batch, after the layers are queued)."""
        if self.plan.sequence_parallel:
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
    """labels = (labels [2m, s], reference log-probs [2m], pair scale [1], chosen-token scale [1]).

    ``recording``: the reference pass, which returns 0 and keeps each pair's (pair id, chosen and
    rejected log-probability sums) in ``records`` (labels = (labels, pair ids) then). Metric sums of
    the micro-batches since ``take_sums`` are kept in ``sums`` (on the last pipeline stage)."""

    def __init__(self, plan: ParallelPlan, vocab_size: int | None, *, beta: float, kind: str, smoothing: float = 0.0,
                 rpo_alpha: float | None = None):
        self.plan, self.vocab_size = plan, vocab_size
        self.beta, self.kind, self.smoothing, self.rpo_alpha = beta, kind, smoothing, rpo_alpha
        self.recording = False
        self.records: list = []
        self.sums = None

    def row_logps(self, logits, labels) -> tuple[torch.Tensor, torch.Tensor]:
        """(sum of log-probs of each row's labels [2m], token losses [s, 2m]); under context
        parallelism the sums are the whole rows', the token losses this rank's."""
        token_loss = self.plan.cross_entropy(logits, labels.t(), self.vocab_size)
        return self.plan.sequence_sum(-token_loss.sum(0)), token_loss

    def __call__(self, logits, labels):
        if self.recording:
            labels, pair_ids = labels
            with torch.no_grad():
                sums, _ = self.row_logps(logits, labels)
            m = len(pair_ids)
            self.records.append((pair_ids.cpu(), sums[:m].double().cpu(), sums[m:].double().cpu()))
            return logits.new_zeros((), dtype=torch.float32)
        labels, reference, pair_scale, token_scale = labels
        logps, token_loss = self.row_logps(logits, labels)
        if self.kind == "ipo":  # IPO compares per-token means (the whole rows' counts: a CP collective only IPO needs)
            counts = self.plan.sequence_sum((labels != IGNORE_INDEX).sum(-1))
            logps, reference = logps / counts, reference / counts
        m = len(logps) // 2
        chosen, rejected = logps[:m] - reference[:m], logps[m:] - reference[m:]
        losses = dpo_pair_losses(chosen - rejected, self.beta, self.kind, self.smoothing)
        # Under CP every rank of a micro-batch holds these same pair losses (from the whole rows'
        # log-probs), while the scale counts each rank of DP x CP: each pair counts once.
        loss = losses.sum() * pair_scale.squeeze() / self.plan.cp.size
        if self.rpo_alpha:
            loss = loss + self.rpo_alpha * token_loss[:, :m].sum() * token_scale.squeeze()
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
