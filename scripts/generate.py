"""Generate text from a hybridlm checkpoint (any saved layout): greedy, or top-k / top-p sampling,
with a KV cache, tensor-parallel over the launched ranks.

    python scripts/generate.py --checkpoint runs/x --prompt "def fib(n):" --max-new-tokens 64
    torchrun --nproc_per_node 2 scripts/generate.py --checkpoint runs/x --prompt "..." --sample --top-p 0.9
    deepspeed --num_gpus 2 scripts/generate.py --checkpoint runs/x --prompt-ids "1 2 3"

TP is the number of ranks launched. Rank 0 prints each continuation (and writes --output-json).
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True, help="A run directory (its latest checkpoint) or a global_step<N> folder.")
    parser.add_argument("--prompt", action="append", default=[], help="Prompt text (repeatable); encoded with the run's tokenizer.")
    parser.add_argument("--prompt-ids", action="append", default=[], help="Prompt as space-separated token ids (repeatable).")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--sample", action="store_true", help="Sample instead of greedy decoding.")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0, help="With --sample: keep the k most likely tokens (0: all).")
    parser.add_argument("--top-p", type=float, default=1.0, help="With --sample: keep the most likely tokens up to this probability.")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--ignore-eos", action="store_true", help="Do not stop at the tokenizer's end-of-document token.")
    parser.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default=None, help="Compute dtype (default: as saved).")
    parser.add_argument("--output-json", default=None, help="Write the prompts and generated ids here (rank 0).")
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if not args.prompt and not args.prompt_ids:
        parser.error("give at least one --prompt or --prompt-ids")
    if args.max_new_tokens < 1:
        parser.error("--max-new-tokens must be positive")
    if not 0.0 < args.top_p <= 1.0 or args.top_k < 0:
        parser.error("--top-p must be in (0, 1] and --top-k non-negative")
    try:
        args.prompt_ids = [[int(t) for t in ids.split()] for ids in args.prompt_ids]
    except ValueError:
        parser.error("--prompt-ids takes space-separated integers")
    return args


def main(argv=None) -> int:
    args = parse(argv)
    from hybridlm.interop.generate import generate_from_flags
    return generate_from_flags(args)


if __name__ == "__main__":
    sys.exit(main())
