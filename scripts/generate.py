"""Generate text from a hybridlm checkpoint (any saved layout): greedy, or top-k / top-p sampling,
with a KV cache, tensor-parallel over the launched ranks.

    python scripts/generate.py --checkpoint runs/x --prompt "def fib(n):" --max-new-tokens 64
    torchrun --nproc_per_node 2 scripts/generate.py --checkpoint runs/x --prompt "..." --sample --top-p 0.9
    deepspeed --num_gpus 2 scripts/generate.py --checkpoint runs/x --prompt-ids "1 2 3"

TP is the number of ranks launched. Rank 0 prints each continuation (and writes --output-json).
"""
import argparse
import json
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
    return args


def main(argv=None) -> int:
    args = parse(argv)
    import torch
    import torch.distributed as dist

    from hybridlm.config import ConfigError, world_size_from_env
    from hybridlm.data.tokenizers import build_tokenizer
    from hybridlm.interop.generate import Sampling, load_for_generation
    from hybridlm.interop.layout import read_info, resolve_tag_dir
    from hybridlm.parallel.state import ParallelState
    from hybridlm.training.distributed import device, init_distributed

    try:  # bad input ends here, before any process group exists
        info = read_info(resolve_tag_dir(args.checkpoint))
        cfg, tp = info.model_config(), world_size_from_env()
        if cfg.num_attention_heads % tp or cfg.num_query_groups % tp:
            raise ConfigError(f"{tp} ranks (TP) do not divide the model's {cfg.num_attention_heads} attention heads "
                              f"and {cfg.num_query_groups} key/value groups.")
        tokenizer = None
        if args.prompt or not args.ignore_eos:
            tokenizer = build_tokenizer(info.settings.get("tokenizer_type") or "ByteTokenizer", info.settings.get("tokenizer_model"),
                                        info.settings.get("vocab_file"), info.settings.get("merge_file"))
        prompts = [tokenizer.encode(p) for p in args.prompt] + [[int(t) for t in ids.split()] for ids in args.prompt_ids]
        for prompt in prompts:
            if not prompt or any(not 0 <= t < cfg.vocab_size for t in prompt):
                raise ConfigError(f"a prompt is empty or has token ids outside the vocabulary 0..{cfg.vocab_size - 1}.")
            if cfg.position_embedding_type == "learned_absolute" and len(prompt) + args.max_new_tokens > cfg.max_position_embeddings:
                raise ConfigError(f"a prompt of {len(prompt)} tokens + --max-new-tokens {args.max_new_tokens} exceeds the "
                                  f"model's {cfg.max_position_embeddings} positions.")
    except ValueError as e:  # ConfigError, or a --prompt-ids entry that is not a number
        print(f"error: {e}", file=sys.stderr)
        return 2
    init_distributed(timeout_minutes=10)
    ps = ParallelState(tp=dist.get_world_size())
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}.get(args.dtype)
    generator, _, _ = load_for_generation(args.checkpoint, ps.tp, device(), dtype)
    sampling = Sampling(greedy=not args.sample, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    eos = None if args.ignore_eos or tokenizer is None else tokenizer.eod
    results = []
    for prompt in prompts:
        new = generator.generate(prompt, args.max_new_tokens, sampling, eos=eos)
        results.append({"prompt_ids": prompt, "generated_ids": new})
        if dist.get_rank() == 0:
            text = tokenizer.decode(new) if tokenizer is not None else " ".join(map(str, new))
            print(f"--- prompt {len(results)} ({len(prompt)} tokens) -> {len(new)} tokens\n{text}", flush=True)
    if dist.get_rank() == 0 and args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
