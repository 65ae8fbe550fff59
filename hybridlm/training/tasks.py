"""What the one training loop trains (``--task``): each task supplies its data, the loss the model
ends in, the step's micro-batches ("batch -> loss") and the values it adds to the log.

    pretrain  next-token loss on every token of ``preprocess_data`` samples (the model's LMLoss)
    sft       masked next-token loss on the replies of ``preprocess_chat`` conversations, normalised
              by the global batch's loss tokens; rows packed with ``--packing``
    dpo       a preference loss on ``preprocess_chat`` pairs against reference log-probabilities
              computed once before training (``hybridlm.training.reference``)
    grpo      a policy-gradient loss on the policy's own completions of JSONL prompts, sampled on the
              live weights every --num-iterations steps and scored by reward functions
              (``hybridlm.training.grpo``, ``rollout``, ``rewards``)

Every task follows the loss contract of ``hybridlm.parallel.loss``: its loss returns sums, and
its ``step_batches`` counts what they are normalised by (every token; loss tokens; pairs and chosen
reply tokens) over the step's micro-batches, reduces the counts over DP x CP once, and hands every
micro-batch the step's scales with its labels: the objective is the global batch's, whatever GAS,
DP, CP and micro-batch size. A fine-tuning step therefore reads all of its micro-batches first;
pretraining's count is the same every step (every token), so it is reduced once per run.
"""
from __future__ import annotations

import itertools
import json
import os
from typing import Iterator

import numpy as np
import torch
import torch.distributed as dist

from ..config import ConfigError, RunConfig
from ..data.builtin import builtin_prefix
from ..data.chat_dataset import ChatData, DPOPairs, SFTRows, check_tokenizer
from ..data.chat_template import TEMPLATE_FILE, load_template
from ..data.gpt_dataset import build_gpt_datasets, parse_data_path
from ..data.indexed import IndexedDataset
from ..data.mock import MockDocuments
from ..data.prompts import PromptSet, stop_tokens
from ..data.tokenizers import build_tokenizer, flags_text
from ..interop.layout import Layout, read_info
from ..model.generation import Sampling
from ..model.gpt import LMLoss
from ..parallel.loss import global_counts, loss_scales
from ..parallel.tensor_parallel import IGNORE_INDEX
from .checkpoint import tag_to_load, task_state_file
from .distributed import device
from .grpo import (RolloutBatch, RolloutRows, RolloutStats, advantages_of, build_micro_batches, dry_run_rewards, metric_values,
                   moved, record_logps, reward_inputs, shared_rewards, signal_counts, synchronize, warn_if_no_signal,
                   with_logps)
from .losses import DPO_METRICS, DPOLoss, GRPOLoss, MaskedLMLoss
from .reference import load_weights
from .rewards import load_reward_functions, score
from .rollout import FrozenWeights, Sampler, reference_context


class PretrainTask:
    """Next-token prediction on every token (LMLoss)."""
    name = "pretrain"
    rows_per_sample = 1

    def __init__(self, cfg: RunConfig):
        self.cfg = cfg
        self.scales = None  # the step's loss scales: every micro-batch holds as many tokens, so one value for the run

    def check(self) -> None:
        """Before any process group: the data suits the task (files read, nothing launched): every
        token id of ``--data-path`` has a row in the model's embedding, which would otherwise end
        the first step in an IndexError."""
        d, vocab = self.cfg.data, self.cfg.model.vocab_size
        if d.data_path is None:
            return  # the built-in corpus (bytes) or --mock-data (the tokenizer's own ids)
        for prefix in parse_data_path(d.data_path)[0]:
            largest, recorded = IndexedDataset(prefix).largest_token_id()
            if largest < vocab:
                continue
            typed = self.cfg.typed if self.cfg.typed is not None else self.cfg.explicit
            sized = d.tokenizer_type == "NullTokenizer" or "vocab_size" in typed
            given = flags_text({"tokenizer_type": d.tokenizer_type, **({"vocab_size": vocab} if sized else {})})
            fix = (f"it was preprocessed with {flags_text(recorded)}: give the same flags" if recorded else
                   "give the --tokenizer-type (and --tokenizer-model) it was preprocessed with, or a --vocab-size above that id")
            raise ConfigError(f"--data-path {prefix} holds token ids up to {largest}, but the model's vocabulary has "
                              f"{vocab} ({given}); {fix}.")

    def loss(self, reducer):
        """What the model ends in (``hybridlm.parallel.loss``'s contract)."""
        return LMLoss(reducer, self.cfg.model.vocab_size)

    def datasets(self) -> tuple:
        """Train and validation samples (collective: one rank builds the index caches, the others wait)."""
        t, d = self.cfg.train, self.cfg.data
        prefixes = d.data_path or ([] if d.mock_data else [builtin_prefix()])
        mock = None
        if d.mock_data:
            tokenizer = build_tokenizer(d.tokenizer_type, d.tokenizer_model, d.vocab_file, d.merge_file, self.cfg.model.vocab_size)
            mock = MockDocuments(tokenizer.vocab_size, tokenizer.eod)
        # Megatron-LM's count (training.py get_train_valid_test_num_samples): every evaluation draws fresh batches
        valid_samples = (t.train_iters // t.eval_interval + 1) * t.eval_iters * t.global_batch_size if t.eval_interval else 0
        train, valid, _ = build_gpt_datasets(prefixes, d.split, self.cfg.model.seq_length, t.seed,
                                             (t.train_iters * t.global_batch_size, valid_samples, 0), d.data_cache_path,
                                             documents=mock)
        if t.eval_interval and valid is None:
            raise ConfigError(f"--eval-interval needs a validation split, but --split {d.split} gives it nothing.")
        return train, valid

    def prepare(self, run) -> None:
        """After the engine exists, before --load (DPO computes its reference here)."""

    def loaded(self, run) -> None:
        """After --load (DPO with LoRA computes its reference here: the loaded base, adapters off)."""

    def step_batches(self, run, batches: Iterator) -> Iterator:
        """The micro-batches of one optimizer step as the engine takes them: labels with the step's loss scales."""
        gas = self.cfg.gradient_accumulation_steps
        step = itertools.islice(batches, gas)
        if self.scales is None:  # the first step: every micro-batch of every step counts as many tokens as this one
            first = next(step)
            _, self.scales = self.step_counts(run, [LMLoss.counts(first[1]) * gas])
            step = itertools.chain([first], step)
        return ((inputs, (labels, self.scales)) for inputs, labels in step)

    def step_counts(self, run, local_counts: list) -> tuple[torch.Tensor, torch.Tensor]:
        """(the step's global counts, the loss scales they give) from this rank's counts (device
        tensors, summed over the step's micro-batches): one all-reduce over DP x CP, one division."""
        counts = global_counts(torch.cat(local_counts), run.ps.grad_reduction)
        return counts, loss_scales(counts, run.ps.grad_reduction.size, self.cfg.gradient_accumulation_steps)

    def log_values(self, run, seconds: float) -> dict:
        """Extra values for the log record since the last call (collective)."""
        return {}

    def describe(self) -> str:
        return ""

    def checkpoint_files(self) -> dict:
        """{name: text} saved in each checkpoint beside the weights."""
        return {}

    def rank_state(self) -> dict | None:
        """What only this rank holds that a resume needs (``checkpoint.task_state_file``), or None."""
        return None


class ChatTask(PretrainTask):
    """What SFT and DPO share: the chat data, its tokenizer check, the loss tokens it logs."""

    def __init__(self, cfg: RunConfig):
        super().__init__(cfg)
        self.data = None
        self.loss_tokens = self.last_step_tokens = 0

    def chat_data(self) -> ChatData:
        if self.data is None:
            d = self.cfg.data
            self.data = ChatData(str(d.data_path[0]).split()[0])
            check_tokenizer(self.data, d.tokenizer_type, d.tokenizer_model)
        return self.data

    def checkpoint_files(self) -> dict:
        """The chat template the data was rendered with: the export hands it on with the model."""
        text = self.chat_data().manifest["template"].get("text")
        return {TEMPLATE_FILE: text} if text else {}

    def pad_id(self) -> int:
        d = self.cfg.data
        return build_tokenizer(d.tokenizer_type, d.tokenizer_model, d.vocab_file, d.merge_file).pad

    def log_values(self, run, seconds: float) -> dict:
        # the counts stay on the device through the steps; read here, after the log's own synchronisation
        values = {"loss_tokens": int(self.last_step_tokens), "loss_tokens_per_sec": int(self.loss_tokens) / max(seconds, 1e-9)}
        self.loss_tokens = 0
        return values


class SFTTask(ChatTask):
    name = "sft"

    def check(self) -> None:
        data = self.chat_data()
        if data.kind != "sft":
            raise ConfigError(f"--data-path {data.prefix} holds preference pairs; train them with --task dpo.")

    def loss(self, reducer):
        return MaskedLMLoss(reducer, self.cfg.model.vocab_size)

    def datasets(self) -> tuple:
        rows = SFTRows(self.chat_data(), self.cfg.model.seq_length, self.cfg.train.seed, self.pad_id(), self.cfg.posttrain.packing)
        self.truncated = rows.truncated
        return rows, None

    def step_batches(self, run, batches: Iterator) -> Iterator:
        micro = [next(batches) for _ in range(self.cfg.gradient_accumulation_steps)]
        counts, scales = self.step_counts(run, [sum(MaskedLMLoss.counts(labels) for _, labels in micro)])
        self.last_step_tokens = counts[0]
        self.loss_tokens = self.loss_tokens + counts[0]
        return iter([(inputs, (labels, scales)) for inputs, labels in micro])

    def describe(self) -> str:
        packing = "packed rows" if self.cfg.posttrain.packing else "one conversation per row"
        return (f"sft on {self.data.manifest['samples']:,} conversations, {packing}, loss per reply token over the global batch"
                + (f"; {self.truncated} longer than --seq-length + 1 keep their start" if self.truncated else ""))


class DPOTask(ChatTask):
    name = "dpo"
    rows_per_sample = 2  # a pair is a chosen row and a rejected row

    def __init__(self, cfg: RunConfig):
        super().__init__(cfg)
        self.reference = None  # [pairs, 2] float64 reference log-prob sums (None: --reference none)
        self.reference_tag = None  # the checkpoint folder they came from
        self.reference_seconds = None  # how long computing them took (None: read from the cache or not needed)
        self.dpo_loss = None
        self.reference_on_device = None  # ``reference`` on the device, made at the first step

    def check(self) -> None:
        data = self.chat_data()
        if data.kind != "preference":
            raise ConfigError(f"--data-path {data.prefix} holds supervised conversations; train them with --task sft.")
        DPOPairs(data, self.cfg.model.seq_length, self.cfg.train.seed, 0)  # refuses prompts that leave no room

    def loss(self, reducer):
        f = self.cfg.posttrain
        self.dpo_loss = DPOLoss(reducer, self.cfg.model.vocab_size, beta=f.dpo_beta, kind=f.dpo_loss,
                                smoothing=f.dpo_label_smoothing, rpo_alpha=f.rpo_alpha)
        return self.dpo_loss

    def datasets(self) -> tuple:
        self.pairs = DPOPairs(self.chat_data(), self.cfg.model.seq_length, self.cfg.train.seed, self.pad_id())
        return self.pairs, None

    def prepare(self, run) -> None:
        if not self.cfg.model.lora_rank:  # the reference checkpoint, loaded before --load
            self._precompute_reference(run)

    def loaded(self, run) -> None:
        if self.cfg.model.lora_rank:  # the loaded base itself, adapters off
            self._precompute_reference(run)

    def _precompute_reference(self, run) -> None:
        if self.cfg.posttrain.reference == "precompute":
            from .reference import reference_logps
            self.reference = reference_logps(run, self)

    def checkpoint_files(self) -> dict:
        files = super().checkpoint_files()
        if self.reference_tag:  # a resumed run keeps this reference, though its --load is then the policy
            from .reference import REFERENCE_FILE
            files[REFERENCE_FILE] = json.dumps({"reference": self.reference_tag}) + "\n"
        return files

    def step_batches(self, run, batches: Iterator) -> Iterator:
        micro = [next(batches) for _ in range(self.cfg.gradient_accumulation_steps)]
        terms = sum(DPOLoss.counts(labels, ids) for _, (labels, ids) in micro)  # pairs, chosen reply tokens
        tokens = sum((labels != IGNORE_INDEX).sum() for _, (labels, _) in micro)  # for the log
        counts, scales = self.step_counts(run, [terms, tokens.to(torch.float64).reshape(1)])
        self.last_step_tokens = counts[2]
        self.loss_tokens = self.loss_tokens + counts[2]
        return iter([(rows, (labels, self._reference_rows(ids, labels.device), scales[:2]))
                     for rows, (labels, ids) in micro])

    def _reference_rows(self, pair_ids: torch.Tensor, device) -> torch.Tensor:
        """Reference log-prob sums of a micro-batch's rows: its pairs' chosen, then their rejected."""
        if self.reference is None:
            return torch.zeros(2 * len(pair_ids), dtype=torch.float32, device=device)
        if self.reference_on_device is None:  # once: the micro-batch's pair ids are then looked up where they are
            self.reference_on_device = torch.from_numpy(self.reference).to(device)
        rows = self.reference_on_device[pair_ids.to(device)]
        return torch.cat([rows[:, 0], rows[:, 1]]).to(torch.float32)

    def log_values(self, run, seconds: float) -> dict:
        sums = self.dpo_loss.take_sums(run.engine.device)
        # only the last stage computed them; under CP each CP rank holds the same sums and pair count,
        # so the ratios below stand
        for group in (run.ps.grad_reduction, run.ps.pp):
            if group.size > 1:
                dist.all_reduce(sums, group=group.group)
        pairs = max(sums[-1].item(), 1.0)
        values = {name: sums[i].item() / pairs for i, name in enumerate(DPO_METRICS)}
        values.update(super().log_values(run, seconds))
        return values

    def describe(self) -> str:
        f = self.cfg.posttrain
        smoothing = f" label smoothing {f.dpo_label_smoothing}" if f.dpo_label_smoothing else ""
        rpo = f", RPO alpha {f.rpo_alpha}" if f.rpo_alpha else ""
        return (f"dpo on {self.pairs.num_pairs:,} pairs, {f.dpo_loss} loss{smoothing}, beta {f.dpo_beta}{rpo}, "
                f"reference {'none' if f.reference == 'none' else self.reference_tag}")


class GRPOTask(PretrainTask):
    """The policy's own completions, rewarded: a rollout batch (``grpo.RolloutBatch``) is sampled every
    --num-iterations steps and trained on by the one step loop, as every task's batches are."""
    name = "grpo"

    def __init__(self, cfg: RunConfig):
        super().__init__(cfg)
        self.prompts = self.tokenizer = self.template = self.rewards = None
        self.stops: tuple = ()
        self.grpo_loss = self.sampler = self.batch = self.stats = None
        self.frozen = None  # the starting weights (--beta > 0 without LoRA)
        self.reference_tag = None  # the checkpoint folder they are
        self.warned: set = set()  # the reasons a rollout batch carried no signal, said once each

    def _setup(self) -> None:
        """Tokenizer, chat template, reward functions and prompts: files only, before any process group."""
        if self.prompts is not None:
            return
        d, f, m = self.cfg.data, self.cfg.posttrain, self.cfg.model
        self.tokenizer = build_tokenizer(d.tokenizer_type, d.tokenizer_model, d.vocab_file, d.merge_file)
        self.template = self._template()
        self.rewards = load_reward_functions(f.reward_funcs, f.format_pattern)
        room = m.seq_length - f.max_completion_length
        self.prompts = PromptSet(str(d.data_path[0]).split()[0], self.tokenizer, self.template, seed=self.cfg.train.seed,
                                 max_tokens=room, required_columns={"solution": "accuracy"} if "accuracy" in f.reward_funcs else {},
                                 limit_reason=f"--seq-length {m.seq_length} leaves beside --max-completion-length {f.max_completion_length}")
        self.stops = stop_tokens(self.tokenizer, self.template)
        dry_run_rewards(self.rewards, self.tokenizer, self.stops, self.prompts, f.num_generations)

    def _template(self):
        """The chat template the --load checkpoint was fine-tuned with, else its tokenizer's (None: none)."""
        t, d = self.cfg.train, self.cfg.data
        tag = tag_to_load(t.load, t.ckpt_step)
        saved = os.path.join(t.load, tag, TEMPLATE_FILE) if tag else None
        tokenizer_dir = d.tokenizer_model or ""
        if saved and os.path.isfile(saved):
            return load_template(tokenizer_dir, saved)
        if d.tokenizer_type == "HuggingFaceTokenizer" and os.path.isdir(tokenizer_dir):
            try:
                return load_template(tokenizer_dir)
            except ConfigError:
                return None  # plain-text prompts need none; a conversational one says so, naming its line
        return None

    def check(self) -> None:
        self._setup()

    def loss(self, reducer):
        f = self.cfg.posttrain
        self.grpo_loss = GRPOLoss(reducer, self.cfg.model.vocab_size, beta=f.beta, epsilon=f.epsilon,
                                  epsilon_high=f.epsilon if f.epsilon_high is None else f.epsilon_high, temperature=f.temperature)
        return self.grpo_loss

    def datasets(self) -> tuple:
        self._setup()
        return self.prompts, None

    def prepare(self, run) -> None:
        """A resumed GRPO run's reference is the checkpoint it started from (recorded in its checkpoints):
        loaded and frozen here, before --load brings the policy."""
        recorded = self._recorded_reference()
        if recorded and self._needs_frozen_copy():
            load_weights(run, recorded)
            self._freeze(run, recorded)

    def loaded(self, run) -> None:
        f = self.cfg.posttrain
        if self._needs_frozen_copy() and self.frozen is None:  # a fresh start: the reference is what --load loaded
            self._freeze(run, self._load_tag_dir())
        self.sampler = Sampler(run, Sampling(greedy=False, temperature=f.temperature, top_k=f.top_k, top_p=f.top_p,
                                             seed=self.cfg.train.seed), f.max_completion_length, self.stops, self.tokenizer.pad)
        self.stats = RolloutStats([r.name for r in self.rewards])
        self._restore_rank_state(run)

    def _needs_frozen_copy(self) -> bool:
        return self.cfg.posttrain.beta > 0 and not self.cfg.model.lora_rank

    def _load_tag_dir(self) -> str:
        t = self.cfg.train
        return os.path.abspath(os.path.join(t.load, tag_to_load(t.load, t.ckpt_step)))

    def _recorded_reference(self) -> str | None:
        path = os.path.join(self._load_tag_dir(), GRPO_REFERENCE_FILE)
        if not os.path.isfile(path):
            return None
        with open(path) as f:
            return json.load(f)["reference"]

    def _freeze(self, run, tag_dir: str) -> None:
        self.frozen, self.reference_tag = FrozenWeights(run.engine), tag_dir

    def _restore_rank_state(self, run) -> None:
        """The rollout stream and unfinished rollout batch of a resumed run, at the layout they were saved at."""
        tag_dir = self._load_tag_dir()
        path = task_state_file(tag_dir, dist.get_rank())
        if self.cfg.train.finetune or not os.path.isfile(path):
            return
        if read_info(tag_dir, "--load").layout != Layout.of_run(self.cfg):
            if dist.get_rank() == 0:
                print(f"grpo: {tag_dir} was saved at another layout: its rollout streams and any unfinished rollout batch "
                      "are not carried over; sampling restarts from --seed at the next step.", flush=True)
            return
        state = torch.load(path, weights_only=False)
        self.sampler.load_state(state["stream"])
        self.batch = moved(state["batch"], device())

    def rank_state(self) -> dict | None:
        return {"stream": self.sampler.state(), "batch": moved(self.batch, "cpu")}

    def checkpoint_files(self) -> dict:
        files = {TEMPLATE_FILE: self.template.text} if self.template is not None else {}
        if self.reference_tag:
            files[GRPO_REFERENCE_FILE] = json.dumps({"reference": self.reference_tag}) + "\n"
        return files

    def step_batches(self, run, batches: Iterator) -> Iterator:
        """This step's micro-batches: those of the current rollout batch, sampled anew every --num-iterations steps."""
        if self.batch is None or run.iteration >= self.batch.first_iteration + self.cfg.posttrain.num_iterations:
            self.batch = self._rollout(run)
        if self.batch.scales is None:
            _, self.batch.scales = self.step_counts(run, [self.batch.counts])
        self.grpo_loss.on_policy = self.batch.on_policy
        self.stats.steps += 1
        self.stats.trained_tokens += self.batch.trained_tokens
        return iter([(inputs, (*labels, self.batch.scales)) for inputs, labels in self.batch.micro_batches])

    def _rollout(self, run) -> RolloutBatch:
        f, t, ps = self.cfg.posttrain, self.cfg.train, run.ps
        g = f.num_generations
        start = synchronize()
        per_step = t.global_batch_size // g
        per_replica = per_step // ps.dp.size
        first = (run.iteration // f.num_iterations) * per_step + ps.dp.rank * per_replica
        prompts = [self.prompts.prompt(first + j) for j in range(per_replica) for _ in range(g)]
        completions = self.sampler.sample(run, [p.ids for p in prompts])
        rewards = shared_rewards(run, lambda: score(self.rewards, **reward_inputs(self.tokenizer, self.stops, self.prompts,
                                                                                   prompts, completions)), len(self.rewards))
        weights = np.asarray(f.reward_weights or [1.0] * len(self.rewards), dtype=np.float64)
        advantages, weighted = advantages_of(rewards, weights, g, f.scale_rewards, ps.dp)
        warn_if_no_signal(run, signal_counts(weighted, advantages, completions.truncated, f.mask_truncated_completions),
                          self.warned)
        self.stats.add(completions, rewards, weighted)
        self.stats.rollout_seconds += synchronize() - start
        return self.use_rollout(run, RolloutRows([list(p.ids) for p in prompts], completions.tokens, completions.truncated,
                                                 advantages.tolist()))

    def use_rollout(self, run, rows: RolloutRows) -> RolloutBatch:
        """The rollout batch of ``rows`` (this replica's), with the old log-probs (--num-iterations > 1) and
        the reference's (--beta > 0) computed here unless ``rows`` gives them."""
        f = self.cfg.posttrain
        batch = build_micro_batches(run, rows, pad_id=self.tokenizer.pad, first_iteration=run.iteration)
        start = synchronize()
        if rows.old is None and f.num_iterations > 1:
            batch = with_logps(batch, old=record_logps(run, batch, self.grpo_loss))
            batch.on_policy = False
        if f.beta and rows.reference is None:
            with reference_context(run.engine, self.frozen):
                batch = with_logps(batch, reference=record_logps(run, batch, self.grpo_loss))
        self.stats.logprob_seconds += synchronize() - start
        return batch

    def log_values(self, run, seconds: float) -> dict:
        values = metric_values(self.stats, self.grpo_loss.take_sums(device()), run, seconds, self.cfg.posttrain.beta)
        self.stats = RolloutStats(self.stats.names)
        return values

    def describe(self) -> str:
        f = self.cfg.posttrain
        weights = f.reward_weights or [1.0] * len(self.rewards)
        rewards = " + ".join(f"{w:g} x {r.name}" for w, r in zip(weights, self.rewards))
        clip = f"[{1 - f.epsilon:g}, {1 + (f.epsilon if f.epsilon_high is None else f.epsilon_high):g}]"
        if not f.beta:
            reference = "no reference (--beta 0)"
        elif self.frozen is None:
            reference = "reference: the base with its adapters off"
        else:
            reference = (f"reference: a frozen copy of {self.reference_tag}'s weights, "
                         f"{self.frozen.bytes / 2**30:.2f} GiB on this rank")
        return (f"grpo on {len(self.prompts):,} prompts, {f.num_generations} completions each of up to "
                f"{f.max_completion_length} tokens (temperature {f.temperature:g}), reward {rewards}, advantages scaled by "
                f"{f.scale_rewards}, {f.loss_type} loss, ratio clipped to {clip}, {f.num_iterations} step(s) per rollout, "
                f"beta {f.beta:g}, {reference}")


GRPO_REFERENCE_FILE = "grpo_reference.json"  # in each GRPO checkpoint (with a frozen reference): which weights it holds

TASKS = {"pretrain": PretrainTask, "sft": SFTTask, "dpo": DPOTask, "grpo": GRPOTask}


def build_task(cfg: RunConfig) -> PretrainTask:
    return TASKS[cfg.posttrain.task](cfg)

