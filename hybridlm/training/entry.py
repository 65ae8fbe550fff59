"""What ``scripts/pretrain.py`` and ``scripts/finetune.py`` run: the checks the flags and the DeepSpeed JSON decide
alone, before torch is imported, then the job (``trainer.main``).

Why: every rank of a refused launch refuses, and before these checks each one first imported torch, DeepSpeed and,
through DeepSpeed's ZeRO, torch's compiler (about 7 s of CPU a rank on a small machine, more from a shared file
system at scale) only to print a sentence the command line had already decided. The full checks still run in
``trainer.prepare_config``, in the same order; this only answers the layout's and the JSON's refusals sooner.
"""
from __future__ import annotations

import sys
from typing import Callable, Optional

from ..config import ConfigError, RunConfig, parse_args, world_size_from_env
from .ds_config import ds_config_of


def refusal(argv: Optional[list[str]], parse: Callable[[Optional[list[str]]], RunConfig] = parse_args) -> Optional[str]:
    """The sentence refusing this command, where the flags, the JSON and the launched world decide it; else None
    (and whatever else is wrong is the trainer's to say)."""
    try:
        cfg = parse(argv)
        ds_config_of(cfg)
        cfg.validate(world_size_from_env())
    except ConfigError as e:
        return str(e)
    return None


def main(argv: Optional[list[str]] = None, parse: Callable[[Optional[list[str]]], RunConfig] = parse_args) -> int:
    """scripts/pretrain.py (and finetune.py, with its ``parse``): a refused run is one sentence and exit code 2 on every
    rank, torch unimported; else the job."""
    sentence = refusal(argv, parse)
    if sentence is not None:
        print(f"error: {sentence}", flush=True, file=sys.stderr)
        return 2
    from .trainer import main as train_main
    return train_main(argv, parse)
