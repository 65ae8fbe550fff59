"""Tiny offline Hugging Face tokenizers with real chat templates, and random conversations.

``tokenizer_dir(kind, directory)`` writes a byte-level BPE (trained on a few lines, so it has
merges that can cross a template's boundaries) with the special tokens of the ChatML (Qwen2) or
Llama-3 template, and that template, as ``transformers`` saves a tokenizer. The Llama-3 one also
prepends BOS in its post-processor, as the real one does, so a tokenization that let the
tokenizer add its specials on top of the template's BOS would show a double BOS.
"""
from __future__ import annotations

import json
import os
import random

CHATML = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
          "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
          "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
LLAMA3 = ("{% set loop_messages = messages %}{% for message in loop_messages %}"
          "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' %}"
          "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}")

KINDS = {
    "chatml": dict(template=CHATML, specials=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                   eos="<|im_end|>", bos=None, pad="<|endoftext|>", end_of_turn="<|im_end|>"),
    "llama3": dict(template=LLAMA3, specials=["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                                              "<|end_header_id|>", "<|eot_id|>"],
                   eos="<|eot_id|>", bos="<|begin_of_text|>", pad="<|end_of_text|>", end_of_turn="<|eot_id|>"),
}
SPLIT = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
WORDS = ("the cat sat on a mat and then it ran far away from home because dogs bark loudly at night "
         "numbers like 12 345 and symbols !? are fine, so are newlines\nand tabs\t and café, naïve, 東京").split(" ")


def tokenizer_dir(kind: str, directory, vocab_size: int = 400) -> str:
    """A Hugging Face tokenizer directory for ``kind`` (chatml | llama3) in ``directory``."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast
    spec = KINDS[kind]
    tok = Tokenizer(models.BPE())
    # Llama-3's and Qwen2's split (newline runs stay whole), then bytes as characters
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(SPLIT), behavior="isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=spec["specials"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    lines = [" ".join(WORDS[i:] + WORDS[:i]) for i in range(len(WORDS))] + ["system\nuser\nassistant\n\n"] * 20
    tok.train_from_iterator(lines, trainer=trainer)
    if spec["bos"]:
        bos = spec["bos"]
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                           special_tokens=[(bos, tok.token_to_id(bos))])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=spec["eos"], bos_token=spec["bos"], pad_token=spec["pad"])
    fast.chat_template = spec["template"]
    fast.save_pretrained(str(directory))
    return str(directory)


def random_conversation(rng: random.Random, *, system: bool | None = None, turns: int | None = None) -> list[dict]:
    """user/assistant turns (optionally a system message first) of random words."""
    def text():
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 12)))
    messages = [{"role": "system", "content": text()}] if (rng.random() < 0.3 if system is None else system) else []
    for _ in range(turns or rng.randint(1, 4)):
        messages += [{"role": "user", "content": text()}, {"role": "assistant", "content": text()}]
    return messages


def write_jsonl(path, rows) -> str:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return str(path)


def hf_tokenizer(directory):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(directory), local_files_only=True)


def end_of_turn_id(kind: str, directory) -> int:
    return hf_tokenizer(directory).convert_tokens_to_ids(KINDS[kind]["end_of_turn"])


__all__ = ["CHATML", "LLAMA3", "KINDS", "tokenizer_dir", "random_conversation", "write_jsonl", "hf_tokenizer", "end_of_turn_id"]
