"""Fine-tuning losses on the model's vocab-split logits: masked next-token loss (SFT) and DPO.

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
