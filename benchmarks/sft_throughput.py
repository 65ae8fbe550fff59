"""Fine-tuning throughput on one GPU (issue 21): hybridlm's packed SFT against TRL's SFTTrainer (packing,
padding-free, the fastest flash attention transformers can load here) on the same data, hybridlm's
pretraining at the same shape, and DPO's reference pass; a table last.

    python3 benchmarks/sft_throughput.py --out $OUT --workdir /tmp/sftbench [--steps 20 --warmup 5] [--only sft,trl,pretrain,dpo]
    python3 benchmarks/sft_throughput.py --out /tmp/x --tiny     (smoke test on a CPU: tiny fp32 model, sdpa)

The model is a Qwen2-1.5B-shaped Qwen2ForCausalLM (28 layers, hidden 1536, 12 heads / 2 KV heads, ffn
8960, vocabulary 151936, tied embeddings) with random weights, saved as a Hugging Face directory with
a small ChatML tokenizer and imported with convert_from_hf. The data is random-word conversations of
random length (a reply after a prompt, up to the row length) through preprocess_chat.py; TRL reads
the same token ids and reply masks as a pre-tokenized dataset. Throughput is in loss tokens per second
(reply tokens that enter the loss) and in positions per second; each measurement runs in a process of
its own, timed over ``--steps`` steps after ``--warmup``.
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
    "qwen2-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                       vocab_size=151936, max_position_embeddings=32768, rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=True),
    "tiny": stages.TINY_QWEN2,
}
STAGES = ("sft", "pretrain", "trl", "dpo")


def prepare(args, config=None) -> dict:
    """The HF model directory, its import and the chat data (made once per work directory); ``config``:
    the transformers config of the model (default: the Qwen2 shape of ``SHAPES``)."""
    import torch
    import transformers

    from chat_fixtures import WORDS, tokenizer_dir, write_jsonl
    from hybridlm.data.chat_preprocess import preprocess_chat
    from hybridlm.interop.import_ import import_from_hf
    paths = {k: os.path.join(args.workdir, k) for k in ("hf", "ckpt", "sft", "pref")}
    if os.path.isfile(os.path.join(args.workdir, "ready")):
        return paths
    tokenizer_dir("chatml", paths["hf"])
    config = config or transformers.Qwen2Config(**SHAPES["tiny" if args.tiny else "qwen2-1.5b"])
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32 if args.tiny else torch.bfloat16)
    model.save_pretrained(paths["hf"])
    del model
    import_from_hf(paths["hf"], paths["ckpt"], seq_length=args.seq_length, progress=False)
    rng = random.Random(0)

    def text(tokens: int) -> str:  # about one token per word with this tokenizer's merges
        return " ".join(rng.choice(WORDS) for _ in range(max(1, tokens)))
    conversations = []
    for _ in range(args.samples):
        length = rng.randint(args.seq_length // 32, args.seq_length // 2)
        prompt = int(length * rng.uniform(0.2, 0.8))
        conversations.append({"messages": [{"role": "user", "content": text(prompt)}, {"role": "assistant", "content": text(length - prompt)}]})
    pairs = [{"prompt": text(rng.randint(16, args.seq_length // 4)), "chosen": text(rng.randint(16, args.seq_length // 3)),
              "rejected": text(rng.randint(16, args.seq_length // 3))} for _ in range(args.pairs)]
    for name, rows in (("sft", conversations), ("pref", pairs)):
        os.makedirs(paths[name], exist_ok=True)
        preprocess_chat([write_jsonl(os.path.join(paths[name], "in.jsonl"), rows)], os.path.join(paths[name], "data"),
                        paths["hf"], seq_length=args.seq_length, workers=4, progress=False)
    open(os.path.join(args.workdir, "ready"), "w").close()
    return paths


def hybridlm_flags(args, paths: dict, task: str) -> list[str]:
    flags = ["--seq-length", str(args.seq_length), "--micro-batch-size", str(args.micro_batch_size),
             "--global-batch-size", str(args.global_batch_size), "--train-iters", str(args.warmup + args.steps),
             "--log-interval", "1", "--lr", "1e-5", "--min-lr", "1e-5", "--lr-warmup-iters", "0",
             "--deepspeed_config", os.path.join(ROOT, "ds_configs", "zero1.json"), "--attention-backend", args.attention]
    flags += [] if args.tiny else ["--bf16"]
    if task == "sft":
        flags += ["--task", "sft", "--load", paths["ckpt"], "--data-path", os.path.join(paths["sft"], "data"), "--packing"]
    elif task == "pretrain":  # the same token file as pretraining documents, across boundaries
        flags += ["--load", paths["ckpt"], "--finetune", "--data-path", os.path.join(paths["sft"], "data"), "--split", "1,0,0"]
    return flags + args.hybridlm_flags.split()


def stage_hybridlm(args, paths: dict, task: str) -> dict:
    from hybridlm.config import parse_args
    from hybridlm.training.finetune import checkpoint_settings, parse_finetune_args
    from hybridlm.training.trainer import pretrain
    flags = hybridlm_flags(args, paths, task)
    parse = parse_finetune_args if task == "sft" else (lambda argv: parse_args(argv, base=checkpoint_settings(paths["ckpt"])))
    timed = pretrain(flags, parse)[args.warmup:]
    result = {"positions_per_sec": statistics.median(r["tokens_per_sec"] for r in timed),
              "mfu": statistics.median(r["mfu"] for r in timed) if timed[0]["mfu"] is not None else None,
              "peak_memory_gib": max(r.get("max_memory_gib", 0.0) for r in timed),
              "command": "python3 benchmarks/sft_throughput.py: " + " ".join(flags)}
    if task == "sft":
        result["loss_tokens_per_sec"] = statistics.median(r["loss_tokens_per_sec"] for r in timed)
    return result


def stage_dpo_reference(args, paths: dict) -> dict:
    """The reference pass alone (the run is built, which computes it, then stops)."""
    from hybridlm.training.finetune import parse_finetune_args
    from hybridlm.training.trainer import build_run, prepare_config
    flags = hybridlm_flags(args, paths, "dpo") + ["--task", "dpo", "--load", paths["ckpt"],
                                                  "--data-path", os.path.join(paths["pref"], "data")]
    cfg, ds = prepare_config(parse_finetune_args(flags))
    run = build_run(cfg, ds)
    task = run.task
    rows = 2 * task.pairs.num_pairs
    return {"pairs": task.pairs.num_pairs, "seconds": task.reference_seconds,
            "positions_per_sec": rows * args.seq_length / task.reference_seconds if task.reference_seconds else None}


TORCH_VARLEN = "torch_varlen"


def register_torch_varlen_attention() -> bool:
    """Give transformers the flash kernel torch carries (flash-attention 2's variable-length kernel,
    hybridlm's ``varlen_causal_attention``) as attn_implementation ``torch_varlen``, for a machine
    without the flash-attn package: TRL's padding-free batches then run what its ``flash_attention_2``
    would (the samples laid end to end, ``cu_seq_lens`` from TRL's collator), not SDPA with a
    block-diagonal mask. (A name with "flash" in it, transformers would look for on the hub.)
    False where torch has no such kernel."""
    import torch
    from transformers import AttentionInterface

    from hybridlm.model.attention_backends import torch_varlen_available, varlen_causal_attention
    if not torch_varlen_available():
        return False

    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, cu_seq_lens_q=None,
                  max_length_q=None, **unused):
        if cu_seq_lens_q is None or attention_mask is not None or dropout:
            raise ValueError(f"{TORCH_VARLEN} takes padding-free batches (cu_seq_lens_q from the collator), no mask, no dropout")
        b, heads, s, d = query.shape
        q, k, v = (t.transpose(1, 2).reshape(b * s, t.shape[1], d) for t in (query, key, value))
        out = varlen_causal_attention(q, k, v, cu_seq_lens_q.to(torch.int32), int(max_length_q), scale=scaling)
        return out.view(b, s, heads, d), None
    AttentionInterface.register(TORCH_VARLEN, attention)
    return True


def stage_trl(args, paths: dict) -> dict:
    """TRL's SFTTrainer on the same token ids and reply masks: packing (best fit decreasing), padding-free."""
    import torch
    import transformers
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from hybridlm.data.chat_dataset import ChatData
    data = ChatData(os.path.join(paths["sft"], "data"))
    rows = [{"input_ids": data.tokens[i].tolist(), "completion_mask": data.mask[i].tolist()} for i in range(len(data.tokens))]
    dtype = torch.float32 if args.tiny else torch.bfloat16
    model, implementation = None, None
    choices = (("flash_attention_4", "flash_attention_3", "flash_attention_2", TORCH_VARLEN, "sdpa") if args.trl_attention == "auto"
               else (args.trl_attention,))
    for implementation in choices:
        if implementation != "sdpa" and not torch.cuda.is_available():
            continue
        if implementation == TORCH_VARLEN and not register_torch_varlen_attention():
            continue
        try:
            model = transformers.AutoModelForCausalLM.from_pretrained(paths["hf"], dtype=dtype, attn_implementation=implementation)
            break
        except (ImportError, ValueError) as e:
            print(f"trl: attn_implementation={implementation} not available here: {str(e).splitlines()[0][:160]}", flush=True)
    tokenizer = transformers.AutoTokenizer.from_pretrained(paths["hf"])
    accumulation = args.global_batch_size // args.micro_batch_size
    config = SFTConfig(output_dir=os.path.join(args.workdir, "trl"), per_device_train_batch_size=args.micro_batch_size,
                       gradient_accumulation_steps=accumulation, max_steps=args.warmup + args.steps, learning_rate=1e-5, lr_scheduler_type="constant", bf16=not args.tiny,
                       packing=True, padding_free=True, max_length=args.seq_length, completion_only_loss=True, logging_steps=10**6,
                       save_strategy="no", report_to=[], dataloader_num_workers=0, gradient_checkpointing=False,
                       optim="adamw_torch_fused" if torch.cuda.is_available() else "adamw_torch", use_cpu=not torch.cuda.is_available())
    counts = []
    clock, ends = stages.step_clock()

    trainer = SFTTrainer(model=model, args=config, train_dataset=Dataset.from_list(rows), processing_class=tokenizer,
                         callbacks=[clock])
    collate, positions = trainer.data_collator, []

    def counting(examples):  # what each step trains on: loss tokens after the model's shift, positions
        batch = collate(examples)
        counts.append(int((batch["labels"][..., 1:] != -100).sum()))
        positions.append(batch["input_ids"].numel())
        return batch
    trainer.data_collator = counting  # the train dataloader is built from it in train()
    trainer.train()
    timed = slice(args.warmup * accumulation, (len(ends) - 1) * accumulation)  # micro-batches of the timed steps
    seconds = ends[-1] - ends[args.warmup]
    return {"attn_implementation": implementation, "loss_tokens_per_sec": sum(counts[timed]) / seconds,
            "positions_per_sec": sum(positions[timed]) / seconds,
            "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0,
            "trl": __import__("trl").__version__, "transformers": transformers.__version__}


def run_stage(args, stage: str) -> dict:
    """One measurement in a process of its own (benchmarks/stages.py)."""
    options = ["--out", args.out, "--workdir", args.workdir, "--seq-length", str(args.seq_length),
               "--micro-batch-size", str(args.micro_batch_size), "--global-batch-size", str(args.global_batch_size),
               "--steps", str(args.steps), "--warmup", str(args.warmup), "--samples", str(args.samples), "--pairs", str(args.pairs),
               "--attention", args.attention, f"--hybridlm-flags={args.hybridlm_flags}", "--trl-attention", args.trl_attention]
    return stages.run_stage(__file__, stage, options + (["--tiny"] if args.tiny else []), os.path.join(args.out, f"{stage}.log"))


def ratios(results: dict) -> tuple[float | None, float | None]:
    """The issue's two targets: hybridlm SFT / TRL in loss tokens/s, and hybridlm SFT / its own
    pretraining in positions/s (None where a run is missing)."""
    sft, trl, pre = (results.get(s) or {} for s in ("sft", "trl", "pretrain"))

    def ratio(a: dict, b: dict, key: str):
        return a[key] / b[key] if a.get(key) and b.get(key) else None
    return ratio(sft, trl, "loss_tokens_per_sec"), ratio(sft, pre, "positions_per_sec")


def table(results: dict, args) -> str:
    import torch
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    out = [f"SFT throughput, {'tiny' if args.tiny else 'Qwen2-1.5B shape'}, rows of {args.seq_length}, micro-batch "
           f"{args.micro_batch_size}, global batch {args.global_batch_size}, {device}, {time.strftime('%Y-%m-%d')}",
           "| run | loss tokens/s | positions/s | peak GiB | note |", "|---|---|---|---|---|"]

    def number(value):
        return f"{value:,.0f}" if value else "-"
    for stage in ("sft", "trl", "pretrain"):
        r = results.get(stage) or {}
        note = {"sft": f"hybridlm --task sft --packing {args.hybridlm_flags}".strip(),
                "trl": f"TRL {r.get('trl', '?')} SFTTrainer packing+padding_free, {r.get('attn_implementation', '?')}",
                "pretrain": "hybridlm pretraining, same shape and flags"}[stage]
        out.append(f"| {stage} | {number(r.get('loss_tokens_per_sec'))} | {number(r.get('positions_per_sec'))} | "
                   f"{r.get('peak_memory_gib', 0):.1f} | {note} |")
    versus_trl, versus_pretraining = ratios(results)
    if versus_trl is not None:
        out.append(f"hybridlm / TRL, loss tokens/s: {versus_trl:.2f}x (target >= 1.5x)")
    if versus_pretraining is not None:
        out.append(f"hybridlm SFT / pretraining, positions/s: {versus_pretraining:.3f} (target >= 0.9)")
    dpo = results.get("dpo") or {}
    if dpo.get("seconds"):
        out.append(f"DPO reference pass: {dpo['pairs']:,} pairs in {dpo['seconds']:.1f} s ({number(dpo['positions_per_sec'])} positions/s)")
    return "\n".join(out)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="folder for logs and results.json")
    parser.add_argument("--workdir", default=None, help="model and data (default: <out>/work; reused when complete)")
    parser.add_argument("--tiny", action="store_true", help="a tiny fp32 model on whatever device (CPU smoke test)")
    parser.add_argument("--seq-length", type=int, default=None, help="row length (default 4096; tiny 256)")
    parser.add_argument("--micro-batch-size", type=int, default=1)
    parser.add_argument("--global-batch-size", type=int, default=16, help="rows per optimizer step, both frameworks (TRL: "
                        "gradient accumulation); 16 is ms-swift's Megatron default")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--samples", type=int, default=600, help="conversations in the SFT data")
    parser.add_argument("--pairs", type=int, default=256, help="preference pairs for the DPO reference pass")
    parser.add_argument("--attention", default="auto", help="hybridlm's --attention-backend (auto: flash-attn when installed)")
    parser.add_argument("--hybridlm-flags", default="", help="more flags for both hybridlm runs, given with '=', e.g. --hybridlm-flags=--torch-compile")
    parser.add_argument("--trl-attention", default="auto", help="TRL's attn_implementation (auto: the first of flash_attention_4/3/2, "
                        f"{TORCH_VARLEN} (torch's own flash varlen kernel), "
                        "sdpa that loads)")
    parser.add_argument("--only", default=",".join(STAGES), help=f"comma list of {', '.join(STAGES)} (prepare: only the model and data)")
    parser.add_argument("--record-file", default=None, help="append one JSON record per run (the benchmark suite's)")
    parser.add_argument("--stage", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.seq_length = args.seq_length or (256 if args.tiny else 4096)
    if args.global_batch_size % args.micro_batch_size:
        parser.error(f"--global-batch-size {args.global_batch_size} is not a multiple of --micro-batch-size {args.micro_batch_size}.")
    args.workdir = args.workdir or os.path.join(args.out, "work")
    os.makedirs(args.out, exist_ok=True)
    if args.stage:
        paths = prepare(args)
        result = {"sft": lambda: stage_hybridlm(args, paths, "sft"), "pretrain": lambda: stage_hybridlm(args, paths, "pretrain"),
                  "trl": lambda: stage_trl(args, paths), "dpo": lambda: stage_dpo_reference(args, paths)}[args.stage]()
        stages.report(result)
        return 0
    started = time.perf_counter()
    prepare(args)
    print(f"model and data ready in {args.workdir} ({time.perf_counter() - started:.0f} s)", flush=True)
    # Results accumulate in the work directory, so that calls of a few stages each (a device call
    # has a time limit) still print one table; sft and trl belong in the same call.
    saved = os.path.join(args.workdir, "results.json")
    results = json.load(open(saved)) if os.path.isfile(saved) else {}
    results.update({stage: run_stage(args, stage) for stage in args.only.split(",") if stage in STAGES})
    with open(saved, "w") as f:
        json.dump(results, f, indent=2)
    stages.finish(results, os.path.join(args.out, "results.json"), table(results, args),
                  lambda: records_of(results, args, argv if argv is not None else sys.argv[1:]), args.record_file)
    return 0


def token_figures(result: dict) -> dict:
    """A fine-tuning stage's figures as the records show them (empty where the stage has none)."""
    return {"loss tokens/s": f"{result['loss_tokens_per_sec']:,.0f}" if result.get("loss_tokens_per_sec") else "",
            "positions/s": f"{result['positions_per_sec']:,.0f}" if result.get("positions_per_sec") else "",
            "peak GiB": f"{result['peak_memory_gib']:.1f}" if result.get("peak_memory_gib") else ""}


def records_of(results: dict, args, argv: list[str]) -> list[dict]:
    """The suite's records of one call: SFT, TRL and pretraining side by side (loss tokens/s, positions/s,
    peak memory), and DPO's reference pass; a run that failed is a failed record."""
    shape = "tiny" if args.tiny else "Qwen2-1.5B shape"
    where = (f"{shape}, packed rows of {args.seq_length}, mb {args.micro_batch_size} gbs {args.global_batch_size}, "
             f"{'fp32' if args.tiny else 'bf16'}")
    trl = results.get("trl") or {}
    versus_trl, versus_pretraining = ratios(results)
    runs = {"sft": ("hybridlm", f"SFT, {where}, --packing {args.hybridlm_flags}".strip()),
            "trl": ("trl", f"SFT, {where}, TRL {trl.get('trl', '')} SFTTrainer packing + padding-free, "
                           f"{trl.get('attn_implementation', '')}"),
            "pretrain": ("hybridlm", f"pretraining, {where.replace('packed rows', 'rows')} {args.hybridlm_flags}".strip()),
            "dpo": ("hybridlm", f"DPO reference pass, {shape}, {args.pairs} pairs")}
    out = []
    for stage, (system, label) in runs.items():
        if stage not in results:
            continue
        r = results[stage]
        figures = token_figures(r)
        if stage == "sft" and versus_trl is not None:
            figures["hybridlm/TRL"] = f"{versus_trl:.2f}x"
        if stage == "sft" and versus_pretraining is not None:
            figures["SFT/pretraining"] = f"{versus_pretraining:.3f}"
        record = script_record("python benchmarks/sft_throughput.py", argv, label, {k: v for k, v in figures.items() if v},
                               system=system)
        if not r:
            record.update(status="failed", error=f"the {stage} run failed (its log: {stage}.log)")
        out.append(record)
    return out


if __name__ == "__main__":
    sys.exit(main())
