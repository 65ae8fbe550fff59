"""GRPO's prompts: a JSONL file read whole, each prompt tokenized once, handed out in a seeded
order per epoch (``chat_formats.read_prompt`` says which lines are prompts).

A conversational prompt (messages) is rendered with the chat template and the generation prompt
(``apply_chat_template(add_generation_prompt=True)``) and tokenized without the tokenizer's special
tokens, as for SFT; a plain-text prompt is tokenized as the tokenizer does (its own BOS, if any).
Every other key of a line is a column the reward functions receive. The file is small next to a
pretraining corpus (prompts, not documents), so it is read into memory and checked line by line
before any process group: a bad line ends the run in one sentence naming ``file:line``.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from ..config import ConfigError
from .chat_formats import LineError, read_prompt
from .chat_template import ChatTemplate, TemplateError, end_of_turn_id
from .preprocess import _parse_json
from .tokenizers import HFTokenizer


@dataclass(frozen=True)
class Prompt:
    ids: tuple  # the prompt's tokens
    given: object  # the prompt as the reward functions see it: text, or its messages
    columns: dict  # every other key of the line
    conversational: bool


class PromptSet:
    """The prompts of ``path``; ``prompt(i)`` is the i-th of the shuffled stream (epoch after epoch,
    each a permutation seeded by ``seed`` and the epoch)."""

    def __init__(self, path: str, tokenizer, template: Optional[ChatTemplate], *, seed: int, max_tokens: int,
                 required_columns: Optional[dict] = None, limit_reason: str = ""):
        if not os.path.isfile(path):
            raise ConfigError(f"--data-path {path}: no such file (GRPO reads a JSONL file of prompts).")
        self.path, self.seed, self.template = path, seed, template
        self.prompts: list[Prompt] = []
        with open(path, "rb") as f:
            for number, raw in enumerate(f, start=1):
                if raw.strip():
                    try:
                        self.prompts.append(self._read(raw, tokenizer, max_tokens, required_columns or {}, limit_reason))
                    except (LineError, TemplateError) as e:
                        raise ConfigError(f"{path}:{number}: {e}") from None
        if not self.prompts:
            raise ConfigError(f"--data-path {path} holds no prompt.")
        self._orders: dict[int, np.ndarray] = {}

    def _read(self, raw: bytes, tokenizer, max_tokens: int, required: dict, limit_reason: str) -> Prompt:
        """``required``: {column: the reward function that reads it}."""
        obj, reason = _parse_json(raw)
        if reason is not None:
            raise LineError(reason)
        key, given, messages = read_prompt(obj)
        columns = {k: v for k, v in obj.items() if k != key}
        missing = [c for c in required if c not in columns]
        if missing:
            raise LineError(f"no '{missing[0]}' column, which the {required[missing[0]]} reward reads")
        if messages is None:
            ids = tokenizer.encode(given)
        else:
            if self.template is None or not isinstance(tokenizer, HFTokenizer):
                raise LineError("a conversational prompt needs a Hugging Face tokenizer with a chat template "
                                "(--tokenizer-type HuggingFaceTokenizer; the --load checkpoint's)")
            text = self.template.render(messages, add_generation_prompt=True, tools=obj.get("tools"))
            ids = tokenizer.tok.encode(text, add_special_tokens=False).ids
        if not ids:
            raise LineError("the prompt renders to no token")
        if len(ids) > max_tokens:
            raise LineError(f"the prompt is {len(ids)} tokens, more than the {max_tokens} {limit_reason}")
        return Prompt(tuple(ids), given, columns, messages is not None)

    def __len__(self) -> int:
        return len(self.prompts)

    def prompt(self, index: int) -> Prompt:
        epoch, at = divmod(index, len(self.prompts))
        if epoch not in self._orders:
            self._orders = {epoch: np.random.RandomState((self.seed + epoch) % 2**32).permutation(len(self.prompts))}
        return self.prompts[int(self._orders[epoch][at])]

    @property
    def column_names(self) -> list[str]:
        names: dict = {}
        for p in self.prompts:
            names.update(dict.fromkeys(p.columns))
        return list(names)


def stop_tokens(tokenizer, template: Optional[ChatTemplate]) -> tuple[int, ...]:
    """The tokens that end a completion: the end of text, and the end of a turn under the chat template
    (ChatML's <|im_end|>, Llama 3's <|eot_id|>), as a model's generation_config lists them."""
    stops = [tokenizer.eod]
    if template is not None and isinstance(tokenizer, HFTokenizer):
        end = end_of_turn_id(template, tokenizer.tok)
        if end is not None:
            stops.append(end)
    return tuple(dict.fromkeys(stops))


def completion_text(tokenizer, ids: Sequence[int], stops: Sequence[int]) -> str:
    """A completion's text for the reward functions: special tokens left out (transformers'
    ``decode(skip_special_tokens=True)``, as TRL decodes), the stop token with them."""
    if isinstance(tokenizer, HFTokenizer):
        return tokenizer.tok.decode(list(ids), skip_special_tokens=True)
    return tokenizer.decode([t for t in ids if t not in stops])
