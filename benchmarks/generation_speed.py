"""Decoding speed of hybridlm's generator (the one GRPO's rollouts and scripts/generate.py use) beside
transformers' ``generate`` at its best (static cache + ``torch.compile(mode="reduce-overhead")``) and as TRL
calls it (dynamic cache, eager), on the same model and prompts, greedy.

    python3 benchmarks/generation_speed.py --out $OUT [--batches 1,64] [--new-tokens 512] [--fp32-tokens 128] [--only hybridlm,hf-compiled,hf]
    python3 benchmarks/generation_speed.py --out /tmp/x --tiny         (smoke test on a CPU)
    python3 benchmarks/generation_speed.py --out $OUT --profile        (where a decode step's time goes, hybridlm only)

The model is benchmarks/grpo_throughput.py's Qwen2-0.5B shape (24 layers, hidden 896, 14 heads / 2 KV heads,
vocabulary 151936) with random bf16 weights. Each batch row is a prompt of 32-96 random token ids (a fixed
seed); every row decodes ``--new-tokens`` tokens (no stop token). A decode step's time is
(time of N new tokens - time of 1 new token) / (N - 1): the prompt's prefill and the set-up cancel out.
(The compiled peer's step is its whole call / N: a 1-token call would compile again.)
Greedy outputs of each framework are compared row by row with hybridlm's: with random bf16 weights many
logits nearly tie, so rows may part where two kernels round differently; the table gives how many rows
agree to the end and the mean share of tokens agreeing before the first difference. Whether the two
decoders compute the same function is the fp32 check: the same weights in fp32 (no TF32), the largest batch,
``--fp32-tokens`` new tokens greedy, hybridlm's rows against transformers' eager ``generate`` row by row.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT]

from benchmarks import stages  # noqa: E402
from benchmarks.records import script_record  # noqa: E402

STAGES = ("hybridlm", "hf-compiled", "hf")


def shape(tiny: bool) -> dict:
    from benchmarks.grpo_throughput import SHAPES
    return SHAPES["tiny" if tiny else "qwen2-0.5b"]


def prepare(args) -> dict:
    """The HF model directory and its import (made once per work directory)."""
    import torch
    import transformers
    from hybridlm.interop.import_ import import_from_hf
    paths = {k: os.path.join(args.workdir, k) for k in ("hf", "ckpt")}
    if os.path.isfile(os.path.join(args.workdir, "ready")):
        return paths
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**shape(args.tiny))).to(torch.float32 if args.tiny else torch.bfloat16)
    model.save_pretrained(paths["hf"])
    del model
    import_from_hf(paths["hf"], paths["ckpt"], progress=False, log=lambda line: None)
    open(os.path.join(args.workdir, "ready"), "w").close()
    return paths


def prompts_of(batch: int, vocab: int) -> list[list[int]]:
    rng = random.Random(batch)
    return [[rng.randrange(10, vocab) for _ in range(rng.randint(32, 96))] for _ in range(batch)]


def timed(call, repeats: int) -> tuple[float, object]:
    """The median time of ``repeats`` calls after one warm-up call, and the last call's result."""
    result = call()
    times = []
    for _ in range(repeats):
        start = stages.synchronized_now()
        result = call()
        times.append(stages.synchronized_now() - start)
    return statistics.median(times), result


def measure(generate, args, prefill: bool = True) -> dict:
    """Per batch size: tokens/s of a whole call, the decode step's ms, the greedy rows. Without ``prefill``
    (a compiled peer, for which a 1-token call is another compilation) the step is the whole call / N."""
    out = {}
    for batch in args.batch_sizes:
        prompts = prompts_of(batch, shape(args.tiny)["vocab_size"])
        one = timed(lambda: generate(prompts, 1), args.repeats)[0] if prefill else 0.0
        whole, rows = timed(lambda: generate(prompts, args.new_tokens), args.repeats)
        out[str(batch)] = {"tokens_per_sec": batch * args.new_tokens / whole, "seconds": whole,
                           "decode_step_ms": 1e3 * (whole - one) / (args.new_tokens - (1 if prefill else 0)),
                           "prefill_s": one if prefill else None, "rows": rows}
    return out


def fp32_rows(generate, args) -> list:
    """The greedy rows of the largest batch in fp32 (``generate`` of a model loaded in fp32): the equality check."""
    return generate(prompts_of(max(args.batch_sizes), shape(args.tiny)["vocab_size"]), args.fp32_tokens)


def stage_hybridlm(args, paths: dict) -> dict:
    import torch
    from hybridlm.interop.generate import load_for_generation
    from hybridlm.parallel.state import SINGLE
    device = "cuda" if torch.cuda.is_available() else "cpu"
    generator, _, _ = load_for_generation(paths["ckpt"], SINGLE, device)
    if args.profile:
        return {"profile": profile(generator, args)}
    out = measure(lambda prompts, n: generator.generate_batch(prompts, n).tokens, args)
    del generator
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    exact, _, _ = load_for_generation(paths["ckpt"], SINGLE, device, torch.float32)
    return {**out, "fp32": fp32_rows(lambda prompts, n: exact.generate_batch(prompts, n).tokens, args)}


def profile(generator, args) -> str:
    """A decode step under torch.profiler: the kernels by GPU time, and the host's share."""
    import torch
    from torch.profiler import ProfilerActivity
    prompts = prompts_of(max(args.batch_sizes), shape(args.tiny)["vocab_size"])
    steps = 32
    generator.generate_batch(prompts, steps)
    start = stages.synchronized_now()
    generator.generate_batch(prompts, steps)
    wall = stages.synchronized_now() - start
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with torch.profiler.profile(activities=activities) as prof:
        generator.generate_batch(prompts, steps)
        stages.synchronized_now()
    events = prof.key_averages()
    kernels = [e for e in events if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA]
    gpu_us = sum(e.self_device_time_total for e in kernels)
    launches = sum(e.count for e in kernels)
    head = (f"batch {max(args.batch_sizes)}, {steps} new tokens: wall {wall * 1e3 / steps:.2f} ms/token unprofiled, "
            f"GPU busy {gpu_us / 1e3 / steps:.2f} ms/token, {launches / steps:.0f} kernels/token")
    table = events.table(sort_by="self_cuda_time_total" if kernels else "self_cpu_time_total", row_limit=30, max_name_column_width=70)
    return head + "\n" + table


def hf_generate(paths: dict, dtype, compiled: bool = False):
    """transformers' greedy ``generate(prompts, n)`` on the HF model in ``dtype`` (left-padded rows, an attention mask)."""
    import torch
    import transformers
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = transformers.AutoModelForCausalLM.from_pretrained(paths["hf"], dtype=dtype, attn_implementation="sdpa").to(device).eval()
    if compiled:  # transformers' own recipe: with a static cache, generate compiles the decode step (reduce-overhead)
        model.generation_config.cache_implementation = "static"

    @torch.no_grad()
    def generate(prompts, n):
        width = max(map(len, prompts))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
        out = model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
        return out[:, width:].tolist()
    return generate


def stage_hf(args, paths: dict, compiled: bool) -> dict:
    import torch
    out = measure(hf_generate(paths, torch.float32 if args.tiny else torch.bfloat16, compiled), args, prefill=not compiled)
    if compiled:
        return out
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return {**out, "fp32": fp32_rows(hf_generate(paths, torch.float32), args)}


def agreement(ours: list, theirs: list) -> tuple[int, float]:
    """(rows equal to the end, mean share of tokens before the first difference)."""
    shares = []
    for a, b in zip(ours, theirs):
        first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        shares.append(first / max(len(a), 1))
    return sum(s == 1.0 for s in shares), statistics.mean(shares)


def by_batch(result: dict | None) -> dict:
    """A stage's figures per batch size (its result without the fp32 check's rows)."""
    return {batch: r for batch, r in (result or {}).items() if batch != "fp32"}


def fp32_agreement(results: dict) -> tuple[int, int] | None:
    """(rows of hybridlm's fp32 decode equal to transformers' to the end, rows), when both stages ran the check."""
    ours, theirs = ((results.get(stage) or {}).get("fp32") for stage in ("hybridlm", "hf"))
    return None if ours is None or theirs is None else (agreement(ours, theirs)[0], len(ours))


def table(results: dict, args) -> str:
    import torch
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    out = [f"Greedy decoding, {'tiny fp32' if args.tiny else 'Qwen2-0.5B shape bf16'}, {args.new_tokens} new tokens, {device}, "
           f"{time.strftime('%Y-%m-%d')}",
           "| run | batch | tokens/s | decode step ms | prefill + 1 token s | rows equal to hybridlm's | tokens agreeing |",
           "|---|---|---|---|---|---|---|"]
    ours = by_batch(results.get("hybridlm"))
    for stage in STAGES:
        for batch, r in by_batch(results.get(stage)).items():
            same = agreement(ours[batch]["rows"], r["rows"]) if batch in ours and stage != "hybridlm" else None
            agree = f"{same[0]}/{len(r['rows'])} | {100 * same[1]:.0f}%" if same else " | "
            prefill = "-" if r["prefill_s"] is None else f"{r['prefill_s']:.3f}"
            out.append(f"| {stage} | {batch} | {r['tokens_per_sec']:,.0f} | {r['decode_step_ms']:.2f} | {prefill} | {agree} |")
    exact = fp32_agreement(results)
    if exact:
        out.append(f"\nfp32 check (the same weights in fp32, batch {max(args.batch_sizes)}, {args.fp32_tokens} new tokens): "
                   f"{exact[0]}/{exact[1]} of hybridlm's greedy rows equal transformers' generate to the end")
    return "\n".join(out)


def records_of(results: dict, args, argv: list) -> list[dict]:
    out = []
    ours, exact = by_batch(results.get("hybridlm")), fp32_agreement(results)
    for stage in STAGES:
        for batch, r in by_batch(results.get(stage)).items():
            label = (f"greedy decoding, {'tiny' if args.tiny else 'Qwen2-0.5B shape'}, batch {batch}, {args.new_tokens} new tokens, "
                     + {"hybridlm": "hybridlm's generator (CUDA graphs)", "hf-compiled": "transformers generate, static cache + "
                        "torch.compile reduce-overhead", "hf": "transformers generate, dynamic cache (as TRL calls it)"}[stage])
            figures = {"tokens/s": f"{r['tokens_per_sec']:,.0f}", "decode step ms": f"{r['decode_step_ms']:.2f}"}
            if stage != "hybridlm" and batch in ours:
                figures["hybridlm/this"] = f"{ours[batch]['tokens_per_sec'] / r['tokens_per_sec']:.2f}x"
                figures["rows equal"] = "{}/{}".format(agreement(ours[batch]["rows"], r["rows"])[0], len(r["rows"]))
            if stage == "hf" and exact and int(batch) == max(args.batch_sizes):
                figures[f"rows equal fp32 ({args.fp32_tokens} tokens)"] = f"{exact[0]}/{exact[1]}"
            out.append(script_record("python benchmarks/generation_speed.py", argv, label, figures,
                                     system="hybridlm" if stage == "hybridlm" else "transformers"))
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--workdir", default=None, help="model and its import (default: <out>/work; reused when complete)")
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--batches", default="1,64", help="comma list of batch sizes")
    parser.add_argument("--new-tokens", type=int, default=None, help="default 512; tiny 16")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--fp32-tokens", type=int, default=None, help="new tokens of the fp32 equality check (default 128; tiny 16)")
    parser.add_argument("--only", default=",".join(STAGES))
    parser.add_argument("--profile", action="store_true", help="profile hybridlm's decode at the largest batch instead")
    parser.add_argument("--record-file", default=None)
    parser.add_argument("--stage", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.batch_sizes = [int(b) for b in args.batches.split(",")]
    args.new_tokens = args.new_tokens or (16 if args.tiny else 512)
    args.fp32_tokens = args.fp32_tokens or (16 if args.tiny else 128)
    args.workdir = args.workdir or os.path.join(args.out, "work")
    os.makedirs(args.workdir, exist_ok=True)
    os.makedirs(args.out, exist_ok=True)
    if args.stage:
        paths = prepare(args)
        result = {"hybridlm": lambda: stage_hybridlm(args, paths), "hf-compiled": lambda: stage_hf(args, paths, True),
                  "hf": lambda: stage_hf(args, paths, False)}[args.stage]()
        stages.report(result)
        return 0
    prepare(args)
    options = ["--out", args.out, "--workdir", args.workdir, "--batches", args.batches, "--new-tokens", str(args.new_tokens),
               "--repeats", str(args.repeats), "--fp32-tokens", str(args.fp32_tokens)] + (["--tiny"] if args.tiny else []) + (["--profile"] if args.profile else [])
    only = ["hybridlm"] if args.profile else [s for s in args.only.split(",") if s in STAGES]
    results = {s: stages.run_stage(__file__, s, options, os.path.join(args.out, f"{s}.log")) for s in only}
    if args.profile:
        print((results.get("hybridlm") or {}).get("profile", "the profile run failed"), flush=True)
        return 0
    stages.finish(results, os.path.join(args.out, "results.json"), table(results, args),
                  lambda: records_of(results, args, argv if argv is not None else sys.argv[1:]), args.record_file)
    return 0


if __name__ == "__main__":
    sys.exit(main())
