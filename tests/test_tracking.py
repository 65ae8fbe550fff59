"""W&B (offline) and TensorBoard trackers: what the loop logs is what lands on disk.

The W&B run is read back from its own transaction log (``run-<id>.wandb``): offline mode
writes no summary JSON, and this wandb has no Python reader, so ``_wandb_records`` decodes
the file directly: a LevelDB-style log (7-byte ``:W&B`` header, 32 KiB blocks, records
split into FULL/FIRST/MIDDLE/LAST chunks) of ``wandb_internal_pb2.Record`` protobufs.
"""
from __future__ import annotations

import json
import os
import re
import struct
import sys
import time
import zlib
from pathlib import Path

import pytest

from hybridlm.config import ConfigError
from hybridlm.training.tracking import (TensorBoardTracker, WandbTracker, build_trackers, check_backends, close_all,
                                        log_all, wandb_run_id)

STEPS = {1: {"loss": 2.5, "lr": 1e-4, "grad_norm": 0.75, "mfu": None},
         2: {"loss": 2.0, "lr": 2e-4, "grad_norm": 0.5, "mfu": None},
         3: {"loss": 1.5, "lr": 3e-4, "grad_norm": 0.25, "mfu": None}}
CONFIG = {"model": {"hidden_size": 128, "num_layers": 4}, "train": {"lr": 3e-4, "seed": 1234}}


def _wandb_records(path: Path, timeout: float = 10.0) -> list:
    """The run's records, once wandb-core has written the final ``exit`` record.

    ``run.finish()`` can return before wandb-core flushes the log (seen: a 7-byte file for
    ~50 ms afterwards), so an in-process reader waits for the run's last record.
    """
    deadline = time.monotonic() + timeout
    while True:
        records = _decode_wandb_log(path.read_bytes())
        if records and records[-1].WhichOneof("record_type") == "exit":
            return records
        assert time.monotonic() < deadline, f"{path} has no exit record after {timeout} s"
        time.sleep(0.05)


def _decode_wandb_log(data: bytes) -> list:
    from wandb.proto import wandb_internal_pb2

    assert struct.unpack("<4sHB", data[:7]) == (b":W&B", 0xBEE1, 0), "not a version-0 W&B transaction log"
    block, pos, chunks, records = 32768, 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a chunk header is padding
            pos += block - pos % block
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if pos + 7 + length > len(data):  # still being written
            break
        payload = data[pos + 7:pos + 7 + length]
        assert crc == zlib.crc32(bytes([kind]) + payload), f"bad checksum at byte {pos}"
        pos += 7 + length
        chunks += payload
        if kind in (1, 4):  # FULL or LAST: a whole record is assembled
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunks)
            records.append(record)
            chunks = b""
    return records


def _only_run_folder(wandb_dir: Path) -> Path:
    folders = list((wandb_dir / "wandb").glob("offline-run-*"))
    assert len(folders) == 1, folders
    return folders[0]


def _history(records) -> dict[int, dict]:
    """step -> {metric: value} from the history records (wandb's own _step, _runtime ... left out)."""
    rows = {}
    for r in records:
        if r.WhichOneof("record_type") == "history":
            rows[r.history.step.num] = {"/".join(i.nested_key) or i.key: json.loads(i.value_json)
                                        for i in r.history.item if not (i.key or i.nested_key[0]).startswith("_")}
    return rows


def _run_record(records):
    return next(r.run for r in records if r.WhichOneof("record_type") == "run")


def _log_three_steps(trackers):
    for step, metrics in STEPS.items():
        log_all(trackers, metrics, step)
    close_all(trackers)


def test_wandb_offline_run_holds_the_logged_values_and_config(tmp_path):
    tracker = WandbTracker("hybridlm-test", "tiny", str(tmp_path), CONFIG, resume_id=None)
    run_id = tracker.run_id
    _log_three_steps([tracker])

    folder = _only_run_folder(tmp_path)
    records = _wandb_records(folder / f"run-{run_id}.wandb")
    want = {step: {k: v for k, v in m.items() if v is not None} for step, m in STEPS.items()}
    assert _history(records) == want  # mfu=None was dropped, not logged as null
    run = _run_record(records)
    assert (run.run_id, run.project, run.display_name) == (run_id, "hybridlm-test", "tiny")
    config = {i.key: json.loads(i.value_json) for i in run.config.update if i.key != "_wandb"}
    assert config == CONFIG


def test_wandb_resume_with_the_stored_run_id_continues_the_same_run(tmp_path):
    first = WandbTracker("hybridlm-test", "tiny", str(tmp_path / "first"), CONFIG, resume_id=None)
    run_id = first.run_id
    log_all([first], STEPS[1], 1)
    close_all([first])

    resumed = WandbTracker("hybridlm-test", "tiny", str(tmp_path / "resumed"), CONFIG, resume_id=run_id)
    assert resumed.run_id == run_id
    log_all([resumed], STEPS[2], 2)
    close_all([resumed])

    folder = _only_run_folder(tmp_path / "resumed")
    assert folder.name.endswith(f"-{run_id}")  # `wandb sync` uploads both folders into one run
    records = _wandb_records(folder / f"run-{run_id}.wandb")
    run = _run_record(records)
    assert run.run_id == run_id and run.resume
    assert _history(records) == {2: {"loss": 2.0, "lr": 2e-4, "grad_norm": 0.5}}


def test_tensorboard_event_file_holds_each_scalar_at_its_step(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _log_three_steps([TensorBoardTracker(str(tmp_path))])
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert sorted(events.Tags()["scalars"]) == ["grad_norm", "loss", "lr"]  # None values skipped
    for key in ("loss", "lr", "grad_norm"):
        got = [(e.step, e.value) for e in events.Scalars(key)]
        want = [(step, pytest.approx(m[key], rel=1e-6)) for step, m in STEPS.items()]  # stored as float32
        assert got == want, key


def test_tensorboard_skips_strings(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tracker = TensorBoardTracker(str(tmp_path))
    tracker.log({"loss": 1.0, "note": "warmup"}, 1)
    tracker.close()
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert events.Tags()["scalars"] == ["loss"]


def test_rank0_gets_one_tracker_per_configured_backend(tmp_path):
    trackers = build_trackers(rank=0, wandb_project="hybridlm-test", wandb_name=None, wandb_dir=str(tmp_path),
                              tensorboard_dir=str(tmp_path / "tb"), config=CONFIG)
    try:
        assert [type(t) for t in trackers] == [WandbTracker, TensorBoardTracker]
        assert wandb_run_id(trackers) == trackers[0].run_id
    finally:
        close_all(trackers)
    assert build_trackers(rank=0, wandb_project=None, wandb_name=None, wandb_dir=None, tensorboard_dir=None,
                          config=CONFIG) == []


def test_nonzero_ranks_get_no_trackers(tmp_path):
    trackers = build_trackers(rank=1, wandb_project="hybridlm-test", wandb_name=None, wandb_dir=str(tmp_path),
                              tensorboard_dir=str(tmp_path / "tb"), config=CONFIG)
    assert trackers == [] and wandb_run_id(trackers) is None
    assert not any(tmp_path.iterdir())  # nothing was written either


@pytest.mark.parametrize("flag, package", [("--wandb-project", "wandb"), ("--tensorboard-dir", "tensorboard")])
def test_missing_backend_package_is_a_one_sentence_config_error(tmp_path, monkeypatch, flag, package):
    monkeypatch.setitem(sys.modules, package, None)  # makes `import <package>` raise ImportError
    backends = {"wandb_project": "hybridlm-test" if package == "wandb" else None,
                "tensorboard_dir": str(tmp_path / "tb") if package == "tensorboard" else None}
    sentence = rf"^{flag} \S+ needs the {package} package; pip install {package}, or omit {flag}\.$"
    with pytest.raises(ConfigError, match=sentence):
        check_backends(**backends)
    with pytest.raises(ConfigError, match=sentence):
        build_trackers(rank=0, wandb_name=None, wandb_dir=str(tmp_path), config=CONFIG, **backends)
    assert not any(tmp_path.iterdir())


def _train(flags):
    from hybridlm.training.trainer import pretrain
    return [r["loss"] for r in pretrain(flags + ["--log-interval", "1"])]


def test_training_logs_to_wandb_and_tensorboard_and_a_resume_continues_the_same_wandb_run(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from harness import run_ranks
    from oracle import TINY, ds_config
    save = tmp_path / "ckpt"
    flags = TINY + ["--pipeline-model-parallel-size", "2", "--lr-decay-iters", "4", "--save", str(save),
                    "--wandb-project", "hybridlm-test", "--tensorboard-dir", str(tmp_path / "tb"),
                    "--profile-dir", str(tmp_path / "prof")] + ds_config("zero1")
    first = run_ranks(2, _train, flags + ["--train-iters", "2", "--profile-step-range", "0,1"])[0]
    second = run_ranks(2, _train, flags + ["--train-iters", "4", "--load", str(save)])[0]
    folders = sorted((save / "wandb").glob("offline-run-*"))
    # offline-run-<date>_<time>-<id>, and W&B appends -1 when a resume starts within the same second
    run_ids = {re.match(r"offline-run-\d{8}_\d{6}-([a-z0-9]+)", folder.name).group(1) for folder in folders}
    assert len(run_ids) == 1, f"the resumed job started a new W&B run: {folders}"
    history = {}
    for folder in folders:
        history.update(_history(_wandb_records(folder / f"run-{next(iter(run_ids))}.wandb")))
    assert sorted(history) == [1, 2, 3, 4]
    assert [history[i]["loss"] for i in (1, 2, 3, 4)] == pytest.approx(first + second, rel=1e-6)
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert [e.step for e in events.Scalars("loss")] == [1, 2, 3, 4]
    assert sorted(os.listdir(tmp_path / "prof")) == ["trace_rank0_steps0-1.json", "trace_rank1_steps0-1.json"]
