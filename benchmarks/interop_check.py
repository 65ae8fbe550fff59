"""GPU check of checkpoint interoperability (issue 7) with a mid-size bf16 model; prints a table last.

    python3 benchmarks/interop_check.py --out $OUT        (4 GPUs, after `source .device/install.sh`)
    python3 benchmarks/interop_check.py --out /tmp/x --tiny   (smoke test on CPU, tiny fp32 model)

1. Trains 20 steps at TP=2 x PP=2 (ZeRO-1, bf16), saving at steps 10 and 20.
2. Continues global_step10 for 10 steps unchanged and at other layouts (TP=1xPP=4, DP=4 ZeRO-1,
   DP=4 ZeRO-3, TP=4, TP=2xDP=2 ZeRO-2) and reports each run's largest relative loss difference
   from the uninterrupted run over steps 11-20.
3. Exports global_step20 (fp32) and compares transformers' logits with hybridlm's (one GPU, fp32).
4. Greedy generation of 32 tokens on 2 GPUs (scripts/generate.py, fp32) against transformers' generate
   on the export, with generation speed.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from hybridlm.presets import LLAMA_BLOCK, LLAMA_OPTIMIZER  # noqa: E402  (imports nothing else of the package)
from benchmarks.runner import free_port, gpu_choice  # noqa: E402

# Llama-style block and optimiser spelled out: flags left out take Megatron-LM's defaults (a GPT-2/3 block).
LLAMA = [*LLAMA_BLOCK, *LLAMA_OPTIMIZER]
MODEL = ["--num-layers", "8", "--hidden-size", "1024", "--num-attention-heads", "16", "--group-query-attention", "--num-query-groups", "4", *LLAMA,
         "--ffn-hidden-size", "2816", "--seq-length", "1024", "--vocab-size", "512",  # no TP-dependent vocabulary padding
         "--micro-batch-size", "4", "--global-batch-size", "32",
         "--bf16", "--lr", "3e-4", "--min-lr", "3e-5", "--lr-warmup-iters", "5", "--train-iters", "20", "--log-interval", "1",
         "--seed", "3"]
# --tiny: a smoke test of this script on a CPU machine (4 gloo ranks, the tests' tiny model).
TINY = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--num-query-groups", "4", *LLAMA,
        "--ffn-hidden-size", "128", "--seq-length", "32", "--vocab-size", "512", "--micro-batch-size", "2",
        "--global-batch-size", "8", "--lr", "1e-2", "--min-lr", "1e-3", "--lr-warmup-iters", "0", "--train-iters", "20",
        "--log-interval", "1", "--seed", "7"]
LAYOUTS = {  # name: (flags, ZeRO config)
    "unchanged TP2xPP2 ZeRO-1": (["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"], "zero1"),
    "TP1xPP4 ZeRO-1": (["--pipeline-model-parallel-size", "4"], "zero1"),
    "DP4 ZeRO-1": ([], "zero1"),
    "DP4 ZeRO-3": ([], "zero3"),
    "TP4 ZeRO-1": (["--tensor-model-parallel-size", "4"], "zero1"),
    "TP2xDP2 ZeRO-2": (["--tensor-model-parallel-size", "2"], "zero2"),
}


def pretrain(out: str, name: str, gpus: int, flags: list[str]) -> list[float]:
    metrics = os.path.join(out, f"{name}.jsonl")
    log = os.path.join(out, "logs", f"{name}.log")
    with open(log, "w") as f:
        code = subprocess.run(["deepspeed", *gpu_choice(gpus), "--master_port", str(free_port()), "scripts/pretrain.py", *flags,
                               "--metrics-file", metrics], cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, timeout=900).returncode
    if code != 0 or not os.path.isfile(metrics):
        print(f"[{name}] failed with exit code {code}; see {log}", flush=True)
        return []
    return [json.loads(line)["loss"] for line in open(metrics) if '"loss"' in line]


def logits_check(out: str, checkpoint: str, device: str) -> float:
    import torch
    from transformers import AutoModelForCausalLM

    from hybridlm.interop.export import export_to_hf
    from hybridlm.interop.layout import read_info, resolve_tag_dir
    from hybridlm.interop.reader import CheckpointReader
    from hybridlm.model.specs import build_model
    from hybridlm.model.weights import load_full_state_dict
    from hybridlm.parallel.plan import LayerFactory
    from hybridlm.parallel.state import SINGLE

    export_to_hf(checkpoint, os.path.join(out, "hf"), dtype="fp32", progress=False)
    tag = resolve_tag_dir(checkpoint)
    cfg = read_info(tag).model_config(tp=1)
    model = build_model(cfg, LayerFactory(device=device)).eval()
    reader = CheckpointReader(tag)
    load_full_state_dict(model, {n: reader.weight(n).float() for n in reader.names()}, SINGLE)
    hf = AutoModelForCausalLM.from_pretrained(os.path.join(out, "hf"), dtype=torch.float32).to(device).eval()
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length), generator=torch.Generator().manual_seed(0)).to(device)
    with torch.no_grad():
        ours = model(tokens).permute(1, 0, 2)[..., : cfg.vocab_size]
        theirs = hf(tokens).logits
    return float((ours - theirs).abs().max())


def generation_check(out: str, checkpoint: str, device: str) -> tuple[bool, float, float]:
    import torch
    from transformers import AutoModelForCausalLM
    prompt = list(range(60, 75))
    hf = AutoModelForCausalLM.from_pretrained(os.path.join(out, "hf"), dtype=torch.float32).to(device).eval()
    started = time.time()
    theirs = hf.generate(torch.tensor([prompt], device=device), max_new_tokens=32, do_sample=False, eos_token_id=None,
                         pad_token_id=0)[0, len(prompt):].tolist()
    hf_seconds = time.time() - started
    result = os.path.join(out, "generated.json")
    started = time.time()
    with open(os.path.join(out, "logs", "generate.log"), "w") as f:
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
                        "scripts/generate.py", "--checkpoint", checkpoint, "--prompt-ids", " ".join(map(str, prompt)),
                        "--max-new-tokens", "32", "--ignore-eos", "--dtype", "fp32", "--output-json", result],
                       cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, timeout=600)
    ours_seconds = time.time() - started
    ours = json.load(open(result))[0]["generated_ids"] if os.path.isfile(result) else None
    return ours == theirs, hf_seconds, ours_seconds


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "/tmp/out"))
    parser.add_argument("--tiny", action="store_true", help="Smoke-test this script on CPU with the tests' tiny model.")
    args = parser.parse_args()
    out, model, device = args.out, (TINY if args.tiny else MODEL), ("cpu" if args.tiny else "cuda")
    os.makedirs(os.path.join(out, "logs"), exist_ok=True)
    sys.path.insert(0, ROOT)
    ck = os.path.join(out, "ck")
    ds = lambda zero: ["--deepspeed_config", f"ds_configs/{zero}.json"]  # noqa: E731
    whole = pretrain(out, "whole", 4, model + LAYOUTS["unchanged TP2xPP2 ZeRO-1"][0] + ds("zero1") +
                     ["--save", ck, "--save-interval", "10"])
    rows = []
    for name, (flags, zero) in LAYOUTS.items():
        started = time.time()
        losses = pretrain(out, name.replace(" ", "_"), 4, model + flags + ds(zero) + ["--load", ck, "--ckpt-step", "10"])
        diff = max((abs(a - b) / abs(b) for a, b in zip(losses, whole[10:])), default=float("nan")) if losses else float("nan")
        rows.append(f"| {name} | {len(losses)} | {diff:.2e} | {time.time() - started:.0f} s |")
    logits = logits_check(out, ck, device)
    same, hf_seconds, ours_seconds = generation_check(out, ck, device)
    print("\n| continued from global_step10 at | steps | max rel. loss diff vs uninterrupted (steps 11-20) | wall |")
    print("|---|---|---|---|")
    print("\n".join(rows))
    print(f"\nexport fp32: max |logits(transformers) - logits(hybridlm)| = {logits:.2e} (2 sequences, one {device})")
    print(f"greedy 32 tokens, TP=2 fp32: {'equal to' if same else 'DIFFERENT from'} transformers' generate "
          f"(ours {ours_seconds:.1f} s incl. launch and load; transformers {hf_seconds:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
