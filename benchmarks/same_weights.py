"""Same weights, same batch, several layouts: is a loss gap between layouts a wrong computation or rounding amplified?

    python benchmarks/same_weights.py [--model cp|moe] [--at 14,15] [--steps 20] [--out DIR] [--record-file R.jsonl]

Two models (``SETUPS``):

- ``cp``: tests/test_context_parallel_gpu.py's two-GPU test model (d256 L4, seq 1024, bf16, constant lr 1e-3),
  whose CP=2 runs spiked at step 16 to twice the one-GPU loss; layouts 1 GPU and CP=2 p2p / a2a.
- ``moe``: benchmarks/curves.py's four-GPU MoE model (Mixtral-style d768 L8, 8 experts top-2, its schedule over
  200 steps), whose EP layouts sat 4-6% above one GPU from step 50; layouts 1 GPU, DP=4 (the same batch split
  without EP), EP=2 x DP=2, EP=2 x CP=2, EP=4 and EP=2 x TP=2 SP.

1. Trajectories (``--steps`` > 0): that many steps of every variant from the same seed and data. The one-GPU bf16
   run ("the saver") always runs, up to the last probe iteration, and saves every probe iteration.
2. Probes: from the saver's checkpoint of iteration S (each of ``--at``; 0: from the seed's weights, which every
   layout builds alike, with no checkpoint and, without trajectories, no saver), each variant runs two steps: the first on
   those weights and step S+1's batch, the second on the weights its own update made. Of the first step each rank
   keeps its share of the full gradient (as DeepSpeed is about to apply it, reduced over DP / expert-DP, before
   clipping) and of the update of DeepSpeed's fp32 master weights; the parent assembles them into full tensors and
   compares, per parameter group (dense, router, experts): the gradient's norm and its distance to the fp32
   one-GPU gradient, the update's norm and its distance to the one-GPU bf16 update. Beside them: the loss, the
   auxiliary losses, the tokens each expert got, the norm DeepSpeed clipped with (against the norm of the assembled
   gradient) and the clip coefficient.

If a layout computes the same step, its gradient is as close to the fp32 one as one GPU's bf16 gradient is (one GPU
with micro-batches of 1, which only reorders the sums, shows the spread rounding alone gives), its clip norm is the
norm of its gradient, and its update is as close to one GPU's as that one's is; any later gap in the losses comes
from amplified rounding.

Jobs run side by side where GPUs allow (one GPU each for one-GPU runs), through torchrun with
``CUDA_VISIBLE_DEVICES``. On a machine without GPUs the same runs take gloo ranks (slow; for checking the script).
"""
from __future__ import annotations

import argparse
import glob
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from benchmarks.curves import BATCH_4GPU, COMMON, MODELS_4GPU, ON_GPUS, TINY_BLOCK  # noqa: E402
from benchmarks.runner import free_port, visible_gpus  # noqa: E402

SAVER, REFERENCE = "1 GPU bf16", "1 GPU fp32"  # whose checkpoints every probe starts from; whose gradient is exact
BF16 = ["--bf16"]
EP2, TP2 = ["--expert-model-parallel-size", "2"], ["--tensor-model-parallel-size", "2"]


@dataclass(frozen=True)
class Setup:
    words: str  # the record's label
    model: list[str]  # every run's flags (no precision, no --train-iters)
    variants: dict[str, tuple[int, list[str]]]  # name: (GPUs, flags)
    at: str  # the default --at
    short: dict[str, str] = field(default_factory=dict)  # names in the record's figures


# tests/test_context_parallel_gpu.py's model: tests/oracle.py's TINY at d256, seq 1024, lr 1e-3 (TINY's min-lr, so constant)
_CP_MODEL = ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "4", "--group-query-attention",
             "--num-query-groups", "2", "--ffn-hidden-size", "512", "--seq-length", "1024", "--vocab-size", "512",
             "--normalization", "RMSNorm", "--position-embedding-type", "rope", "--swiglu", "--disable-bias-linear",
             "--hidden-dropout", "0", "--attention-dropout", "0", "--adam-beta2", "0.95", "--weight-decay", "0.1",
             "--lr-decay-style", "cosine", "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "1e-3",
             "--min-lr", "1e-3", "--lr-warmup-iters", "0", "--eval-iters", "10", "--seed", "7", "--log-interval", "1",
             "--deepspeed_config", "ds_configs/zero1.json"]
# benchmarks/curves.py's four-GPU MoE run, its schedule pinned to the curve's 200 steps whatever --train-iters says
_CURVE_ITERS = COMMON.index("--train-iters")
_MOE_MODEL = (COMMON[:_CURVE_ITERS] + COMMON[_CURVE_ITERS + 2:] + TINY_BLOCK + MODELS_4GPU["moe"][0]
              + [f for f in ON_GPUS if f != "--bf16"] + ["--global-batch-size", str(BATCH_4GPU), "--lr-decay-iters", "200"])

SETUPS = {
    "cp": Setup("CP test model (d256 L4, seq 1024, constant lr 1e-3): the same weights and batch on 1 GPU and CP=2, bf16",
                _CP_MODEL, {
                    SAVER: (1, BF16),
                    "1 GPU bf16 mb 1": (1, BF16 + ["--micro-batch-size", "1"]),  # the same sums accumulated in another order
                    REFERENCE: (1, []),
                    "CP2 p2p bf16": (2, BF16 + ["--context-parallel-size", "2", "--cp-comm-type", "p2p"]),
                    "CP2 a2a bf16": (2, BF16 + ["--context-parallel-size", "2", "--cp-comm-type", "a2a"]),
                }, "14,15", {SAVER: "1 GPU", REFERENCE: "fp32", "CP2 p2p bf16": "CP2 p2p", "CP2 a2a bf16": "CP2 a2a",
                             "1 GPU bf16 mb 1": "1 GPU mb 1"}),
    "moe": Setup(f"{MODELS_4GPU['moe'][1]}, curve schedule: the same weights and batch on 1 GPU, DP=4 and the EP layouts, bf16",
                 _MOE_MODEL, {
                     SAVER: (1, BF16),
                     "1 GPU bf16 mb 1": (1, BF16 + ["--micro-batch-size", "1"]),
                     REFERENCE: (1, []),
                     "DP4": (4, BF16),  # the batch split as under EP, experts replicated
                     "EP2 x DP2": (4, BF16 + EP2),
                     "EP2 x CP2": (4, BF16 + EP2 + ["--context-parallel-size", "2", "--cp-comm-type", "p2p"]),
                     "EP4": (4, BF16 + ["--expert-model-parallel-size", "4"]),
                     "EP2 x TP2 SP": (4, BF16 + EP2 + TP2 + ["--sequence-parallel"]),
                 }, "60", {SAVER: "1 GPU", REFERENCE: "fp32", "1 GPU bf16 mb 1": "1 GPU mb 1"}),
}
GROUPS = ("dense", "router", "experts")
# --tiny: the same runs at a size a CPU gets through (checks the script, not the layouts); later flags win
TINY_SHAPE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--num-query-groups", "2",
              "--ffn-hidden-size", "128", "--seq-length", "64"]
TINY_EXPERTS = ["--moe-ffn-hidden-size", "64"]


def group_of(name: str) -> str:
    """The parameter group a full tensor's name belongs to: the routers, the experts' stacked matrices, or the rest."""
    return "router" if ".router." in name else "experts" if ".moe.w" in name else "dense"


@dataclass
class Job:
    name: str
    ranks: int
    argv: list[str]  # after the launcher
    log: str
    needs: list[str] = field(default_factory=list)


def _slots() -> list[str]:
    """The GPUs jobs may take, as CUDA_VISIBLE_DEVICES names them for a child (the ones this process was given), or two
    CPU slots."""
    import torch
    if not torch.cuda.is_available():
        return ["cpu0", "cpu1"]
    return visible_gpus() or [str(i) for i in range(torch.cuda.device_count())]


def run_jobs(jobs: list[Job]) -> dict[str, dict]:
    """Start each job once the jobs it needs are done and enough GPUs are free (a GPU per rank); on CPU two slots,
    of which a job of more ranks than slots takes both. Returns each job's seconds from start to exit and the set-up
    line its log printed ("set-up 21.4 s: imports 6.0, ..."), so a slow run says which of its jobs and phases cost."""
    slots = _slots()
    free, pending, running, done, timing = list(slots), list(jobs), {}, set(), {}
    while pending or running:
        for job in list(pending):
            wanted = min(job.ranks, len(slots)) if slots[0].startswith("cpu") else job.ranks
            if all(n in done for n in job.needs) and len(free) >= wanted:
                mine, free = free[:wanted], free[wanted:]
                env = dict(os.environ, PYTHONUNBUFFERED="1")
                if mine[0].startswith("cpu"):
                    env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
                else:
                    env["CUDA_VISIBLE_DEVICES"] = ",".join(mine)
                head = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(job.ranks), "--master_port", str(free_port())]
                out = open(job.log, "w")
                running[job.name] = (subprocess.Popen(head + job.argv, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT), mine, out,
                                     time.perf_counter())
                pending.remove(job)
        for name, (proc, mine, out, started) in list(running.items()):
            if proc.poll() is not None:
                out.close()
                if proc.returncode:
                    raise SystemExit(f"{name} failed (exit {proc.returncode}); its log: {out.name}")
                timing[name] = {"seconds": round(time.perf_counter() - started, 1), "setup": _setup_line(out.name)}
                free += mine
                done.add(name)
                del running[name]
        time.sleep(0.5)
    return timing


def _setup_line(log: str) -> str | None:
    """What the job's rank 0 said of its start-up (hybridlm.training.setup_clock), if it said it."""
    with open(log, errors="replace") as f:
        said = [line.split("hybridlm: ", 1)[1].strip() for line in f if "hybridlm: set-up " in line]
    return said[0] if said else None


def probe(out: str, flags: list[str]) -> None:
    """In each rank: two steps from the loaded checkpoint. Every rank writes its share of the first step's full
    gradient and fp32 update to ``out``.rank<R>; rank 0 also the step's figures to ``out``."""
    import torch
    import torch.distributed as dist
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_grad

    from hybridlm.config import parse_args
    from hybridlm.model.weights import shard_entry
    from hybridlm.training.moe_metrics import collect_moe_stats
    from hybridlm.training.trainer import build_run, data_iterator, prepare_config, train_step

    cfg, ds = prepare_config(parse_args(flags))
    run = build_run(cfg, ds)
    if dist.get_rank() == 0:
        print(f"hybridlm: {run.setup.line()}", flush=True)
    module, kept = run.engine.module, {}
    take_step = run.engine._take_model_step
    masters = lambda: {name: safe_get_full_fp32_param(p).clone() for name, p in module.named_parameters()}  # noqa: E731

    def keep_gradients_and_update(*args, **kwargs):  # the gradients DeepSpeed is about to apply (reduced, not clipped)
        if kept:
            return take_step(*args, **kwargs)
        kept["grads"] = {name: safe_get_full_grad(p).clone() for name, p in module.named_parameters()}
        before = masters()
        result = take_step(*args, **kwargs)
        kept["update"] = {name: after - before[name] for name, after in masters().items()}
        return result

    run.engine._take_model_step = keep_gradients_and_update
    batches = data_iterator(run)
    loss = train_step(run, batches).item()
    norm, moe = float(run.engine.get_global_grad_norm()), collect_moe_stats(module, cfg, run.ps)
    next_loss = train_step(run, batches).item()
    ps = run.ps
    shares = {what: shard_entry(tensors, module, ps.tp, ps.grad_reduction, ps.ep) for what, tensors in kept.items()}
    torch.save(shares, f"{out}.rank{dist.get_rank()}")
    if dist.get_rank() == 0:
        figures = {"iteration": run.iteration - 2, "loss": loss, "next_loss": next_loss, "clip_norm": norm,
                   "clip_coefficient": min(1.0, cfg.train.clip_grad / (norm + 1e-6)) if cfg.train.clip_grad else 1.0}
        if moe is not None:
            figures.update(aux_loss=moe["aux_loss"], z_loss=moe["z_loss"],
                           tokens_per_expert=[layer["tokens_per_expert"] for layer in moe["layers"].values()])
        with open(out, "w") as f:
            json.dump(figures, f)


def _losses(metrics: str) -> list[float]:
    with open(metrics) as f:
        return [r["loss"] for r in map(json.loads, f) if "loss" in r]


def _assemble(out: str) -> dict:
    """{"grads": full tensors, "update": full tensors} from the ranks' shares of one probe, on a GPU where there is
    one: the comparisons take norms in float64 of every tensor four times, which for the 240M MoE model was about
    ten seconds of one CPU core per probe (the test process runs with OMP_NUM_THREADS=1)."""
    import torch
    from hybridlm.model.weights import assemble_full
    where = "cuda" if torch.cuda.is_available() else "cpu"
    shares = [torch.load(path, weights_only=False) for path in sorted(glob.glob(f"{out}.rank*"))]
    return {what: {name: tensor.to(where) for name, tensor in assemble_full([share[what] for share in shares]).items()}
            for what in shares[0]}


def _by_group(tensors: dict, reference: dict | None = None) -> dict:
    """{group: norm} of ``tensors`` for the groups present, and "all"; with ``reference`` the same of
    |tensors - reference| / |reference|."""
    num, den = {}, {}
    for name, tensor in tensors.items():
        got = tensor.double()
        if reference is not None:
            rows = min(got.shape[0], reference[name].shape[0])  # the vocabulary is padded to a multiple of 128 x TP
            want = reference[name].double()[:rows]
            got = got[:rows] - want
        for group in (group_of(name), "all"):
            num[group] = num.get(group, 0.0) + float(got.norm() ** 2)
            if reference is not None:
                den[group] = den.get(group, 0.0) + float(want.norm() ** 2)
    return {g: math.sqrt(v / max(den[g], 1e-300)) if reference is not None else math.sqrt(v) for g, v in num.items()}


def _tokens_gap(got: list, want: list) -> float:
    """The largest difference in one expert's tokens of one layer, over that expert's count in ``want``."""
    return max(abs(g - w) / max(w, 1.0) for gl, wl in zip(got, want) for g, w in zip(gl, wl))


def compare_probes(work: str, s: int, variants: dict) -> dict:
    """Each variant's figures from iteration ``s``: its step's losses, clip norm and coefficient, tokens per expert
    against one GPU's, and per group its gradient and update norms and their distances to the references."""
    slug = lambda name: os.path.join(work, f"probe_{name.replace(' ', '_')}_{s}.json")  # noqa: E731
    exact, saver = _assemble(slug(REFERENCE))["grads"], _assemble(slug(SAVER))
    with open(slug(SAVER)) as f:
        saver_figures = json.load(f)
    out = {}
    for name in variants:
        with open(slug(name)) as f:
            figures = json.load(f)
        mine = saver if name == SAVER else _assemble(slug(name))
        grad_norms = _by_group(mine["grads"])
        figures.update(grad_norm=grad_norms, full_grad_norm=grad_norms["all"],
                       grad_err_vs_fp32=_by_group(mine["grads"], exact), update_norm=_by_group(mine["update"]))
        if name != REFERENCE:  # the fp32 probe starts without the checkpoint's Adam state: its update is another one
            figures["update_err_vs_1gpu"] = _by_group(mine["update"], saver["update"])
        if "tokens_per_expert" in figures:
            figures["tokens_gap_vs_1gpu"] = _tokens_gap(figures["tokens_per_expert"], saver_figures["tokens_per_expert"])
        out[name] = figures
        del mine
    return out


ROUNDING_ONLY = (SAVER, "1 GPU bf16 mb 1")  # one GPU in bf16: what rounding alone does to the step


def judge(by_variant: dict) -> dict[str, str | None]:
    """Each variant's fault on the same weights, or None: its loss no further from fp32 than twice one GPU's bf16 loss
    is (or 1e-3 relative), its clip norm the norm of its own gradient (to 2e-3), and each group's gradient error to
    fp32 within 1.5x the largest of the rounding-only variants' (one GPU in bf16, with micro-batches of 2 and of 1).
    A wrong scale of one group's gradient (the expert gradients EP times too large, say) or a clip norm summed over
    the wrong ranks fails here on the first step, where a loss curve would need tens of steps to show it."""
    exact, one = by_variant[REFERENCE], by_variant[SAVER]
    floor = {g: max(by_variant[n]["grad_err_vs_fp32"].get(g, 0.0) for n in ROUNDING_ONLY if n in by_variant)
             for g in exact["grad_norm"]}
    faults = {}
    for name, v in by_variant.items():
        fault = None
        if abs(v["loss"] - exact["loss"]) > max(2 * abs(one["loss"] - exact["loss"]), 1e-3 * exact["loss"]):
            fault = f"loss {v['loss']:.4f} on the same weights, fp32 {exact['loss']:.4f}, one GPU {one['loss']:.4f}"
        elif abs(v["clip_norm"] - v["full_grad_norm"]) > 2e-3 * v["full_grad_norm"]:
            fault = f"clipped with norm {v['clip_norm']:.4f} while its gradient's norm is {v['full_grad_norm']:.4f}"
        else:
            worse = [g for g, err in v["grad_err_vs_fp32"].items() if g in floor and err > 1.5 * floor[g] + 1e-6]
            if worse:
                g = worse[0]
                fault = (f"{g} gradient {v['grad_err_vs_fp32'][g]:.1e} from fp32, rounding alone {floor[g]:.1e}")
        faults[name] = fault
    return faults


def run(work: str, at: list[int], steps: int, setup: Setup, variants: dict | None = None) -> dict:
    """The trajectories (``steps`` each; with 0 only the saver, up to max(at)) and the probes from each iteration in
    ``at``; returns {"trajectories": {variant: losses}, "probes": {iteration: {variant: figures}}, "jobs": {job:
    seconds and set-up line}}. ``variants`` (default: the setup's) must hold the saver and the fp32 reference. A probe
    from iteration 0 starts from the seed's weights, which every layout builds alike (``init_parameters``), without a
    checkpoint: with no other iteration and no trajectory, no saver runs."""
    variants = variants or setup.variants
    os.makedirs(work, exist_ok=True)
    ckpt = os.path.join(work, "ckpt")
    pretrain = os.path.join(ROOT, "scripts", "pretrain.py")
    saved = [s for s in at if s > 0]
    saves = ["--save", ckpt, "--save-interval", str(math.gcd(*saved))] if saved else []
    jobs = []
    for name, (ranks, flags) in variants.items():
        if not steps and (name != SAVER or not saved):
            continue
        slug = name.replace(" ", "_")
        extra = saves if name == SAVER else []
        jobs.append(Job(f"trajectory {name}", ranks, [pretrain] + setup.model + flags + extra + [
            "--train-iters", str(max([steps] + at)), "--metrics-file", os.path.join(work, f"traj_{slug}.jsonl")],
            os.path.join(work, f"traj_{slug}.log")))
    for s in at:
        for name, (ranks, flags) in variants.items():
            slug = f"{name.replace(' ', '_')}_{s}"
            # fp32 from a bf16 checkpoint: the weights only (its Adam state is not comparable); same iteration
            load = (["--load", ckpt, "--ckpt-step", str(s)] + (["--no-load-optim"] if name == REFERENCE else [])) if s else []
            jobs.append(Job(f"probe {name} from {s}", ranks, [os.path.abspath(__file__), "--probe", os.path.join(work, f"probe_{slug}.json"),
                                                               "--"] + setup.model + flags + load + ["--train-iters", str(s + 2)],
                            os.path.join(work, f"probe_{slug}.log"), needs=[f"trajectory {SAVER}"] if s else []))
    summary = {"trajectories": {}, "probes": {}, "jobs": run_jobs(jobs)}
    started = time.perf_counter()
    for name in variants:
        if steps or (name == SAVER and saved):
            summary["trajectories"][name] = _losses(os.path.join(work, f"traj_{name.replace(' ', '_')}.jsonl"))
    for s in at:
        summary["probes"][s] = compare_probes(work, s, variants)
        for name, fault in judge(summary["probes"][s]).items():
            summary["probes"][s][name]["fault"] = fault
    summary["jobs"]["comparison"] = {"seconds": round(time.perf_counter() - started, 1), "setup": None}
    return summary


def faults(summary: dict) -> list[str]:
    """'from S, variant: fault' for every probe that failed ``judge``."""
    return [f"from {s}, {name}: {v['fault']}" for s, by in summary["probes"].items() for name, v in by.items() if v.get("fault")]


def _groups(values: dict | None, fmt: str) -> str:
    """Per group present (dense, router, experts), slash-separated."""
    return "/".join(format(values[g], fmt) for g in GROUPS if g in values) if values else "-"


def table(summary: dict) -> str:
    lines = ["Trajectories (loss of each step; the last 10):", ""]
    for name, losses in summary["trajectories"].items():
        lines.append(f"    {name:16s} " + " ".join(f"{x:.3f}" for x in losses[-10:]))
    for s, by_variant in summary["probes"].items():
        moe = any("aux_loss" in v for v in by_variant.values())
        groups = "/".join(g for g in GROUPS if moe or g == "dense")
        lines += ["", f"From the one-GPU bf16 weights of iteration {s}: step {s + 1} on those weights, then step {s + 2} on each "
                  f"variant's own update. Per group ({groups}): the gradient's norm and its error to fp32, the update's norm "
                  f"and its error to one GPU's:", "",
                  f"    {'variant':16s} {'loss':>7s} {'aux':>7s} {'next':>7s} {'clip norm':>9s} {'|grad|':>9s} {'coef':>6s} "
                  f"{'tokens':>6s}  {'grad norm':26s} {'grad err to fp32':26s} {'update norm':26s} {'update err':26s}"]
        for name, v in by_variant.items():
            aux = f"{v['aux_loss']:.4f}" if "aux_loss" in v else "-"
            tokens = f"{100 * v['tokens_gap_vs_1gpu']:.1f}%" if "tokens_gap_vs_1gpu" in v else "-"
            lines.append(f"    {name:16s} {v['loss']:7.4f} {aux:>7s} {v['next_loss']:7.4f} {v['clip_norm']:9.4f} "
                         f"{v['full_grad_norm']:9.4f} {v['clip_coefficient']:6.3f} {tokens:>6s}  {_groups(v['grad_norm'], '.3e'):26s} "
                         f"{_groups(v['grad_err_vs_fp32'], '.1e'):26s} {_groups(v['update_norm'], '.3e'):26s} "
                         f"{_groups(v.get('update_err_vs_1gpu'), '.1e'):26s}")
    wrong = faults(summary)
    lines += ["", "Verdict: " + ("; ".join(wrong) if wrong else "every variant takes one GPU's step, to bf16 rounding (loss, clip "
                                  "norm, each group's gradient against fp32 as close as one GPU's)")]
    return "\n".join(lines)


def figures(summary: dict, setup: Setup) -> dict:
    """The record's figures: per probe iteration each variant's loss on the same weights, gradient error to fp32, clip
    norm against its gradient's norm and update error to one GPU; and the loss each trajectory reached."""
    short = lambda name: setup.short.get(name, name)  # noqa: E731
    out = {}
    for s, by in summary["probes"].items():
        s = int(s)
        out[f"loss {s + 1} on the weights of {s}"] = " / ".join(f"{short(n)} {v['loss']:.4f}" for n, v in by.items())
        out[f"gradient error to fp32 at {s}"] = " / ".join(
            f"{short(n)} {_groups(v['grad_err_vs_fp32'], '.1e')}" for n, v in by.items() if n != REFERENCE)
        out[f"clip norm / gradient norm at {s}"] = " / ".join(f"{short(n)} {v['clip_norm']:.4f}/{v['full_grad_norm']:.4f}"
                                                              for n, v in by.items())
        out[f"update error to 1 GPU at {s}"] = " / ".join(
            f"{short(n)} {_groups(v['update_err_vs_1gpu'], '.1e')}" for n, v in by.items() if n not in (REFERENCE, SAVER))
        out[f"loss {s + 2} after each one's own update from {s}"] = " / ".join(
            f"{short(n)} {v['next_loss']:.4f}" for n, v in by.items() if n != REFERENCE)
    wrong = faults(summary)
    out["verdict"] = "; ".join(wrong) if wrong else "every variant takes one GPU's step"
    for s in sorted({int(s) + 1 for s in summary["probes"]}):
        reached = [f"{short(n)} {v[s - 1]:.3f}" for n, v in summary["trajectories"].items() if len(v) >= s]
        if reached:
            out[f"loss {s} of each trajectory"] = " / ".join(reached)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(SETUPS), default="cp", help="which model and layouts (see the module docstring)")
    parser.add_argument("--at", default=None, help="iterations whose one-GPU checkpoint the probes start from (default: the "
                        "model's: cp 14,15, moe 60; 0: the seed's weights, no checkpoint; '': none)")
    parser.add_argument("--steps", type=int, default=20, help="steps of each trajectory (0: only the saver's, up to the last --at)")
    parser.add_argument("--variants", default=None, help="a comma list of the model's variants (the saver and fp32 always run)")
    parser.add_argument("--out", default=None, help="folder for checkpoints, logs and results (default: a temporary one)")
    parser.add_argument("--tiny", action="store_true", help="the model at d64 L2, seq 64: a quick check of the script on CPU")
    parser.add_argument("--record-file", default=None)
    parser.add_argument("--probe", default=None, help=argparse.SUPPRESS)  # a rank of one probe: where rank 0 writes
    args, rest = parser.parse_known_args()
    if args.probe:
        probe(args.probe, rest[1:] if rest[:1] == ["--"] else rest)
        return 0
    setup = SETUPS[args.model]
    if args.tiny:
        shape = TINY_SHAPE + (TINY_EXPERTS if args.model == "moe" else [])
        setup = replace(setup, model=setup.model + shape, words=setup.words + " (--tiny)")
    variants = setup.variants
    if args.variants:
        wanted = {SAVER, REFERENCE, *args.variants.split(",")}
        unknown = sorted(wanted - set(setup.variants))
        if unknown:
            parser.error(f"--variants: {unknown[0]!r} is not a {args.model} variant ({', '.join(setup.variants)})")
        variants = {name: v for name, v in setup.variants.items() if name in wanted}
    at = [int(s) for s in (setup.at if args.at is None else args.at).split(",") if s]
    work = args.out or tempfile.mkdtemp(prefix="same_weights_")
    started = time.perf_counter()
    summary = run(work, at, args.steps, setup, variants)
    print(f"# same weights, same batch ({time.perf_counter() - started:.0f} s of runs; work folder {work})\n", flush=True)
    print(table(summary), flush=True)
    with open(os.path.join(work, "same_weights.json"), "w") as f:
        json.dump(summary, f, indent=1)
    if args.record_file:
        from benchmarks.records import append, script_record
        wrong = faults(summary)
        verdict = dict(status="failed", error="; ".join(wrong)) if wrong else {}
        append(args.record_file, script_record("python benchmarks/same_weights.py", sys.argv[1:], setup.words, figures(summary, setup),
                                               **verdict))
    return 1 if faults(summary) else 0


if __name__ == "__main__":
    sys.exit(main())
