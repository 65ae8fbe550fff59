"""A save that cannot be written (issue 47, item 4): one sentence on every rank naming the directory, the cause
and the free space, its partial step folder removed, ``latest`` kept, a non-zero exit, and no rank left waiting;
a damaged step folder given to --load is one sentence before any process group; every save says what it wrote."""
from __future__ import annotations

import errno
import os
import re
import resource
import signal

from harness import run_ranks
from oracle import TINY, ds_config
from test_user_mistakes import _main

FLAGS = TINY + ds_config("zero1") + ["--train-iters", "4", "--save-interval", "2"]


def _main_with_a_full_disk_on(rank: int, flags: list[str]):
    """main() where, after the first checkpoint, writes of rank ``rank`` fail as on a full disk (a file-size cap)."""
    import torch.distributed as dist

    from hybridlm.training import trainer
    original = trainer.save_checkpoint

    def save_then_fill_disk(run):
        original(run)
        if dist.get_rank() == rank:
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the cap fails (EFBIG) instead of killing us
            resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))

    trainer.save_checkpoint = save_then_fill_disk
    return _main(flags)


def test_a_save_failing_on_one_rank_stops_every_rank_in_one_sentence_and_removes_its_partial_folder(tmp_path):
    from hybridlm.training.trainer import SAVE_FAILED_EXIT_CODE
    results = run_ranks(2, _main_with_a_full_disk_on, 1, FLAGS + ["--save", str(tmp_path)], timeout=120)
    assert [code for code, *_ in results] == [SAVE_FAILED_EXIT_CODE] * 2
    for _, _, err, _ in results:
        assert err.count("\n") == 1 and err.startswith(f"error: saving global_step4 to --save {tmp_path} failed, writing "
                                                        "global_step4/"), err
        assert "free there)" in err
        assert "removed the partial global_step4, 'latest' still names global_step2" in err
    assert (tmp_path / "latest").read_text() == "global_step2"
    assert not (tmp_path / "global_step4").exists()


def test_every_save_logs_the_step_the_directory_the_size_and_the_time(tmp_path):
    code, out, _, _ = run_ranks(1, _main, TINY + ds_config("zero0") + ["--train-iters", "1", "--save", str(tmp_path)])[0]
    assert code == 0
    assert re.search(rf"saved global_step1 to {re.escape(str(tmp_path))} \(\d+\.\d (KiB|MiB), \d+\.\d s\)", out), out


def test_loading_a_damaged_step_folder_is_one_sentence_before_any_process_group(tmp_path):
    flags = TINY + ds_config("zero0") + ["--train-iters", "1"]
    assert run_ranks(1, _main, flags + ["--save", str(tmp_path)])[0][0] == 0
    states = tmp_path / "global_step1" / "mp_rank_00_model_states.pt"
    with open(states, "r+b") as f:
        f.truncate(1000)  # what a save interrupted by a full disk leaves
    code, _, err, process_group = run_ranks(1, _main, flags + ["--train-iters", "2", "--load", str(tmp_path), "--ckpt-step", "1"])[0]
    assert (code, process_group) == (2, False)
    assert err == (f"error: --load {tmp_path}: checkpoint global_step1 is damaged: mp_rank_00_model_states.pt is truncated "
                   "or not a checkpoint file (a save that did not complete?); load another step with --ckpt-step.\n")


def test_a_full_disk_is_named_with_the_file_and_the_free_space(tmp_path):
    from hybridlm.training.checkpoint_io import describe
    sentence = describe(os.path.join(tmp_path, "global_step4", "mp_rank_00_model_states.pt"),
                        OSError(errno.ENOSPC, "No space left on device"), str(tmp_path))
    assert sentence.startswith("writing global_step4/mp_rank_00_model_states.pt: No space left on device (")
    assert sentence.endswith(" free there)")
