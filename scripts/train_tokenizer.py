"""Train a byte-level BPE tokenizer on JSONL: `python scripts/train_tokenizer.py --input corpus.jsonl
--vocab-size 32000 --output tok/`, then preprocess with `--tokenizer-type HuggingFaceTokenizer --tokenizer-model tok/`.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hybridlm.config import ConfigError  # noqa: E402
from hybridlm.data.preprocess import train_tokenizer  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="Train a GPT-2-style byte-level BPE tokenizer from JSONL.", allow_abbrev=False)
    p.add_argument("--input", nargs="+", required=True, help="JSONL files or globs (.jsonl, .jsonl.gz, .jsonl.zst).")
    p.add_argument("--json-key", default="text", help="Key holding the document text.")
    p.add_argument("--vocab-size", type=int, default=32000, help="Vocabulary size, including 256 bytes and the EOD token.")
    p.add_argument("--min-frequency", type=int, default=2, help="Merge only pairs seen at least this often.")
    p.add_argument("--eod-token", default="<|endoftext|>", help="End-of-document special token.")
    p.add_argument("--max-documents", type=int, default=None, help="Train on at most this many documents.")
    p.add_argument("--skip-bad-lines", action="store_true", help="Skip malformed lines instead of stopping.")
    p.add_argument("--output", required=True, help="A directory (tokenizer.json + tokenizer_config.json) or a .json path.")
    args = p.parse_args(argv)
    try:
        path, vocab = train_tokenizer(args.input, args.output, vocab_size=args.vocab_size, json_key=args.json_key,
                                      min_frequency=args.min_frequency, eod_token=args.eod_token,
                                      max_documents=args.max_documents, skip_bad_lines=args.skip_bad_lines)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {path} (vocabulary {vocab}); use --tokenizer-type HuggingFaceTokenizer --tokenizer-model {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
