"""The runner: every run of the chosen cases in one call, one record each, a short table last.

For each case, hybridlm's run first, then each peer's, each in its own process (a fresh
allocator, compile cache and process group per run) with the case's time limit. A run that
fails still leaves a record (status ``failed`` and the error's last line). Everything a call
writes goes under ``--out`` (on the GPU machine ``$OUT``, which brings back at most 8 files):
``records.jsonl`` (one line per run), ``logs.tar.gz`` (each run's log, profile summaries) and
``table.md`` (the table printed last).

``--budget-s`` fits a call into the device tool's 10-minute commands: a run whose case expects
more time than is left is not started, and the call ends by printing the ``--cases``/``--systems``
command that runs what was left.
"""
from __future__ import annotations

import datetime
import glob
import importlib.util
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass, field
from typing import Optional

from . import megatron
from .cases import ONE_GPU_PEERS, Case
from .records import append, read

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NEEDS = {"te": "transformer_engine", "fa": "flash_attn.cute", "bnb": "bitsandbytes", "peft": "peft", "trl": "trl"}
STAGED_BY = {"bnb": "benchmarks/stage_qlora.sh", "peft": "benchmarks/stage_qlora.sh", "trl": "benchmarks/stage_trl.sh"}


def current_commit() -> str:
    """This checkout's commit (``-dirty`` with uncommitted changes). On the GPU machine the tree may come
    without .git, or with a .git of an older commit than the tree it carries: there the device command
    sets HYBRIDLM_COMMIT from the .device/COMMIT that benchmarks/stage.sh wrote."""
    if os.environ.get("HYBRIDLM_COMMIT"):
        return os.environ["HYBRIDLM_COMMIT"]
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        path = os.path.join(ROOT, ".device", "COMMIT")
        return open(path).read().strip() if os.path.exists(path) else "unknown"


def device_count() -> int:
    import torch
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def gpu_names() -> list[str]:
    """Each GPU's name through nvidia-smi (empty without one), so the caller holds no CUDA context beside its runs."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True,
                             check=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in out.splitlines() if line.strip()]


def device_label_of(gpus: int) -> str:
    """"4x H200" for ``gpus`` of this machine's GPUs; "CPU (N cores)" for none."""
    if gpus == 0:
        return f"CPU ({os.cpu_count()} cores)"
    from hybridlm.training.benchmark import device_label
    names = gpu_names()
    return f"{gpus}x {device_label(names[0]) if names else 'GPU'}"


def device_of(case: Case) -> str:
    """"1x H200": the case's GPU count and this machine's GPU name."""
    return device_label_of(case.gpus)


def missing(case: Case, gpus: int) -> Optional[str]:
    """Why this machine cannot run the case (None when it can)."""
    if case.gpus > gpus:
        return f"needs {case.gpus} GPU{'s' if case.gpus > 1 else ''}, this machine has {gpus}"
    for need in case.needs:
        try:
            found = importlib.util.find_spec(NEEDS[need]) is not None
        except ModuleNotFoundError:
            found = False
        if not found:
            return f"needs {NEEDS[need]} (stage its bundle: {STAGED_BY.get(need, 'benchmarks/stage.sh')})"
    return None


@dataclass
class Call:
    """One invocation of the runner: where it writes, what it is called, and its clock."""

    out: str
    profile: bool = False
    budget_s: Optional[float] = None
    megatron_src: Optional[str] = None
    started: float = field(default_factory=time.monotonic)
    id: str = ""
    commit: str = ""
    not_run: list = field(default_factory=list)  # (case, system, why)

    def __post_init__(self):
        os.makedirs(os.path.join(self.out, "logs"), exist_ok=True)
        stamp = datetime.datetime.now().strftime("%Y-%m-%dT%H%M%S")
        self.id = self.id or f"{stamp}-{socket.gethostname().split('.')[0]}"
        self.commit = self.commit or current_commit()

    def left_s(self) -> Optional[float]:
        return None if self.budget_s is None else self.budget_s - (time.monotonic() - self.started)


def free_port() -> int:
    """A rendezvous port the kernel picked free just now. Not a fixed one counted up from 29500: two calls at once
    (the GPU suite's two lanes) both took 29501, and the second launcher refused it."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# What a launch prints when another process took its port between free_port() and its bind: torch's and the OS's words,
# and hybridlm's own sentence, all a pretrain rank says (hybridlm.training.distributed turns the bind error into it).
PORT_TAKEN = ("EADDRINUSE", "Address already in use", "is taken by another process")


def port_was_taken(output: str) -> bool:
    return any(s in output for s in PORT_TAKEN)


def visible_gpus() -> Optional[list[str]]:
    """The GPUs this process was given by number (CUDA_VISIBLE_DEVICES, e.g. a lane of the GPU suite), else None."""
    visible = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    return visible if visible and all(d.isdigit() for d in visible) and os.environ.get("DS_ACCELERATOR") != "cpu" else None


def gpu_choice(gpus: int, only: Optional[int] = None) -> list[str]:
    """DeepSpeed launcher flags for ``gpus`` ranks, or one rank on the ``only``-th GPU. Beside --num_gpus the launcher
    ignores CUDA_VISIBLE_DEVICES and numbers the machine's GPUs from 0, so where this process was given some GPUs
    they are named (--include): a job stays on the GPUs it was given."""
    visible = visible_gpus()
    if visible is None:
        return ["--include", f"localhost:{only}"] if only is not None else ["--num_gpus", str(gpus)]
    chosen = [visible[only]] if only is not None else visible[:gpus]
    if len(chosen) < (1 if only is not None else gpus):
        raise SystemExit(f"error: {gpus} GPUs wanted, CUDA_VISIBLE_DEVICES={os.environ['CUDA_VISIBLE_DEVICES']} gives {len(visible)}")
    return ["--include", "localhost:" + ",".join(chosen)]


def launcher(gpus: int, port: int, only: Optional[int] = None) -> list[str]:
    """The deepspeed launcher for ``gpus`` ranks (on a CPU machine, gloo ranks); ``only``: one rank on that GPU."""
    deepspeed = shutil.which("deepspeed")
    head = [deepspeed] if deepspeed else [sys.executable, "-m", "deepspeed.launcher.runner"]
    return head + gpu_choice(gpus, only) + ["--master_port", str(port)]


def hybridlm_command(case: Case, system: str, record_file: str, call: Call, profile_dir: Optional[str]) -> list[str]:
    if case.script:  # the script's own options go before a "--" that hands the rest to pretrain
        argv, at = list(case.script), (case.script.index("--") if "--" in case.script else len(case.script))
        argv[at:at] = ["--record-file", record_file] + (["--megatron", call.megatron_src]
                                                         if "megatron-lm" in case.peers and call.megatron_src else [])
        head = launcher(case.ranks, free_port()) if case.launcher == "deepspeed" else [sys.executable]
        return head + argv
    flags = list(case.flags)
    if profile_dir:
        total = case.warmup + case.steps
        flags += ["--profile-step-range", f"{total - 2},{total}", "--profile-dir", profile_dir]
    return launcher(case.ranks, free_port()) + [
        "scripts/benchmark.py", "--model", case.model, "--steps", str(case.steps), "--warmup", str(case.warmup),
        "--label", case.label, "--system", system, "--record-file", record_file, "--"] + flags


def run_config(case: Case):
    """hybridlm's configuration of a case, validated for its ranks (what the Megatron peer mirrors)."""
    from hybridlm.config import parse_args
    return parse_args(["--model", case.model] + list(case.flags)).validate(case.ranks)


def megatron_command(case: Case, call: Call) -> list[str]:
    args = megatron.megatron_args(run_config(case), iters=case.warmup + case.steps)
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(case.ranks),
            "--master_port", str(free_port()), "-m", "benchmarks.megatron", call.megatron_src, "--"] + args


def shown(argv: list[str]) -> str:
    """A run's command as a user would type it: python, deepspeed and torchrun by name, no port or record file."""
    words, i = [], 0
    while i < len(argv):
        if argv[i:i + 3] in ([sys.executable, "-m", "torch.distributed.run"], [sys.executable, "-m", "deepspeed.launcher.runner"]):
            words.append("torchrun" if argv[i + 2].startswith("torch") else "deepspeed")
            i += 3
        elif argv[i] in ("--master_port", "--record-file"):
            i += 2
        else:
            words.append("python" if argv[i] == sys.executable else "deepspeed" if os.path.basename(argv[i]) == "deepspeed" else argv[i])
            i += 1
    return shlex.join(words)


def execute(argv: list[str], log_path: str, timeout_s: float, env: dict) -> tuple[int, str]:
    """Run in its own process group (killed whole on timeout); (exit code, last lines of its log)."""
    with open(log_path, "w") as log:
        log.write("$ " + shlex.join(argv) + "\n")
        log.flush()
        proc = subprocess.Popen(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            code = 124
    with open(log_path, errors="replace") as f:
        return code, f.read()


def error_line(code: int, log: str) -> str:
    """The last line of a failed run's log that says what went wrong."""
    if code == 124:
        return "timed out"
    killed = re.search(r"exits with return code = -(\d+)", log)  # the deepspeed launcher's words for a rank a signal ended
    if killed:
        name = signal.Signals(int(killed.group(1))).name if int(killed.group(1)) in signal.valid_signals() else f"signal {killed.group(1)}"
        why = ": most often the host's memory ran out" if name == "SIGKILL" else ""
        return f"a rank was killed ({name}, no Python error{why}) (exit {code})"
    keys = ("Error", "error:", "out of memory", "Traceback")
    lines = [ln.strip() for ln in log.splitlines() if any(k in ln for k in keys)]
    return (lines[-1] if lines else (log.strip().splitlines() or ["no output"])[-1])[:300] + f" (exit {code})"


def _env(system: str) -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("OMP_NUM_THREADS", "8")
    if system == "megatron-lm":
        env["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"  # Megatron's requirement for overlapping TP communication
    return env


def run_one(case: Case, system: str, call: Call) -> list[dict]:
    """One run: its records (already carrying the call's fields), or one record saying why it failed."""
    stem = f"{case.name}.{system}"
    log_path = os.path.join(call.out, "logs", f"{stem}.log")
    record_file = os.path.join(call.out, "logs", f"{stem}.records.jsonl")
    profile_dir = os.path.join(call.out, "logs", f"{stem}.profile") if call.profile and system == "hybridlm" else None
    timeout = case.timeout_s if call.left_s() is None else max(1.0, min(case.timeout_s, call.left_s()))
    common = {"call": call.id, "suite": case.suite, "case": case.name, "system": system, "commit": call.commit,
              "device": device_of(case), "label": case.label}
    megatron_run = system == "megatron-lm" and not case.script

    def command() -> list[str]:  # on a port of its own, picked just now
        return megatron_command(case, call) if megatron_run else hybridlm_command(case, system, record_file, call, profile_dir)

    argv = command()
    if megatron_run:
        try:
            megatron.build_helpers(call.megatron_src)
        except (ImportError, OSError, subprocess.CalledProcessError) as e:
            return [{**common, "status": "failed", "error": f"building Megatron-LM's dataset helper: {e}", "command": shown(argv),
                     "date": datetime.date.today().isoformat()}]
    started = time.monotonic()
    for attempt in range(3):  # again on a fresh port where another process took this one before the launch bound it
        if attempt:
            argv = command()
        code, log = execute(argv, log_path, timeout, _env(system))
        if code == 0 or not port_was_taken(log) or (os.path.exists(record_file) and os.path.getsize(record_file)):
            break  # (a run that recorded something got past its rendezvous: its failure is its own)
    now = datetime.datetime.now()
    common.update(date=now.date().isoformat(), time=now.isoformat(timespec="seconds"), wall_s=round(time.monotonic() - started, 1))
    failed = {**common, "status": "failed", "error": error_line(code, log), "command": shown(argv),
              "model": case.model, "model_args": ["--model", case.model] + list(case.flags)}
    produced = read(record_file) if os.path.exists(record_file) else []
    identity = {k: common[k] for k in ("call", "suite", "case", "commit", "device")}
    records = [{**common, "status": "ok", **r, **identity} for r in produced]  # a script's own system, label, status win
    if code != 0:
        return records + [failed]  # what a script recorded before it failed (e.g. the layouts of a curve case) stays
    if megatron_run:
        return [_megatron_record(case, call, common, argv, log, failed)]
    if not produced:
        return [{**failed, "error": f"the run wrote no record (exit {code})"}]
    if profile_dir:
        summaries = sorted(glob.glob(os.path.join(profile_dir, "*_summary.txt")))
        for trace in glob.glob(os.path.join(profile_dir, "trace_rank*.json")):
            os.remove(trace)  # hundreds of MB; the summary says what the README and PROFILES.md use
        if summaries:
            records[-1]["profile"] = open(summaries[0]).read()
            records[-1]["profiled"] = "the last two timed steps ran under the profiler (slower)"
    return records


def _megatron_record(case: Case, call: Call, common: dict, argv: list[str], log: str, failed: dict) -> dict:
    run = run_config(case)
    tokens = run.train.global_batch_size * run.model.seq_length
    try:
        figures = megatron.parse_log(log, tokens_per_iteration=tokens, world=case.ranks, warmup=case.warmup)
    except ValueError as e:
        return {**failed, "error": str(e)}
    from hybridlm.training.metrics import flops_per_token
    per_token = flops_per_token(run.model)  # the same rule as hybridlm's rows, on the same model
    peak = figures.pop("peak_tflops")
    tflops = figures["tokens_per_sec_per_gpu"] * per_token / 1e12
    commit_file = os.path.join(os.path.dirname(megatron.TARBALL), "COMMIT")
    return {**common, **figures, "status": "ok", "model": case.model, "model_args": ["--model", case.model] + list(case.flags),
            "tflops_per_gpu": tflops, "mfu": tflops / peak if peak else None, "peak_tflops": peak, "flops_per_token": per_token,
            "steps": case.steps, "warmup": case.warmup, "command": shown(argv),
            "megatron_commit": open(commit_file).read().strip() if os.path.exists(commit_file) else None}


def plan(cases: list[Case], systems: Optional[set[str]], call: Call) -> list[tuple[Case, str]]:
    """The runs to make, in order: each case's hybridlm and Megatron-LM runs first, case by case, then
    the other peers (so a call cut short by its budget keeps the comparison users ask about first);
    cases this machine cannot run go to ``call.not_run``."""
    gpus = device_count()
    runs = []
    for case in cases:
        why = missing(case, gpus)
        for system in ("hybridlm",) + case.peers:
            if systems and system not in systems:
                continue
            if case.script and system != "hybridlm":
                continue  # a script times its peers itself
            reason = why
            if system == "megatron-lm" and not call.megatron_src:
                reason = reason or "no Megatron-LM source (stage it: benchmarks/stage.sh, or --megatron DIR)"
            if system in ONE_GPU_PEERS and case.gpus != 1:
                reason = reason or f"{system} runs on one GPU"
            if reason:
                call.not_run.append((case.name, system, reason))
            else:
                runs.append((case, system))
    return sorted(runs, key=lambda run: run[1] not in ("hybridlm", "megatron-lm"))  # stable: case order kept


def run(cases: list[Case], call: Call, systems: Optional[set[str]] = None) -> list[dict]:
    """Every run of ``cases`` (or of ``systems`` among them); their records, also in ``call.out``."""
    if any("megatron-lm" in c.peers for c in cases):
        call.megatron_src = megatron.source_dir(call.megatron_src)
    records = []
    for case, system in plan(cases, systems, call):
        left = call.left_s()
        if left is not None and left < case.expected_s:
            call.not_run.append((case.name, system, f"the call's budget: {max(left, 0):.0f} s left, the case expects {case.expected_s} s"))
            continue
        print(f"[{case.name} / {system}] ...", flush=True)
        for record in run_one(case, system, call):
            append(os.path.join(call.out, "records.jsonl"), record)
            records.append(record)
    finish(call, records)
    return records


def finish(call: Call, records: list[dict]) -> None:
    """Pack the logs, then print (and keep) the table and what was not run."""
    logs = os.path.join(call.out, "logs")
    with tarfile.open(os.path.join(call.out, "logs.tar.gz"), "w:gz") as tar:
        tar.add(logs, arcname="logs")
    shutil.rmtree(logs)
    lines = table(records)
    if call.not_run:
        lines += ["", "not run:"] + [f"  {case} / {system}: {why}" for case, system, why in call.not_run]
        left = [(case, system) for case, system, why in call.not_run if why.startswith("the call's budget")]
        if left:  # hybridlm again beside peers left over, so their ratios come from one call
            cases = ",".join(dict.fromkeys(case for case, _ in left))
            systems = ",".join(dict.fromkeys(["hybridlm"] + [system for _, system in left]))
            lines.append(f"  the rest: python -m benchmarks run --cases {cases} --systems {systems} --out $OUT")
    with open(os.path.join(call.out, "table.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)


def table(records: list[dict]) -> list[str]:
    """The short table: a row per run, the ratio hybridlm / peer beside each peer of the same case."""
    head = f"{'case':<18} {'system':<14} {'tok/s/GPU':>11} {'MFU':>6} {'peak GiB':>8} {'hybridlm/peer':>13}  status"
    lines = [head, "-" * len(head)]
    ours = {r["case"]: r for r in records if r["system"] == "hybridlm" and r.get("status") == "ok"}
    for r in records:
        tps, mfu, peak = r.get("tokens_per_sec_per_gpu"), r.get("mfu"), r.get("peak_memory_gib")
        base = ours.get(r["case"])
        ratio = (f"{base['tokens_per_sec_per_gpu'] / tps:.2f}x" if r["system"] != "hybridlm" and base and tps
                 and base.get("tokens_per_sec_per_gpu") else "")
        status = r.get("status", "ok") if r.get("status") == "ok" else f"failed: {r.get('error', '')[:80]}"
        figures = "; ".join(f"{k} {v}" for k, v in (r.get("figures") or {}).items())
        lines.append(f"{r['case']:<18} {r['system']:<14} {f'{tps:,.0f}' if tps else '':>11} "
                     f"{f'{100 * mfu:.1f}%' if mfu else '':>6} {f'{peak:.1f}' if peak else '':>8} {ratio:>13}  {status}"
                     + (f"  {r.get('label', '')}: {figures}" if figures else ""))
    return lines
