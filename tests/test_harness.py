"""The test harness's ranks: forked by default (cheap), spawned where a rank must start from nothing.

A spawned rank is what a test whose rank uses CUDA needs (tests/test_qlora.py's GPU test): the test
process has asked ``torch.cuda.is_available()`` (conftest.py), after which a forked child cannot
initialise CUDA. That part needs a GPU; what is checked here is that a spawned rank is a fresh
interpreter that still gets its rank's environment and hands its result back.
"""
from __future__ import annotations

import os
import sys

from harness import run_ranks


def _what_the_rank_sees() -> tuple[str, str, bool]:
    return os.environ["RANK"], os.environ["WORLD_SIZE"], "hybridlm.training.trainer" in sys.modules


def test_a_spawned_rank_starts_from_a_fresh_interpreter_with_its_rank_set():
    assert "hybridlm.training.trainer" in sys.modules  # conftest.py imports it into the test process
    assert run_ranks(1, _what_the_rank_sees) == [("0", "1", True)]  # a forked rank inherits it
    assert run_ranks(2, _what_the_rank_sees, start_method="spawn", timeout=120) == [("0", "2", False), ("1", "2", False)]
