"""--manual-gc: no automatic collections during training; one every --manual-gc-interval steps."""
from __future__ import annotations

import gc

from harness import run_ranks
from oracle import TINY, ds_config


def _collections_during_training(flags):
    from hybridlm.training.trainer import pretrain
    collections = []
    iteration = {"now": None}

    def record(phase, info):
        if phase == "start":
            collections.append((iteration["now"], info["generation"]))

    def garbage_maker(module, args):  # reference cycles at every layer call: the automatic collector would run
        for _ in range(2000):
            a = []
            a.append(a)

    from hybridlm.training import trainer
    step = trainer.train_step

    def counted_step(run, batches):
        iteration["now"] = run.iteration + 1
        if not hasattr(run, "_hooked"):
            run.engine.module.register_forward_pre_hook(garbage_maker)
            run._hooked = True
        return step(run, batches)

    trainer.train_step = counted_step
    gc.callbacks.append(record)
    try:
        pretrain(flags)
    finally:
        gc.callbacks.remove(record)
        trainer.train_step = step
    return collections, gc.isenabled()


def test_manual_gc_collects_only_at_its_interval_and_restores_the_collector():
    flags = TINY + ds_config("zero1") + ["--train-iters", "4", "--log-interval", "4", "--manual-gc", "--manual-gc-interval", "2"]
    collections, enabled_after = run_ranks(1, _collections_during_training, flags)[0]
    during = [(it, gen) for it, gen in collections if it is not None]
    # after steps 2 and 4 (recorded while the counter still says that step), full collections only
    assert during == [(2, 2), (4, 2)], collections
    assert enabled_after


def test_without_manual_gc_the_automatic_collector_runs_as_usual():
    collections, _ = run_ranks(1, _collections_during_training, TINY + ds_config("zero1") + ["--train-iters", "2", "--log-interval", "2"])[0]
    assert any(it is not None and gen == 0 for it, gen in collections), "the cycles made no automatic collection: the test cannot tell"
