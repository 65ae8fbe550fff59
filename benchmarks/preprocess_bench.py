"""Throughput of scripts/preprocess_data.py against the tokenizer's bare batch encoder (the ceiling).

    python benchmarks/preprocess_bench.py --workdir /tmp/preprocess_bench --size-mb 220 [--record-file R.jsonl] [--megatron SRC]

1. Builds a JSONL corpus of ``--size-mb`` MB from text files already on the machine (Python
   sources, C headers, docs under /usr and the venv), split into documents of <= 6000 characters.
2. Trains a 32k byte-level BPE on an eighth of it with scripts/train_tokenizer.py (unless one exists).
3. Ceiling: all documents in memory, ``Tokenizer.encode_batch`` (and ``encode_batch_fast``) over
   batches of 1000 documents on all cores; no JSON, no output.
4. Runs scripts/preprocess_data.py with --workers 1 and 2 as a user would (fresh process, JSON
   parsing, .bin/.idx written), timing the whole command and its peak RSS; with ``--megatron SRC``,
   Megatron-LM's tools/preprocess_data.py the same way on the same corpus and tokenizer.

MB/s always counts JSONL input bytes, so the rows compare; the ratio is ceiling time / run time.
"""
import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from benchmarks.records import append, script_record  # noqa: E402
TEXT_SUFFIXES = (".py", ".md", ".txt", ".rst", ".html", ".h", ".c")


def make_corpus(path: str, size_mb: float) -> None:
    target, written = int(size_mb * 1e6), 0
    with open(path + ".tmp", "w", encoding="utf-8") as out:
        for root in ("/usr", sys.prefix):
            for directory, dirs, files in os.walk(root):
                dirs.sort()
                for name in sorted(files):
                    if not name.endswith(TEXT_SUFFIXES):
                        continue
                    try:
                        with open(os.path.join(directory, name), encoding="utf-8") as f:
                            text = f.read(200_000)
                    except (UnicodeDecodeError, OSError):
                        continue
                    for i in range(0, len(text), 6000):
                        if text[i:i + 6000].strip():
                            line = json.dumps({"text": text[i:i + 6000]}) + "\n"
                            out.write(line)
                            written += len(line.encode("utf-8"))
                    if written >= target:
                        break
                if written >= target:
                    break
    os.replace(path + ".tmp", path)


def ceiling(corpus: str, tokenizer_dir: str) -> dict:
    """Bare encode speed: texts already in memory, one encode call per 1000 documents."""
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(os.path.join(tokenizer_dir, "tokenizer.json"))
    with open(corpus, "rb") as f:
        texts = [json.loads(line)["text"] for line in f]
    result = {}
    for method in ("encode_batch", "encode_batch_fast"):
        encode, tokens, start = getattr(tok, method), 0, time.perf_counter()
        for i in range(0, len(texts), 1000):
            tokens += sum(len(e) for e in encode(texts[i:i + 1000]))  # len(): no Python list of ids
        result[method] = {"seconds": time.perf_counter() - start, "tokens": tokens}
    return result


def run_preprocess(command: list[str], megatron: bool = False) -> dict:
    """Wall time and peak RSS of the command (Linux keeps the larger of a child's and its waited-for
    children's peaks, and a forked child starts with this process's size: keep this process small).
    Tokens: from our tool's summary line; Megatron's prints none, so from the index it wrote (the same format)."""
    start = time.perf_counter()
    env = None
    if megatron:  # its tool imports megatron.* from its source tree
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [os.path.dirname(os.path.dirname(command[1])),
                                                                        os.environ.get("PYTHONPATH")])))
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT if megatron else subprocess.DEVNULL,
                            text=True, env=env)
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - start
    if status != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{out}")
    if megatron:
        from hybridlm.data.indexed import IndexedDataset
        tokens = int(IndexedDataset(command[command.index("--output-prefix") + 1] + "_text_document").sequence_lengths.sum())
        summary = f"{tokens:,} tokens (Megatron-LM's tools/preprocess_data.py)"
    else:
        tokens = int(out.split(" documents, ")[1].split(" tokens")[0].replace(",", ""))
        summary = out.splitlines()[0]
    return {"seconds": seconds, "tokens": tokens, "peak_rss_mb": usage.ru_maxrss / 1024, "summary": summary}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workdir", default="/tmp/preprocess_bench")
    p.add_argument("--size-mb", type=float, default=220)
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    p.add_argument("--record-file", default=None, help="append one JSON record per run (the benchmark suite's)")
    p.add_argument("--megatron", default=None, help="Megatron-LM's source: time its tools/preprocess_data.py too")
    p.add_argument("--ceiling", nargs=2, metavar=("CORPUS", "TOKENIZER"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.ceiling:  # run in a child, so this process stays small and the children's peak RSS is their own
        print(json.dumps(ceiling(*args.ceiling)))
        return
    os.makedirs(args.workdir, exist_ok=True)
    corpus, tokenizer = os.path.join(args.workdir, "corpus.jsonl"), os.path.join(args.workdir, "bpe32k")
    if not os.path.exists(corpus) or os.path.getsize(corpus) < args.size_mb * 1e6:
        make_corpus(corpus, args.size_mb)
    mb = os.path.getsize(corpus) / 1e6
    with open(corpus, "rb") as f:
        docs = sum(1 for _ in f)
    if not os.path.exists(os.path.join(tokenizer, "tokenizer.json")):
        subprocess.run([sys.executable, os.path.join(ROOT, "scripts/train_tokenizer.py"), "--input", corpus, "--vocab-size", "32000",
                        "--max-documents", str(docs // 8), "--output", tokenizer], check=True)
    print(f"corpus {corpus}: {mb:.1f} MB, {docs:,} documents; load average {os.getloadavg()[0]:.2f}", flush=True)

    with open(os.path.join(tokenizer, "tokenizer.json"), encoding="utf-8") as f:
        vocab = len(json.load(f)["model"]["vocab"])
    measured = subprocess.run([sys.executable, __file__, "--ceiling", corpus, tokenizer], capture_output=True, text=True, check=True)
    base = json.loads(measured.stdout)
    data = f"byte-level BPE, vocab {vocab:,} / {mb:.0f} MB JSONL ({docs / 1e3:.1f}k docs of local source+docs)"
    records = []
    for method, r in base.items():
        records.append(script_record("python benchmarks/preprocess_bench.py", sys.argv[1:], f"{data}: bare `{method}` (ceiling)",
                                     {"MB/s": f"{mb / r['seconds']:.2f}", "M tokens/s": f"{r['tokens'] / r['seconds'] / 1e6:.2f}"}))
    tools = [("hybridlm", os.path.join(ROOT, "scripts/preprocess_data.py"), "scripts/preprocess_data.py", ["--no-progress"])]
    if args.megatron:  # the peer: its own tool, with its own tokenizer wrapper over the same tokenizer.json
        tools.append(("megatron-lm", os.path.join(args.megatron, "tools/preprocess_data.py"), "$MEGATRON_LM/tools/preprocess_data.py", []))
    for system, script, shown_script, extra in tools:
        for workers in args.workers:
            command = [sys.executable, script, "--input", corpus, "--output-prefix", os.path.join(args.workdir, f"{system}{workers}"),
                       "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", tokenizer, "--append-eod",
                       "--workers", str(workers)] + extra
            shown = (f"python {shown_script} --input corpus.jsonl --output-prefix out --tokenizer-type HuggingFaceTokenizer "
                     f"--tokenizer-model bpe32k --append-eod --workers {workers}")
            label = f"{data}: {shown_script} --workers {workers}"
            try:
                r = run_preprocess(command, megatron=system == "megatron-lm")
            except SystemExit as e:  # the peer failing leaves our runs' records standing
                if system == "hybridlm":
                    raise
                records.append(script_record(shown, [], label, {}, system=system, status="failed", error=str(e).splitlines()[-1]))
                continue
            figures = {"MB/s": f"{mb / r['seconds']:.2f}", "M tokens/s": f"{r['tokens'] / r['seconds'] / 1e6:.2f}",
                       "of bare encode_batch": f"{100 * base['encode_batch']['seconds'] / r['seconds']:.0f}%",
                       "of bare encode_batch_fast": f"{100 * base['encode_batch_fast']['seconds'] / r['seconds']:.0f}%",
                       "peak RSS": f"{r['peak_rss_mb']:.0f} MB (largest process)"}
            records.append(script_record(shown, [], label, figures, system=system))
            print(system, r["summary"], flush=True)
    for record in records:
        print(record["label"], "|", "; ".join(f"{k} {v}" for k, v in record["figures"].items()))
        if args.record_file:
            append(args.record_file, record)


if __name__ == "__main__":
    main()
