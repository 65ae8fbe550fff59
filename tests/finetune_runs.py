"""What the fine-tuning tests share: tiny Hugging Face models with chat tokenizers, their imports,
chat data, the rank function that fine-tunes them, and transformers' side of the comparison.

``finetune`` runs in each rank: it builds the run from flags exactly as ``scripts/finetune.py``
does (model and tokenizer from the ``--load`` checkpoint), optionally evaluates the first global
batch under several DPO losses, trains ``steps`` steps and returns the losses and the live model's
full weights (gathered from the engine, independently of any file).
"""
from __future__ import annotations

import os
import random

import torch

from chat_fixtures import tokenizer_dir, write_jsonl
from oracle import ds_config

SEQ = 128
# The optimisation the transformers side repeats with torch.optim.AdamW: constant LR, no weight
# decay, no clipping (each is a flag with a default that another issue may change).
OPTIM = ["--lr", "1e-3", "--min-lr", "1e-3", "--lr-warmup-iters", "0", "--lr-decay-style", "constant", "--weight-decay", "0",
         "--clip-grad", "0", "--adam-beta1", "0.9", "--adam-beta2", "0.95", "--adam-eps", "1e-8", "--seed", "11",
         "--log-interval", "1"]
LR, BETAS, EPS = 1e-3, (0.9, 0.95), 1e-8
TP2PP2 = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"] + ds_config("zero1")
DP2_ZERO3 = ds_config("zero3")
TP2 = ["--tensor-model-parallel-size", "2"] + ds_config("zero1")
CP2 = ["--context-parallel-size", "2"] + ds_config("zero1")
MODELS = {"qwen2": "chatml", "llama": "llama3"}  # HF family -> the chat template its tokenizer carries


def hf_model_dir(directory, family: str, seed: int = 0, **config) -> str:
    """A tiny random HF model (Qwen2: tied embeddings, query/key/value biases; Llama: untied) with
    grouped-query attention and a chat tokenizer, saved offline as from_pretrained reads it;
    ``config``: other config values, overriding the sizes too (a larger initializer_range, for
    continuations that are not near-ties; a wider model)."""
    import transformers
    tokenizer_dir(MODELS[family], directory)
    common = {**dict(vocab_size=400, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, max_position_embeddings=2 * SEQ), **config}
    config = (transformers.Qwen2Config(**common, tie_word_embeddings=True) if family == "qwen2"
              else transformers.LlamaConfig(**common, tie_word_embeddings=False, rope_theta=50000.0))
    torch.manual_seed(seed)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(str(directory))
    return str(directory)


def imported(hf_dir: str, output) -> str:
    from hybridlm.interop.import_ import import_from_hf
    import_from_hf(hf_dir, str(output), seq_length=SEQ, progress=False, log=lambda line: None)
    return str(output)


def _words(rng, low: int, high: int) -> str:
    from chat_fixtures import WORDS
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(low, high)))


def sft_data(directory, tokenizer: str, count: int = 40, seed: int = 0) -> str:
    """Short one- or two-turn conversations (several fit a row of SEQ) -> a preprocess_chat prefix."""
    from hybridlm.data.chat_preprocess import preprocess_chat
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        messages = [{"role": "system", "content": "be brief"}]  # shorter than ChatML's default system prompt
        for _ in range(rng.choice((1, 1, 1, 1, 2))):
            messages += [{"role": "user", "content": _words(rng, 1, 3)}, {"role": "assistant", "content": _words(rng, 1, 4)}]
        rows.append({"messages": messages})
    prefix = os.path.join(str(directory), "chat")
    preprocess_chat([write_jsonl(os.path.join(str(directory), "chat.jsonl"), rows)], prefix, tokenizer, progress=False)
    return prefix


def preference_data(directory, tokenizer: str, count: int = 8, seed: int = 1) -> str:
    """Pairs whose chosen and rejected replies differ in length; the last one is longer than a row."""
    from hybridlm.data.chat_preprocess import preprocess_chat
    rng = random.Random(seed)
    rows = [{"prompt": _words(rng, 2, 8), "chosen": _words(rng, 1, 10), "rejected": _words(rng, 3, 14)} for _ in range(count - 1)]
    rows.append({"prompt": _words(rng, 3, 4), "chosen": _words(rng, 60, 60), "rejected": _words(rng, 2, 3)})
    prefix = os.path.join(str(directory), "pref")
    preprocess_chat([write_jsonl(os.path.join(str(directory), "pref.jsonl"), rows)], prefix, tokenizer, progress=False)
    return prefix


def finetune(flags: list[str], steps: int = 1, dpo_losses: tuple = (), mutate_packing: bool = False, save: bool = False) -> dict:
    """In each rank: (evaluate the first global batch under each (loss, label smoothing, RPO alpha) of
    ``dpo_losses``,) train ``steps`` steps (and save); the losses, DPO values and live full weights."""
    import logging

    from deepspeed.utils import logger

    from hybridlm.training.finetune import parse_finetune_args
    from hybridlm.training.trainer import build_run, data_iterator, evaluate, prepare_config, save_checkpoint, train_step
    from interop_runs import _live_state

    logger.setLevel(logging.WARNING)
    if mutate_packing:  # the mutation check: packed samples may attend to each other (plain causal)
        import hybridlm.model.attention_backends as backends
        backends.packed_causal_mask = lambda positions: torch.ones(
            positions.shape[-1], positions.shape[-1], dtype=torch.bool, device=positions.device).tril()
    cfg, ds = prepare_config(parse_finetune_args(flags))
    run = build_run(cfg, ds)
    result = {"dpo": {}}
    for variant in dpo_losses:
        loss_fn = run.task.dpo_loss
        loss_fn.kind, loss_fn.smoothing, loss_fn.rpo_alpha = variant
        loss = evaluate(run, run.train_data, iters=1)
        result["dpo"][variant] = {"loss": loss, **run.task.log_values(run, 1.0)}
    batches = data_iterator(run)
    result["losses"], result["grad_norms"] = [], []
    for _ in range(steps):
        result["losses"].append(train_step(run, batches).item())
        result["grad_norms"].append(run.engine.get_global_grad_norm())
    result["weights"] = _live_state(run, False)["weight"]
    result["reference"] = getattr(run.task, "reference_tag", None)
    if save:
        save_checkpoint(run)
    return result


# ---------------------------------------------------------------- transformers' side

def hf_model(hf_dir: str):
    import transformers
    return transformers.AutoModelForCausalLM.from_pretrained(hf_dir, local_files_only=True, torch_dtype=torch.float32)


def sample_labels(prefix: str, doc: int, limit: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [1, L], labels [L - 1] with -100 outside the trained tokens) of document ``doc``, truncated to ``limit``."""
    from hybridlm.data.chat_dataset import ChatData
    ids, mask = ChatData(prefix).sample(doc, limit)
    ids_t = torch.from_numpy(ids)
    labels = torch.where(torch.from_numpy(mask[1:]), ids_t[1:], torch.full_like(ids_t[1:], -100))
    return ids_t[None], labels


def token_loss_sums(model, prefix: str, docs: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per document: the summed next-token loss over its trained tokens, and their count (unpacked, one forward each)."""
    sums, counts = [], []
    for doc in docs:
        ids, labels = sample_labels(prefix, doc, SEQ + 1)
        logits = model(ids).logits[0, :-1]
        sums.append(torch.nn.functional.cross_entropy(logits, labels, ignore_index=-100, reduction="sum"))
        counts.append((labels != -100).sum())
    return torch.stack(sums), torch.stack(counts)


def as_hf_names(weights: dict, checkpoint: str) -> dict:
    """hybridlm's full weights under the Hugging Face names the export would write."""
    from hybridlm.interop.hf_names import export_architecture, parameter_rules
    from hybridlm.interop.layout import read_info, resolve_tag_dir
    cfg = read_info(resolve_tag_dir(checkpoint)).model_config(tp=1)
    rules = parameter_rules(export_architecture(cfg), cfg, list(weights))
    out = {}
    for name, tensor in weights.items():
        out.update(zip(rules[name].theirs, rules[name].split(tensor)))
    return out
