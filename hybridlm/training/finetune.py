"""``scripts/finetune.py``: the training loop with ``--task sft``, ``dpo`` or ``grpo``, the model read from
the checkpoint it starts from.

``--load ckpt/`` (what ``convert_from_hf.py`` writes, or any hybridlm checkpoint) already says
which model it holds and which tokenizer it came with: its ``config.yaml`` supplies the model and
tokenizer settings, under a ``--config`` file and the flags (which win), so
``finetune.py --task sft --load ckpt/ --data-path data/chat`` needs no model flags. Every other
pretraining flag (layout, ZeRO, offload, recompute, precision, schedule) means what it means there.
"""
from __future__ import annotations

import dataclasses
import os
import sys
from typing import Optional

from ..config import ConfigError, ModelConfig, RunConfig, load_yaml, parse_args

TOKENIZER_SETTINGS = ("tokenizer_type", "tokenizer_model", "vocab_file", "merge_file")


def checkpoint_settings(load: str) -> dict:
    """The model and tokenizer settings saved with the checkpoint ``--load`` picks ({} when it has none)."""
    from ..interop.layout import CONFIG_FILE, resolve_tag_dir
    if not os.path.isdir(load):
        return {}
    for directory in (resolve_tag_dir(load, "--load"), load):
        path = os.path.join(directory, CONFIG_FILE)
        if os.path.isfile(path):
            saved = load_yaml(path)
            wanted = {f.name for f in dataclasses.fields(ModelConfig) if f.metadata.get("cli", True)} | set(TOKENIZER_SETTINGS)
            return {k: v for k, v in saved.items() if k in wanted}
    return {}


def parse_finetune_args(argv: Optional[list[str]] = None) -> RunConfig:
    """Flags (over ``--config``, over the ``--load`` checkpoint's model and tokenizer) -> RunConfig."""
    argv = sys.argv[1:] if argv is None else argv
    cfg = parse_args(argv)
    if cfg.posttrain.task == "pretrain":
        raise ConfigError("scripts/finetune.py needs --task sft, --task dpo or --task grpo (scripts/pretrain.py pretrains).")
    load = cfg.train.load
    if not load:
        return cfg
    from .checkpoint import require_checkpoint
    require_checkpoint(load, cfg.train.ckpt_step)  # a mistyped path must not fine-tune a random model
    return parse_args(argv, base=checkpoint_settings(load))


def main(argv: Optional[list[str]] = None) -> int:
    from .entry import main as entry_main
    return entry_main(argv, parse=parse_finetune_args)
