"""Same weights, same batch, several layouts: is a loss gap between layouts a wrong computation or rounding amplified?

    python benchmarks/same_weights.py [--at 14,15] [--out DIR] [--record-file R.jsonl]

The model and flags are those of tests/test_context_parallel_gpu.py's two-GPU test (d256 L4, seq 1024, bf16,
constant lr 1e-3), whose CP=2 runs spiked at step 16 to twice the one-GPU loss.

1. Trajectories: 20 steps each of one GPU, one GPU with micro-batches of 1 instead of 2 (the same global batch:
   only the order of the gradient sums changes), one GPU in fp32, CP=2 p2p and CP=2 a2a, from the same seed and
   data. The one-GPU bf16 run saves every step.
2. Probes: from the one-GPU bf16 checkpoint of iteration S (each of ``--at``), each variant runs two steps: the
   first on those weights and step S+1's batch (its loss and full gradients are kept), the second on the weights its
   own update made. The fp32 one-GPU probe is the reference each gradient is compared with.

If CP computes the same function, its gradient is as close to the fp32 one as the one-GPU bf16 gradient is, and
any gap in later losses comes from the updates (Adam at a constant 1e-3 with no warm-up amplifies rounding
differences), which the one-GPU runs with two micro-batch sizes show without any parallelism.

Jobs run side by side where GPUs allow (one GPU each for one-GPU runs, two for CP), through torchrun with
``CUDA_VISIBLE_DEVICES``. On a machine without GPUs the same runs take gloo ranks (slow; for checking the script).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# tests/test_context_parallel_gpu.py's model: tests/oracle.py's TINY at d256, seq 1024, lr 1e-3 (TINY's min-lr, so constant)
MODEL = ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "4", "--group-query-attention",
         "--num-query-groups", "2", "--ffn-hidden-size", "512", "--seq-length", "1024", "--vocab-size", "512",
         "--normalization", "RMSNorm", "--position-embedding-type", "rope", "--swiglu", "--disable-bias-linear",
         "--hidden-dropout", "0", "--attention-dropout", "0", "--adam-beta2", "0.95", "--weight-decay", "0.1",
         "--lr-decay-style", "cosine", "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "1e-3",
         "--min-lr", "1e-3", "--lr-warmup-iters", "0", "--eval-iters", "10", "--seed", "7", "--log-interval", "1",
         "--deepspeed_config", "ds_configs/zero1.json"]
BF16 = ["--bf16"]
VARIANTS = {  # name: (GPUs, flags)
    "1 GPU bf16": (1, BF16),
    "1 GPU bf16 mb 1": (1, BF16 + ["--micro-batch-size", "1"]),  # the same sums accumulated in another order
    "1 GPU fp32": (1, []),
    "CP2 p2p bf16": (2, BF16 + ["--context-parallel-size", "2", "--cp-comm-type", "p2p"]),
    "CP2 a2a bf16": (2, BF16 + ["--context-parallel-size", "2", "--cp-comm-type", "a2a"]),
}
REFERENCE = "1 GPU fp32"
SAVER = "1 GPU bf16"  # the run whose checkpoints every probe starts from


@dataclass
class Job:
    name: str
    ranks: int
    argv: list[str]  # after the launcher
    log: str
    needs: list[str] = field(default_factory=list)


def _slots() -> list[str]:
    import torch
    return [str(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else ["cpu0", "cpu1"]


def run_jobs(jobs: list[Job], port: int = 29650) -> None:
    """Start each job once the jobs it needs are done and enough GPUs are free (a GPU per rank); on CPU two slots."""
    free, pending, running, done = _slots(), list(jobs), {}, set()
    while pending or running:
        for job in list(pending):
            if all(n in done for n in job.needs) and len(free) >= job.ranks:
                mine, free = free[:job.ranks], free[job.ranks:]
                env = dict(os.environ, PYTHONUNBUFFERED="1")
                if mine[0].startswith("cpu"):
                    env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
                else:
                    env["CUDA_VISIBLE_DEVICES"] = ",".join(mine)
                port += 1
                head = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(job.ranks), "--master_port", str(port)]
                out = open(job.log, "w")
                running[job.name] = (subprocess.Popen(head + job.argv, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT), mine, out)
                pending.remove(job)
        for name, (proc, mine, out) in list(running.items()):
            if proc.poll() is not None:
                out.close()
                if proc.returncode:
                    raise SystemExit(f"{name} failed (exit {proc.returncode}); its log: {out.name}")
                free += mine
                done.add(name)
                del running[name]
        time.sleep(0.5)


def probe(out: str, flags: list[str]) -> None:
    """In each rank: two steps from the loaded checkpoint; rank 0 saves the losses and the first step's full gradients."""
    import torch
    import torch.distributed as dist
    from deepspeed.utils import safe_get_full_grad

    from hybridlm.config import parse_args
    from hybridlm.model.weights import gather_full_state_dict
    from hybridlm.training.trainer import build_run, data_iterator, prepare_config, train_step

    run = build_run(*prepare_config(parse_args(flags)))
    module, grads = run.engine.module, {}
    take_step = run.engine._take_model_step

    def keep_gradients(*args, **kwargs):  # the gradients DeepSpeed is about to apply (averaged over DP x CP)
        if not grads:
            local = {name: safe_get_full_grad(p) for name, p in module.named_parameters()}
            grads.update(gather_full_state_dict(local, module, run.ps.tp, run.ps.grad_reduction, run.ps.ep))
        return take_step(*args, **kwargs)

    run.engine._take_model_step = keep_gradients
    batches = data_iterator(run)
    losses = [train_step(run, batches).item() for _ in range(2)]
    if dist.get_rank() == 0:
        torch.save({"iteration": run.iteration - 2, "losses": losses, "grads": grads}, out)


def _losses(metrics: str) -> list[float]:
    with open(metrics) as f:
        return [r["loss"] for r in map(json.loads, f) if "loss" in r]


def _compare(grads: dict, reference: dict) -> tuple[float, str, float]:
    """(relative error of all gradients together, the worst parameter, its relative error) against ``reference``."""
    num = den = 0.0
    worst, worst_err = "", 0.0
    for name, want in reference.items():
        got = grads[name].double()
        want = want.double()
        diff, norm = float((got - want).norm() ** 2), float(want.norm() ** 2)
        num, den = num + diff, den + norm
        err = (diff / max(norm, 1e-300)) ** 0.5
        if err > worst_err:
            worst, worst_err = name, err
    return (num / den) ** 0.5, worst, worst_err


def run(work: str, at: list[int], steps: int, variants: dict = VARIANTS, trajectories: bool = True) -> dict:
    """The trajectories (``steps`` each; with ``trajectories`` False only the one-GPU bf16 run that saves, up to
    max(at)) and the probes from each iteration in ``at``; returns {"trajectories": {variant: losses},
    "probes": {iteration: {variant: figures}}}. ``variants`` must hold the one-GPU bf16 and fp32 ones."""
    os.makedirs(work, exist_ok=True)
    ckpt = os.path.join(work, "ckpt")
    pretrain = os.path.join(ROOT, "scripts", "pretrain.py")
    jobs = []
    for name, (ranks, flags) in variants.items():
        if not trajectories and name != SAVER:
            continue
        slug = name.replace(" ", "_")
        extra = ["--save", ckpt, "--save-interval", "1"] if name == SAVER else []
        jobs.append(Job(f"trajectory {name}", ranks, [pretrain] + MODEL + flags + extra + [
            "--train-iters", str(steps if trajectories else max(at)), "--metrics-file", os.path.join(work, f"traj_{slug}.jsonl")],
            os.path.join(work, f"traj_{slug}.log")))
    for s in at:
        for name, (ranks, flags) in variants.items():
            slug = f"{name.replace(' ', '_')}_{s}"
            # fp32 from a bf16 checkpoint: the weights only (its Adam state is not comparable); same iteration
            load = ["--load", ckpt, "--ckpt-step", str(s)] + (["--no-load-optim"] if name == REFERENCE else [])
            jobs.append(Job(f"probe {name} from {s}", ranks, [os.path.abspath(__file__), "--probe", os.path.join(work, f"probe_{slug}.pt"),
                                                               "--"] + MODEL + flags + load + ["--train-iters", str(s + 2)],
                            os.path.join(work, f"probe_{slug}.log"), needs=[f"trajectory {SAVER}"]))
    run_jobs(jobs)
    import torch
    summary = {"trajectories": {}, "probes": {}}
    for name in variants:
        if trajectories or name == SAVER:
            summary["trajectories"][name] = _losses(os.path.join(work, f"traj_{name.replace(' ', '_')}.jsonl"))
    for s in at:
        results = {name: torch.load(os.path.join(work, f"probe_{name.replace(' ', '_')}_{s}.pt"), weights_only=False) for name in variants}
        for name, result in results.items():
            err, worst, worst_err = _compare(result["grads"], results[REFERENCE]["grads"])
            summary["probes"].setdefault(s, {})[name] = {
                "loss": result["losses"][0], "next_loss": result["losses"][1], "grad_rel_err_vs_fp32": err,
                "grad_rel_err_vs_1gpu_bf16": _compare(result["grads"], results[SAVER]["grads"])[0],
                "worst_parameter": worst, "worst_rel_err": worst_err}
    return summary


def table(summary: dict) -> str:
    lines = ["Trajectories (loss of each step; the last 10):", ""]
    for name, losses in summary["trajectories"].items():
        lines.append(f"    {name:18s} " + " ".join(f"{x:.3f}" for x in losses[-10:]))
    for s, by_variant in summary["probes"].items():
        lines += ["", f"From the one-GPU bf16 weights of iteration {s}: step {s + 1} on those weights (its gradient against the fp32 "
                  f"one), then step {s + 2} on each variant's own update:", "",
                  f"    {'variant':18s} {'loss ' + str(s + 1):>10s} {'grad err':>9s} {'vs 1 GPU bf16':>13s}  {'worst parameter':45s} "
                  f"{'loss ' + str(s + 2):>10s}"]
        for name, v in by_variant.items():
            later = "-" if name == REFERENCE else f"{v['next_loss']:.4f}"
            lines.append(f"    {name:18s} {v['loss']:10.4f} {v['grad_rel_err_vs_fp32']:9.2e} {v['grad_rel_err_vs_1gpu_bf16']:13.2e}  "
                         f"{v['worst_parameter'] + ' ' + format(v['worst_rel_err'], '.1e'):45s} {later:>10s}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--at", default="14,15", help="iterations whose one-GPU checkpoint the probes start from ('': none)")
    parser.add_argument("--steps", type=int, default=20, help="steps of each trajectory")
    parser.add_argument("--out", default=None, help="folder for checkpoints, logs and results (default: a temporary one)")
    parser.add_argument("--record-file", default=None)
    parser.add_argument("--probe", default=None, help=argparse.SUPPRESS)  # a rank of one probe: where rank 0 writes
    args, rest = parser.parse_known_args()
    if args.probe:
        probe(args.probe, rest[1:] if rest[:1] == ["--"] else rest)
        return 0
    work = args.out or tempfile.mkdtemp(prefix="same_weights_")
    started = time.perf_counter()
    summary = run(work, [int(s) for s in args.at.split(",") if s], args.steps)
    print(f"# same weights, same batch ({time.perf_counter() - started:.0f} s of runs; work folder {work})\n", flush=True)
    print(table(summary), flush=True)
    with open(os.path.join(work, "same_weights.json"), "w") as f:
        json.dump(summary, f, indent=1)
    if args.record_file:
        from benchmarks.records import append, script_record
        figures = {f"{name} grad err vs fp32 @{s}": f"{v['grad_rel_err_vs_fp32']:.2e}" for s, by in summary["probes"].items()
                   for name, v in by.items() if name != REFERENCE}
        append(args.record_file, script_record("python benchmarks/same_weights.py", sys.argv[1:],
                                               "CP test model (d256 L4, seq 1024), same weights and batch, 1 GPU vs CP=2", figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
