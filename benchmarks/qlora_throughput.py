"""QLoRA on one GPU (issue 35): hybridlm's 4-bit base under LoRA against PEFT + bitsandbytes through TRL's
SFTTrainer (a transformers Trainer), on the same packed chat data; a table last.

    python3 benchmarks/qlora_throughput.py --out $OUT --workdir /tmp/qlorabench [--shape llama2-7b] [--steps 5 --warmup 2]
    python3 benchmarks/qlora_throughput.py --out /tmp/x --tiny     (smoke test on a CPU: tiny fp32 model)

The model is a LlamaForCausalLM of the ``--shape`` (llama2-7b: 32 layers, hidden 4096, ffn 11008, 32 heads,
vocabulary 32000, untied) with random bf16 weights, saved as a Hugging Face directory with a small chat
tokenizer and imported with convert_from_hf (benchmarks/sft_throughput.py's ``prepare``). Both sides train
LoRA R16 alpha 32, dropout 0, on every linear of the blocks (hybridlm: one adapter per fused weight) over
the base held in NF4 with double quantization, computing in bf16; rows of ``--seq-length`` packed from the
same conversations, micro-batch 1, ``--global-batch-size`` rows a step, AdamW at a constant LR. The PEFT
side checkpoints every layer's activations (``gradient_checkpointing``, PEFT's QLoRA recipe; ``--no-peft-recompute``:
none, its fastest where the card holds every activation), hybridlm recomputes as ``--hybridlm-flags`` says (default:
every layer, the same). Each run is a process of its own;
its peak memory is torch.cuda.max_memory_allocated over the whole process, loading and quantization included.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

from benchmarks import stages  # noqa: E402
from benchmarks.records import script_record  # noqa: E402
from benchmarks.sft_throughput import TORCH_VARLEN, prepare, register_torch_varlen_attention, token_figures  # noqa: E402

SHAPES = {
    "llama2-7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=32, vocab_size=32000, max_position_embeddings=4096),
    "llama2-13b": dict(hidden_size=5120, intermediate_size=13824, num_hidden_layers=40, num_attention_heads=40,
                       num_key_value_heads=40, vocab_size=32000, max_position_embeddings=4096),
    "tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                 vocab_size=512, max_position_embeddings=1024),
}
STAGES = ("hybridlm", "peft")
RANK, ALPHA = 16, 32
RECOMPUTE = "--recompute-granularity full"


def llama_config(args):
    import transformers
    return transformers.LlamaConfig(**SHAPES["tiny" if args.tiny else args.shape], tie_word_embeddings=False, rms_norm_eps=1e-5)


def hybridlm_flags(args, paths: dict) -> list[str]:
    return (["--task", "sft", "--load", paths["ckpt"], "--data-path", os.path.join(paths["sft"], "data"), "--packing",
             "--seq-length", str(args.seq_length), "--micro-batch-size", "1", "--global-batch-size", str(args.global_batch_size),
             "--train-iters", str(args.warmup + args.steps), "--log-interval", "1", "--lr", "1e-4", "--min-lr", "1e-4",
             "--lr-warmup-iters", "0", "--deepspeed_config", os.path.join(ROOT, "ds_configs", "zero1.json"),
             "--lora-rank", str(RANK), "--lora-alpha", str(ALPHA), "--lora-targets", "all-linear",
             "--quant-bits", "4", "--quant-type", "nf4", "--double-quant"]
            + ([] if args.tiny else ["--bf16"]) + args.hybridlm_flags.split())


def stage_hybridlm(args, paths: dict) -> dict:
    from hybridlm.training.finetune import parse_finetune_args
    from hybridlm.training.trainer import pretrain
    flags = hybridlm_flags(args, paths)
    timed = pretrain(flags, parse_finetune_args)[args.warmup:]
    return {"loss_tokens_per_sec": statistics.median(r["loss_tokens_per_sec"] for r in timed),
            "positions_per_sec": statistics.median(r["tokens_per_sec"] for r in timed),
            "peak_memory_gib": max(r.get("max_memory_gib", 0.0) for r in timed), "final_loss": timed[-1]["loss"],
            "command": "python3 benchmarks/qlora_throughput.py: scripts/finetune.py " + " ".join(flags)}


def stage_peft(args, paths: dict) -> dict:
    """TRL's SFTTrainer with a PEFT LoraConfig on transformers' 4-bit model (BitsAndBytesConfig), packing and
    padding-free on the same token ids and reply masks, gradient checkpointing."""
    import peft
    import torch
    import transformers
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from hybridlm.data.chat_dataset import ChatData
    data = ChatData(os.path.join(paths["sft"], "data"))
    rows = [{"input_ids": data.tokens[i].tolist(), "completion_mask": data.mask[i].tolist()} for i in range(len(data.tokens))]
    on_gpu = torch.cuda.is_available()
    dtype = torch.bfloat16 if on_gpu and not args.tiny else torch.float32
    quant = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                            bnb_4bit_compute_dtype=dtype)
    implementation = TORCH_VARLEN if on_gpu and register_torch_varlen_attention() else "sdpa"
    model = transformers.AutoModelForCausalLM.from_pretrained(paths["hf"], quantization_config=quant, dtype=dtype,
                                                              attn_implementation=implementation,
                                                              device_map="cuda" if on_gpu else "cpu")
    lora = peft.LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, target_modules="all-linear", bias="none",
                           task_type="CAUSAL_LM")
    config = SFTConfig(output_dir=os.path.join(args.workdir, "peft"), per_device_train_batch_size=1,
                       gradient_accumulation_steps=args.global_batch_size, max_steps=args.warmup + args.steps,
                       learning_rate=1e-4, lr_scheduler_type="constant", bf16=dtype == torch.bfloat16, packing=True,
                       padding_free=implementation == TORCH_VARLEN, max_length=args.seq_length, completion_only_loss=True,
                       gradient_checkpointing=args.peft_recompute,
                       gradient_checkpointing_kwargs={"use_reentrant": False} if args.peft_recompute else None,
                       logging_steps=10**6, save_strategy="no", report_to=[], dataloader_num_workers=0,
                       optim="adamw_torch_fused" if on_gpu else "adamw_torch", use_cpu=not on_gpu)
    counts, positions = [], []
    clock, ends = stages.step_clock()

    trainer = SFTTrainer(model=model, args=config, train_dataset=Dataset.from_list(rows), peft_config=lora, callbacks=[clock],
                         processing_class=transformers.AutoTokenizer.from_pretrained(paths["hf"]))
    collate = trainer.data_collator

    def counting(examples):  # what each step trains on: loss tokens after the model's shift, positions
        batch = collate(examples)
        counts.append(int((batch["labels"][..., 1:] != -100).sum()))
        positions.append(batch["input_ids"].numel())
        return batch
    trainer.data_collator = counting
    trainer.train()
    timed = slice(args.warmup * args.global_batch_size, (len(ends) - 1) * args.global_batch_size)
    seconds = ends[-1] - ends[args.warmup]
    return {"loss_tokens_per_sec": sum(counts[timed]) / seconds, "positions_per_sec": sum(positions[timed]) / seconds,
            "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if on_gpu else 0.0,
            "attn_implementation": implementation, "peft": peft.__version__, "trl": __import__("trl").__version__,
            "bitsandbytes": __import__("bitsandbytes").__version__}


def run_stage(args, stage: str) -> dict:
    """One measurement in a process of its own (benchmarks/stages.py): fresh GPU memory, its own peak."""
    options = ["--out", args.out, "--workdir", args.workdir, "--shape", args.shape, "--seq-length", str(args.seq_length),
               "--global-batch-size", str(args.global_batch_size), "--steps", str(args.steps), "--warmup", str(args.warmup),
               "--samples", str(args.samples), f"--hybridlm-flags={args.hybridlm_flags}",
               "--peft-recompute" if args.peft_recompute else "--no-peft-recompute"]
    return stages.run_stage(__file__, stage, options + (["--tiny"] if args.tiny else []), os.path.join(args.out, f"qlora-{stage}.log"))


def describe(args) -> str:
    return (f"{'tiny' if args.tiny else args.shape} shape, LoRA R{RANK} alpha {ALPHA} all linears on an NF4 base (double "
            f"quantization), packed rows of {args.seq_length}, mb 1, gbs {args.global_batch_size}")


def table(results: dict, args) -> str:
    import torch
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    out = [f"QLoRA, {describe(args)}, {device}, {time.strftime('%Y-%m-%d')}",
           "| run | loss tokens/s | positions/s | peak GiB | note |", "|---|---|---|---|---|"]
    notes = {"hybridlm": f"hybridlm --quant-bits 4 {args.hybridlm_flags or '(no recompute)'}",
             "peft": "PEFT {peft} + bitsandbytes {bitsandbytes}, TRL {trl} SFTTrainer, " + peft_checkpointing_words(args) + ", {attn_implementation}"}
    for stage in STAGES:
        r = results.get(stage) or {}
        note = notes[stage].format(**{k: r.get(k, "?") for k in ("peft", "bitsandbytes", "trl", "attn_implementation")})
        number = lambda key: f"{r[key]:,.0f}" if r.get(key) else "-"  # noqa: E731
        out.append(f"| {stage} | {number('loss_tokens_per_sec')} | {number('positions_per_sec')} | "
                   f"{r.get('peak_memory_gib', 0):.1f} | {note} |")
    ratio = speedup(results)
    if ratio is not None:
        out.append(f"hybridlm / PEFT, loss tokens/s: {ratio:.2f}x (target >= 1.3x); hybridlm peak "
                   f"{results['hybridlm']['peak_memory_gib']:.1f} GiB (target <= 20 for llama2-7b)")
    return "\n".join(out)


def peft_checkpointing_words(args) -> str:
    return "gradient checkpointing" if args.peft_recompute else "no gradient checkpointing"


def speedup(results: dict):
    ours, theirs = results.get("hybridlm") or {}, results.get("peft") or {}
    if ours.get("loss_tokens_per_sec") and theirs.get("loss_tokens_per_sec"):
        return ours["loss_tokens_per_sec"] / theirs["loss_tokens_per_sec"]
    return None


def records_of(results: dict, args, argv: list[str]) -> list[dict]:
    """The suite's records: hybridlm and PEFT side by side; a run that failed is a failed record."""
    out = []
    for stage, system in (("hybridlm", "hybridlm"), ("peft", "peft-bnb")):
        if stage not in results:
            continue
        r = results[stage]
        figures = token_figures(r)
        if stage == "hybridlm" and speedup(results) is not None:
            figures["hybridlm/PEFT"] = f"{speedup(results):.2f}x"
        label = describe(args) + (f", {args.hybridlm_flags or 'no recompute'}" if stage == "hybridlm" else
                                  f", PEFT + bitsandbytes, TRL SFTTrainer, {peft_checkpointing_words(args)}")
        record = script_record("python benchmarks/qlora_throughput.py", argv, label, {k: v for k, v in figures.items() if v},
                               system=system)
        if not r:
            record.update(status="failed", error=f"the {stage} run failed (its log: qlora-{stage}.log)")
        out.append(record)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="folder for logs and results.json")
    parser.add_argument("--workdir", default=None, help="model and data (default: <out>/work; reused when complete)")
    parser.add_argument("--shape", default="llama2-7b", choices=[s for s in SHAPES if s != "tiny"])
    parser.add_argument("--tiny", action="store_true", help="a tiny fp32 model on whatever device (CPU smoke test)")
    parser.add_argument("--seq-length", type=int, default=None, help="row length (default 4096; tiny 256)")
    parser.add_argument("--global-batch-size", type=int, default=8, help="rows per optimizer step (micro-batch 1)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--samples", type=int, default=400, help="conversations in the SFT data")
    parser.add_argument("--hybridlm-flags", default=RECOMPUTE, help=f"more hybridlm flags, given with '=' (default {RECOMPUTE!r})")
    parser.add_argument("--peft-recompute", action=argparse.BooleanOptionalAction, default=True,
                        help="PEFT's gradient checkpointing of every layer (its QLoRA recipe; default on)")
    parser.add_argument("--only", default=",".join(STAGES), help=f"comma list of {', '.join(STAGES)}")
    parser.add_argument("--record-file", default=None, help="append one JSON record per run (the benchmark suite's)")
    parser.add_argument("--stage", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.seq_length = args.seq_length or (256 if args.tiny else 4096)
    args.pairs = 1  # sft_throughput's prepare also writes preference data; none is needed here
    args.workdir = args.workdir or os.path.join(args.out, "work")
    os.makedirs(args.out, exist_ok=True)
    if args.stage:
        paths = prepare(args, llama_config(args))
        result = {"hybridlm": stage_hybridlm, "peft": stage_peft}[args.stage](args, paths)
        stages.report(result)
        return 0
    started = time.perf_counter()
    prepare(args, llama_config(args))
    print(f"model and data ready in {args.workdir} ({time.perf_counter() - started:.0f} s)", flush=True)
    results = {stage: run_stage(args, stage) for stage in args.only.split(",") if stage in STAGES}
    stages.finish(results, os.path.join(args.out, "qlora-results.json"), table(results, args),
                  lambda: records_of(results, args, argv if argv is not None else sys.argv[1:]), args.record_file)
    return 0


if __name__ == "__main__":
    sys.exit(main())
