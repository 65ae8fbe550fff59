"""GRPO throughput on one GPU (issue 34): hybridlm's --task grpo (rollouts from its own KV-cache decoder on
the live weights) against TRL's GRPOTrainer (transformers' generate, no vLLM) on the same model, prompts,
reward and batch; rollout and training time apart; a table last.

    python3 benchmarks/grpo_throughput.py --out $OUT --workdir /tmp/grpobench [--steps 3 --warmup 1] [--only grpo,trl]
    python3 benchmarks/grpo_throughput.py --out /tmp/x --tiny     (smoke test on a CPU: tiny fp32 model, short completions)

The model is a Qwen2-0.5B-shaped Qwen2ForCausalLM (24 layers, hidden 896, 14 heads / 2 KV heads, ffn 4864,
vocabulary 151936, tied embeddings) with random weights, saved with a small ChatML tokenizer and imported
with convert_from_hf. The prompts are random-word user messages (16-64 words), G = 8 completions each,
sampled at temperature 1 up to --max-completion-length tokens: random weights almost never sample the end
of turn, so every completion has that length in both frameworks (512 by default, the long end of
256-512). The reward is the share of distinct words in a completion (both call the same function), the
loss TRL's default (dapo), beta 0, one optimizer step per rollout batch; --global-batch-size completions
per step (TRL: per-device batch x accumulation = its generation batch). Each framework runs in a
process of its own, timed over --steps steps after --warmup: completions per second of step time, the
seconds spent generating and the rest of the step (rewards, log-prob passes, forward, backward,
optimizer) apart.
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
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

from benchmarks import stages  # noqa: E402
from benchmarks.records import script_record  # noqa: E402

SHAPES = {
    "qwen2-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                       vocab_size=151936, max_position_embeddings=32768, rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=True),
    "tiny": stages.TINY_QWEN2,
}
STAGES = ("grpo", "trl")
REWARD = '''def distinct_words(completions, **kwargs):
    """The share of distinct words in a completion (cheap, so that the step times are the frameworks')."""
    texts = [c if isinstance(c, str) else c[0]["content"] for c in completions]
    return [len(set(t.split())) / (1 + len(t.split())) for t in texts]
'''


def prepare(args) -> dict:
    """The HF model directory, its import, the prompts and the reward file (made once per work directory)."""
    import torch
    import transformers

    from chat_fixtures import WORDS, tokenizer_dir, write_jsonl
    from hybridlm.interop.import_ import import_from_hf
    paths = {k: os.path.join(args.workdir, k) for k in ("hf", "ckpt")}
    paths.update(prompts=os.path.join(args.workdir, "prompts.jsonl"), rewards=os.path.join(args.workdir, "rewards.py"))
    if os.path.isfile(os.path.join(args.workdir, "ready")):
        return paths
    tokenizer_dir("chatml", paths["hf"])
    config = transformers.Qwen2Config(**SHAPES["tiny" if args.tiny else "qwen2-0.5b"])
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32 if args.tiny else torch.bfloat16)
    model.save_pretrained(paths["hf"])
    del model
    import_from_hf(paths["hf"], paths["ckpt"], seq_length=args.seq_length, progress=False)
    rng = random.Random(0)
    write_jsonl(paths["prompts"], [{"prompt": [{"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(rng.randint(16, 64)))}]}
                                   for _ in range(args.prompts)])
    with open(paths["rewards"], "w") as f:
        f.write(REWARD)
    open(os.path.join(args.workdir, "ready"), "w").close()
    return paths


def hybridlm_flags(args, paths: dict) -> list[str]:
    flags = ["--task", "grpo", "--load", paths["ckpt"], "--data-path", paths["prompts"],
             "--reward-funcs", paths["rewards"] + ":distinct_words", "--num-generations", str(args.num_generations),
             "--max-completion-length", str(args.max_completion_length), "--micro-batch-size", str(args.micro_batch_size),
             "--global-batch-size", str(args.global_batch_size), "--train-iters", str(args.warmup + args.steps),
             "--log-interval", "1", "--lr", "1e-6", "--min-lr", "1e-6", "--lr-warmup-iters", "0",
             "--deepspeed_config", os.path.join(ROOT, "ds_configs", "zero1.json"), "--attention-backend", args.attention]
    return flags + ([] if args.tiny else ["--bf16"]) + args.hybridlm_flags.split()


def stage_hybridlm(args, paths: dict) -> dict:
    from hybridlm.training.finetune import parse_finetune_args
    from hybridlm.training.trainer import pretrain
    flags = hybridlm_flags(args, paths)
    timed = pretrain(flags, parse_finetune_args)[args.warmup:]
    seconds = sum(r["step_seconds"] for r in timed)
    rollout = sum(r["rollout_seconds"] for r in timed)
    return {"completions_per_sec": args.global_batch_size * len(timed) / seconds, "step_seconds": seconds / len(timed),
            "rollout_seconds": rollout / len(timed), "rest_seconds": (seconds - rollout) / len(timed),
            "rollout_tokens_per_sec": statistics.median(r["rollout_tokens_per_sec"] for r in timed),
            "mean_length": statistics.mean(r["completions/mean_length"] for r in timed),
            "peak_memory_gib": max(r.get("max_memory_gib", 0.0) for r in timed),
            "command": "python3 benchmarks/grpo_throughput.py: " + " ".join(flags)}


def stage_trl(args, paths: dict) -> dict:
    """TRL's GRPOTrainer on the same prompts and reward: transformers' generate (no vLLM), bf16 weights."""
    import importlib.util

    import torch
    import transformers
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer
    spec = importlib.util.spec_from_file_location("grpo_bench_rewards", paths["rewards"])
    rewards = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(rewards)
    with open(paths["prompts"]) as f:
        rows = [json.loads(line) for line in f]
    gpu = torch.cuda.is_available()
    model = transformers.AutoModelForCausalLM.from_pretrained(paths["hf"], dtype=torch.float32 if args.tiny else torch.bfloat16,
                                                              attn_implementation="sdpa")
    tokenizer = transformers.AutoTokenizer.from_pretrained(paths["hf"])
    config = GRPOConfig(output_dir=os.path.join(args.workdir, "trl"), per_device_train_batch_size=args.micro_batch_size,
                        gradient_accumulation_steps=args.global_batch_size // args.micro_batch_size,
                        num_generations=args.num_generations, max_completion_length=args.max_completion_length, temperature=1.0,
                        beta=0.0, loss_type="dapo", num_iterations=1, learning_rate=1e-6, lr_scheduler_type="constant",
                        max_steps=args.warmup + args.steps, bf16=not args.tiny, logging_steps=10**6, save_strategy="no",
                        report_to=[], dataloader_num_workers=0, gradient_checkpointing=False, use_vllm=False,
                        optim="adamw_torch_fused" if gpu else "adamw_torch", use_cpu=not gpu)
    generation = []
    clock, ends = stages.step_clock()
    now = stages.synchronized_now
    trainer = GRPOTrainer(model=model, reward_funcs=[rewards.distinct_words], args=config, train_dataset=Dataset.from_list(rows),
                          processing_class=tokenizer, callbacks=[clock])
    generate, lengths = trainer._generate_single_turn, []

    def timed_generate(*a, **kw):  # transformers' generate, as TRL calls it once per generation batch
        start = now()
        completion_ids, logprobs = generate(*a, **kw)
        generation.append((len(ends), now() - start))
        lengths.extend(len(c) for c in completion_ids)
        return completion_ids, logprobs
    trainer._generate_single_turn = timed_generate
    trainer.train()
    steps = len(ends) - 1 - args.warmup
    seconds = ends[-1] - ends[args.warmup]
    rollout = sum(s for step, s in generation if step > args.warmup)
    return {"completions_per_sec": args.global_batch_size * steps / seconds, "step_seconds": seconds / steps,
            "rollout_seconds": rollout / steps, "rest_seconds": (seconds - rollout) / steps,
            "rollout_tokens_per_sec": sum(lengths) / max(sum(s for _, s in generation), 1e-9),
            "mean_length": statistics.mean(lengths),
            "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if gpu else 0.0,
            "trl": __import__("trl").__version__, "transformers": transformers.__version__}


def run_stage(args, stage: str) -> dict:
    """One measurement in a process of its own (benchmarks/stages.py)."""
    options = ["--out", args.out, "--workdir", args.workdir, "--seq-length", str(args.seq_length),
               "--micro-batch-size", str(args.micro_batch_size), "--global-batch-size", str(args.global_batch_size),
               "--num-generations", str(args.num_generations), "--max-completion-length", str(args.max_completion_length),
               "--steps", str(args.steps), "--warmup", str(args.warmup), "--prompts", str(args.prompts),
               "--attention", args.attention, f"--hybridlm-flags={args.hybridlm_flags}"]
    return stages.run_stage(__file__, stage, options + (["--tiny"] if args.tiny else []), os.path.join(args.out, f"{stage}.log"))


def versus_trl(results: dict) -> float | None:
    """hybridlm / TRL in completions per second (the issue's target: >= 2x)."""
    ours, theirs = (results.get(s) or {} for s in STAGES)
    return ours["completions_per_sec"] / theirs["completions_per_sec"] if ours.get("completions_per_sec") and \
        theirs.get("completions_per_sec") else None


def describe(args) -> str:
    shape = "tiny" if args.tiny else "Qwen2-0.5B shape"
    return (f"{shape}, random weights, G {args.num_generations}, completions of {args.max_completion_length} tokens, "
            f"{args.global_batch_size} completions per step (mb {args.micro_batch_size}), {'fp32' if args.tiny else 'bf16'}")


def table(results: dict, args) -> str:
    import torch
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    out = [f"GRPO throughput, {describe(args)}, {device}, {time.strftime('%Y-%m-%d')}",
           "| run | completions/s | step s | generation s | rest of step s | generated tok/s | mean length | peak GiB |",
           "|---|---|---|---|---|---|---|---|"]
    for stage in STAGES:
        r = results.get(stage) or {}
        if not r:
            out.append(f"| {stage} | failed | | | | | | |")
            continue
        out.append(f"| {stage} | {r['completions_per_sec']:.2f} | {r['step_seconds']:.2f} | {r['rollout_seconds']:.2f} | "
                   f"{r['rest_seconds']:.2f} | {r['rollout_tokens_per_sec']:,.0f} | {r['mean_length']:.0f} | {r['peak_memory_gib']:.1f} |")
    ratio = versus_trl(results)
    if ratio is not None:
        out.append(f"hybridlm / TRL {results['trl'].get('trl', '?')}, completions/s: {ratio:.2f}x (target >= 2x)")
    return "\n".join(out)


def records_of(results: dict, args, argv: list[str]) -> list[dict]:
    """The suite's records of one call: hybridlm and TRL side by side; a run that failed is a failed record."""
    trl = results.get("trl") or {}
    labels = {"grpo": ("hybridlm", f"GRPO, {describe(args)}, own KV-cache decoder {args.hybridlm_flags}".strip()),
              "trl": ("trl", f"GRPO, {describe(args)}, TRL {trl.get('trl', '')} GRPOTrainer, transformers generate, no vLLM")}
    ratio, out = versus_trl(results), []
    for stage, (system, label) in labels.items():
        if stage not in results:
            continue
        r = results[stage]
        figures = {"completions/s": f"{r['completions_per_sec']:.2f}", "generation s/step": f"{r['rollout_seconds']:.2f}",
                   "rest s/step": f"{r['rest_seconds']:.2f}", "peak GiB": f"{r['peak_memory_gib']:.1f}"} if r else {}
        if stage == "grpo" and ratio is not None:
            figures["hybridlm/TRL"] = f"{ratio:.2f}x"
        record = script_record("python benchmarks/grpo_throughput.py", argv, label, figures, system=system)
        if not r:
            record.update(status="failed", error=f"the {stage} run failed (its log: {stage}.log)")
        out.append(record)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="folder for logs and results.json")
    parser.add_argument("--workdir", default=None, help="model and prompts (default: <out>/work; reused when complete)")
    parser.add_argument("--tiny", action="store_true", help="a tiny fp32 model on whatever device (CPU smoke test)")
    parser.add_argument("--max-completion-length", type=int, default=None, help="tokens per completion (default 512; tiny 16)")
    parser.add_argument("--seq-length", type=int, default=None, help="the import's --seq-length (default: 1024; tiny 128)")
    parser.add_argument("--num-generations", type=int, default=8)
    parser.add_argument("--micro-batch-size", type=int, default=8, help="completions per micro-batch (TRL: per_device_train_batch_size)")
    parser.add_argument("--global-batch-size", type=int, default=64, help="completions per optimizer step, both frameworks")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--attention", default="auto", help="hybridlm's --attention-backend")
    parser.add_argument("--hybridlm-flags", default="", help="more flags for the hybridlm run, given with '='")
    parser.add_argument("--only", default=",".join(STAGES), help=f"comma list of {', '.join(STAGES)} (prepare: only the model and data)")
    parser.add_argument("--record-file", default=None, help="append one JSON record per run (the benchmark suite's)")
    parser.add_argument("--stage", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.max_completion_length = args.max_completion_length or (16 if args.tiny else 512)
    args.seq_length = args.seq_length or (128 if args.tiny else 1024)
    if args.global_batch_size % (args.micro_batch_size * 1) or args.global_batch_size % args.num_generations:
        parser.error("--global-batch-size must be a multiple of --micro-batch-size and of --num-generations.")
    args.workdir = args.workdir or os.path.join(args.out, "work")
    os.makedirs(args.out, exist_ok=True)
    if args.stage:
        paths = prepare(args)
        result = {"grpo": lambda: stage_hybridlm(args, paths), "trl": lambda: stage_trl(args, paths)}[args.stage]()
        stages.report(result)
        return 0
    started = time.perf_counter()
    prepare(args)
    print(f"model and prompts ready in {args.workdir} ({time.perf_counter() - started:.0f} s)", flush=True)
    results = {stage: run_stage(args, stage) for stage in args.only.split(",") if stage in STAGES}
    stages.finish(results, os.path.join(args.out, "results.json"), table(results, args),
                  lambda: records_of(results, args, argv if argv is not None else sys.argv[1:]), args.record_file)
    return 0


if __name__ == "__main__":
    sys.exit(main())
