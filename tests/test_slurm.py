"""The sbatch templates against a real Slurm (slurmctld + slurmd + munged on this machine,
started by tests/slurm_cluster.py): tiny-cpu.sbatch trains 2 CPU ranks to the end, and on the way
its exit signal checkpoints, requeues, and the requeued job resumes (one job shows both); the GPU templates pass
``sbatch --test-only`` with their resources shrunk to this machine, and render (DRY_RUN=1)
into a pretrain command line that validates for the layout's world size."""
from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import time

import pytest

from oracle import ROOT
from slurm_cluster import LocalSlurm, unavailable

GPU_TEMPLATES = {"7b.sbatch": "llama2-7b", "13b.sbatch": "llama2-13b", "70b.sbatch": "llama2-70b",
                 "mixtral-8x7b.sbatch": "mixtral-8x7b", "llama3-8b-128k.sbatch": "llama3-8b-128k"}
# A smaller model than the tiny preset, so the jobs spend their time in Slurm, not in training.
SMALL = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --micro-batch-size 2 --log-interval 1"
         " --lr-warmup-iters 2")  # a warm-up of a third of these 6-iteration jobs
# This one-node cluster has 2 CPUs and no GPUs: the command line overrides the templates' #SBATCH
# resource lines (sbatch lets options win over directives); every other directive is checked as written.
SHRINK = ["--nodes=1", "--ntasks-per-node=2", "--cpus-per-task=1", "--gpus-per-node=0"]
VENV = os.path.dirname(os.path.dirname(sys.executable))

needs_slurm = pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))


@pytest.fixture(scope="module")
def slurm():
    with LocalSlurm() as cluster:
        yield cluster


def _submit_tiny(slurm: LocalSlurm, tmp_path, train_iters: int) -> int:
    env = {"RUN_DIR": str(tmp_path / "run"), "TRAIN_ITERS": str(train_iters), "EXTRA_FLAGS": SMALL, "VENV": VENV,
           "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]}
    return slurm.sbatch(f"--output={tmp_path}/job.out", "slurm/tiny-cpu.sbatch", cwd=ROOT, env=env)


def _metrics(tmp_path) -> list[dict]:
    path = tmp_path / "run" / "metrics.jsonl"
    if not path.exists():
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _finished(fields: dict) -> bool:
    return fields["JobState"] in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")


@needs_slurm
@pytest.mark.slow
def test_tiny_cpu_sbatch_trains_two_ranks_and_on_the_exit_signal_checkpoints_requeues_and_resumes_to_the_end(slurm, tmp_path):
    # One job for both: the template's two ranks train to the last iteration (which the requeued run reaches), and the
    # exit signal on the way saves, requeues and resumes (a job of its own for the first alone cost ~12 s more).
    # The signal must land while training runs: 40 iterations took 1.5 s on an idle 2-core machine, and a signal sent
    # at the second logged step saved at step 13 of them under load (the other pytest-xdist worker's jobs). Sent at
    # the first, with 80 to train, it lands with six times that margin (150 cost the suite 10-20 s more on 2 cores).
    total = 80
    job = _submit_tiny(slurm, tmp_path, train_iters=total)
    deadline = time.monotonic() + 180
    while not _metrics(tmp_path):  # training (and so the handler) is running
        assert time.monotonic() < deadline and not _finished(slurm.job(job)), (tmp_path / "job.out").read_text()[-3000:]
        time.sleep(0.2)
    slurm.run("scancel", "--signal=USR1", str(job))  # to every task of the job's steps, as #SBATCH --signal does
    pending = slurm.wait_until(job, lambda f: f["Restarts"] == "1" and f["JobState"] == "PENDING" or _finished(f), 120,
                               "the requeue")
    assert pending["JobState"] == "PENDING", (tmp_path / "job.out").read_text()[-3000:]
    # Slurm holds a requeued job back ~2 minutes (Reason=BeginTime); let it start sooner. Not at
    # once: slurmd refuses a credential issued in the same second as the requeue revoked the old one.
    time.sleep(2)
    slurm.run("scontrol", "update", f"JobId={job}", "StartTime=now")
    fields = slurm.wait_until(job, _finished, 240, "the requeued job to finish")
    log = (tmp_path / "job.out").read_text()
    assert (fields["JobState"], fields["ExitCode"], fields["Restarts"]) == ("COMPLETED", "0:0", "1"), log[-3000:]
    saved = int(re.search(r"SIGUSR1 received: saved global_step(\d+)", log).group(1))
    assert saved < total and f"requeueing job {job}" in log and "(restart 1)" in log
    assert (tmp_path / "run" / f"global_step{saved}").is_dir()
    assert log.count("DP=2") == 2  # two ranks, one per Slurm task, in the first run and the requeued one
    # One metrics file over both runs: the first logged 1..saved, the requeued one saved+1..total.
    records = _metrics(tmp_path)
    assert [r["iteration"] for r in records] == list(range(1, total + 1))
    assert all(r["loss"] > 0 for r in records) and records[-1]["loss"] < records[0]["loss"]
    assert (tmp_path / "run" / "latest").read_text() == f"global_step{total}"


@needs_slurm
@pytest.mark.parametrize("template", sorted(GPU_TEMPLATES))
def test_gpu_templates_pass_sbatch_test_only_with_resources_shrunk(slurm, template):
    result = slurm.run("sbatch", "--test-only", *SHRINK, f"slurm/{template}", cwd=ROOT, check=False)
    assert result.returncode == 0, result.stderr
    assert "to start at" in result.stderr


@needs_slurm
def test_test_only_refuses_the_unshrunk_gpu_request_on_this_cluster(slurm):
    """The check above can fail: as written, the GPU request does not fit this GPU-less cluster."""
    result = slurm.run("sbatch", "--test-only", "slurm/70b.sbatch", cwd=ROOT, check=False)
    assert result.returncode != 0 and "gres" in result.stderr.lower()


def _sbatch_resources(path: str) -> dict[str, str]:
    with open(path) as f:
        return dict(m.groups() for line in f if (m := re.match(r"#SBATCH --([\w-]+)=(\S+)", line)))


def _render(template: str, tmp_path) -> list[str]:
    env = {**os.environ, "DRY_RUN": "1", "HYBRIDLM_DIR": ROOT, "VENV": VENV, "RUN_DIR": str(tmp_path / "run"),
           "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]}
    env.pop("SLURM_JOB_ID", None)
    result = subprocess.run(["bash", os.path.join(ROOT, "slurm", template)], env=env, capture_output=True, text=True,
                            timeout=60, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    command = shlex.split(result.stdout.strip().splitlines()[-1])
    assert command[0] == "srun" and "scripts/pretrain.py" in command, result.stdout
    return command


@pytest.mark.parametrize("template, preset", sorted(GPU_TEMPLATES.items()) + [("tiny-cpu.sbatch", "tiny")])
def test_templates_render_into_a_pretrain_command_that_validates_for_their_allocation(template, preset, tmp_path):
    from hybridlm.config import parse_args
    from hybridlm.presets import layout
    from hybridlm.training.ds_config import ds_config_of

    command = _render(template, tmp_path)
    assert not [word for word in command if "$" in word], "an unexpanded variable"
    args = command[command.index("scripts/pretrain.py") + 1:]
    run_dir = str(tmp_path / "run")
    assert args[args.index("--save") + 1] == args[args.index("--load") + 1] == run_dir  # resumes automatically
    assert "--exit-signal-handler" in args
    assert args[args.index("--model") + 1] == preset
    # The #SBATCH resources are the layout's, and the flags validate for that world size.
    lay = layout(preset)
    resources = _sbatch_resources(os.path.join(ROOT, "slurm", template))
    assert (int(resources["nodes"]), int(resources["ntasks-per-node"])) == (lay.nodes, lay.gpus_per_node)
    if preset != "tiny":
        assert int(resources["gpus-per-node"]) == lay.gpus_per_node  # one task per GPU
    cfg = parse_args(args)
    ds_config_of(cfg)  # a relative --deepspeed_config is found in the source tree, from any working directory
    cfg.validate(lay.world_size)
    p = cfg.parallel
    assert (p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.zero_stage) == (lay.tp, lay.pp, lay.zero)
    assert p.context_parallel_size == lay.cp
    assert cfg.train.bf16 == lay.bf16 and cfg.model.model == preset
    assert cfg.model.torch_compile == lay.torch_compile


def test_a_layout_override_in_the_template_block_replaces_the_preset_layout(tmp_path, monkeypatch):
    monkeypatch.setenv("LAYOUT_FLAGS", "--tensor-model-parallel-size 4 --pipeline-model-parallel-size 2 --bf16")
    args = _render("70b.sbatch", tmp_path)
    assert "--tensor-model-parallel-size 4 --pipeline-model-parallel-size 2" in " ".join(args)
    assert "--tensor-model-parallel-size 8" not in " ".join(args)
