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
    return _import_trainer()(argv, parse)


def _import_trainer() -> Callable:
    """``trainer.main``, imported with Python's cyclic collector paused, and all the import made then frozen.

    Why: importing torch, DeepSpeed and torch's compiler (which every torch optimizer's constructor imports) makes about
    650,000 objects, and the collector walked all of them again at each of its full collections while they were made
    and through the run: about 1 s of a rank's 5 s of imports on a small CPU machine, and pauses of a long GPU run
    (Megatron-LM's --manual-gc exists for those). Module-level objects never become garbage, so ``gc.freeze`` takes
    them out of every later collection; what the run itself makes is collected as before."""
    import gc
    collecting = gc.isenabled()
    gc.disable()
    try:
        import torch._dynamo  # noqa: F401  (torch.optim.Optimizer.__init__ imports it: here, inside the pause)

        from .trainer import main
    finally:
        gc.freeze()
        if collecting:
            gc.enable()
    return main
