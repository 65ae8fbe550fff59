"""A rank that dies takes the job down within a bounded time; nobody hangs in a collective."""
from __future__ import annotations

import os
import signal
import time

from harness import start_ranks
from oracle import TINY, ds_config


def _train(flags):
    from hybridlm.training.trainer import pretrain
    pretrain(flags)


def test_killing_one_rank_ends_the_others_within_the_collective_timeout(tmp_path):
    metrics = tmp_path / "m.jsonl"
    flags = TINY + ds_config("zero1") + ["--train-iters", "100000", "--log-interval", "1", "--metrics-file", str(metrics),
                                         "--distributed-timeout-minutes", "0.5"]
    procs = start_ranks(2, _train, flags)
    try:
        deadline = time.monotonic() + 120
        while not (metrics.exists() and metrics.read_text().count("\n") >= 2):
            assert time.monotonic() < deadline, "training never started"
            assert all(p.is_alive() for p in procs), "a rank ended before the kill"
            time.sleep(0.2)
        os.kill(procs[1].pid, signal.SIGKILL)
        killed_at = time.monotonic()
        procs[0].join(timeout=90)
        assert not procs[0].is_alive(), "rank 0 still hangs 90 s after its peer died"
        print(f"rank 0 exited {time.monotonic() - killed_at:.1f} s after rank 1 was killed")
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
