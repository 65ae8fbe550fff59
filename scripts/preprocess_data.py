"""Tokenize JSONL into Megatron's indexed format: `python scripts/preprocess_data.py --input corpus.jsonl
--output-prefix data/corpus --tokenizer-type HuggingFaceTokenizer --tokenizer-model tok/ --append-eod --workers 2`.

Writes <output-prefix>_<key>_document.bin/.idx (Megatron's naming) and prints the --data-path to train with.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hybridlm.config import megatron  # noqa: E402
from hybridlm.data.preprocess import preprocess, run_script  # noqa: E402
from hybridlm.data.tokenizers import TOKENIZER_TYPES, TokenizerSpec  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Tokenize JSONL (.jsonl, .jsonl.gz, .jsonl.zst) into Megatron .bin/.idx files.",
                                allow_abbrev=False)
    p.add_argument("--input", nargs="+", required=True, help="JSONL files or globs (quoted), one JSON object per line.")
    p.add_argument("--json-keys", nargs="+", default=["text"], help="Keys whose string values are documents; one output per key.")
    p.add_argument("--output-prefix", required=True, help="Output path prefix; files are <prefix>_<key>_document.bin/.idx.")
    p.add_argument("--tokenizer-type", default="ByteTokenizer", choices=TOKENIZER_TYPES, help="Tokenizer kind.")
    p.add_argument("--tokenizer-model", default=None,
                   help="HuggingFaceTokenizer: a tokenizer.json or a local tokenizer directory; Llama2Tokenizer: a SentencePiece .model.")
    p.add_argument("--vocab-file", default=None, help="GPT2BPETokenizer: vocab.json.")
    p.add_argument("--merge-file", default=None, help="GPT2BPETokenizer: merges.txt.")
    p.add_argument("--append-eod", action="store_true", help="Append the end-of-document token to every document.")
    p.add_argument("--workers", type=int, default=1,
                   help="Encoding processes; each uses cores/workers tokenizer threads (1: one process, all cores).")
    p.add_argument("--skip-bad-lines", action="store_true",
                   help="Skip and count malformed lines and empty files instead of stopping at the first.")
    p.add_argument("--chunk-mb", type=float, default=2.0,
                   help="Input read and encoded per task, in MB; peak memory grows by ~70 MB per MB of chunk.")
    p.add_argument("--no-progress", action="store_true", help="No progress line on stderr.")
    p.add_argument("--vocab-size", type=int, default=None, help="NullTokenizer: the vocabulary (the last id ends documents).")
    megatron.add_to_parser(p, aliases=(), ignored=megatron.PREPROCESS_IGNORED, refused=megatron.PREPROCESS_REFUSED)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    spec = TokenizerSpec(args.tokenizer_type, args.tokenizer_model, args.vocab_file, args.merge_file, args.vocab_size)

    def work():
        for line in megatron.translate(vars(args), ignored=megatron.PREPROCESS_IGNORED, refused=megatron.PREPROCESS_REFUSED):
            print(line, file=sys.stderr)
        return preprocess(args.input, args.output_prefix, spec, json_keys=args.json_keys, append_eod=args.append_eod,
                          workers=args.workers, skip_bad_lines=args.skip_bad_lines,
                          chunk_bytes=max(1, int(args.chunk_mb * 2**20)), progress=not args.no_progress)
    code, stats = run_script(work)
    if stats is None:
        return code
    for example in stats.bad_examples:
        print(f"skipped {example}", file=sys.stderr)
    for path in stats.empty_files:
        print(f"skipped {path}: the file is empty", file=sys.stderr)
    print(stats.summary())
    return code


if __name__ == "__main__":
    sys.exit(main())
