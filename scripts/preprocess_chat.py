"""Chat JSONL -> token and loss-mask datasets for fine-tuning:

    python scripts/preprocess_chat.py --input chat.jsonl --output-prefix data/chat --tokenizer-model hf_dir/ \\
        [--chat-template FILE] [--seq-length N] [--train-on all|last] [--workers N] [--skip-bad-lines]

Reads messages / ShareGPT / Alpaca lines (supervised) or prompt/chosen/rejected and
messages + rejected_response lines (preference), renders them with the model's chat template and
writes <prefix>.bin/.idx, <prefix>_mask.bin/.idx and <prefix>.manifest.json; train with --data-path <prefix>.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hybridlm.data.chat_preprocess import TRAIN_ON, preprocess_chat  # noqa: E402
from hybridlm.data.preprocess import run_script  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    p.add_argument("--input", nargs="+", required=True, help="JSONL files or globs (quoted), one example per line.")
    p.add_argument("--output-prefix", required=True, help="Output path prefix: <prefix>.bin/.idx, <prefix>_mask.bin/.idx, <prefix>.manifest.json.")
    p.add_argument("--tokenizer-model", required=True, help="The model's Hugging Face tokenizer directory (tokenizer.json + tokenizer_config.json).")
    p.add_argument("--chat-template", default=None, help="A Jinja2 chat template file to use instead of the tokenizer's.")
    p.add_argument("--seq-length", type=int, default=None, help="Keep at most this many tokens + 1 of each conversation (default: all).")
    p.add_argument("--train-on", choices=TRAIN_ON, default="all", help="Train on every assistant reply, or only the last (default all).")
    p.add_argument("--workers", type=int, default=1, help="Encoding processes (1: one process, two threads).")
    p.add_argument("--chunk-mb", type=float, default=2.0, help="Input read and encoded per task, in MB.")
    p.add_argument("--skip-bad-lines", action="store_true",
                   help="Skip and report bad lines (malformed JSON, an unknown role, ...) instead of stopping at the first.")
    p.add_argument("--no-progress", action="store_true", help="No progress line on stderr.")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    code, stats = run_script(lambda: preprocess_chat(
        args.input, args.output_prefix, args.tokenizer_model, chat_template=args.chat_template, seq_length=args.seq_length,
        train_on=args.train_on, workers=args.workers, chunk_bytes=max(1, int(args.chunk_mb * 2**20)), progress=not args.no_progress,
        skip_bad_lines=args.skip_bad_lines))
    if stats is None:
        return code
    for what, examples, count in (("skipped", stats.bad_examples, stats.bad_lines), ("dropped", stats.dropped_examples, stats.dropped)):
        for example in examples:
            print(f"{what} {example}", file=sys.stderr)
        if count > len(examples):
            print(f"... and {count - len(examples)} more {what}", file=sys.stderr)
    print(stats.summary())
    return code


if __name__ == "__main__":
    sys.exit(main())
