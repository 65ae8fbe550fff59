"""preprocess_data: JSONL in, Megatron .bin/.idx out, every document back token for token; bad input by file:line."""
import gzip
import json
import os
import sys

import numpy as np
import pytest

from hybridlm.config import ConfigError
from hybridlm.data.builtin import builtin_documents
from hybridlm.data.indexed import IndexedDataset
from hybridlm.data.preprocess import BadInputError, preprocess
from hybridlm.data.tokenizers import TokenizerSpec, build_tokenizer, save_tokenizer, train_byte_level_bpe
from harness import run_command

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = builtin_documents()[:30] + ["é", "a \u00e9 \U0001F600 emoji", "x" * 5000, "line\nbreaks\r\nand\ttabs"]


@pytest.fixture(scope="module")
def bpe_spec(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tok") / "bpe")
    save_tokenizer(train_byte_level_bpe(builtin_documents()[:20], vocab_size=400), path)
    return TokenizerSpec("HuggingFaceTokenizer", path)


def jsonl(path, docs, key="text"):
    path.write_text("".join(json.dumps({key: d, "id": i}) + "\n" for i, d in enumerate(docs)), encoding="utf-8")
    return str(path)


def read_back(prefix):
    ds = IndexedDataset(prefix)
    return [ds[i].tolist() for i in range(len(ds))]


@pytest.mark.parametrize("workers", [1, 2])
def test_documents_come_back_token_for_token_across_workers_and_chunk_boundaries(tmp_path, bpe_spec, workers):
    src = jsonl(tmp_path / "in.jsonl", DOCS)
    tok = bpe_spec.build()
    stats = preprocess([src], str(tmp_path / "out"), bpe_spec, workers=workers, append_eod=True, chunk_bytes=700, progress=False)
    assert stats.documents == len(DOCS) and stats.bad_lines == 0
    assert read_back(str(tmp_path / "out_text_document")) == [tok.encode(d) + [tok.eod] for d in DOCS]
    assert stats.tokens == sum(len(tok.encode(d)) + 1 for d in DOCS)


def test_output_is_identical_for_any_worker_count_and_chunk_size(tmp_path, bpe_spec):
    src = jsonl(tmp_path / "in.jsonl", DOCS)
    outputs = []
    for i, (workers, chunk) in enumerate([(1, 1 << 20), (1, 100), (2, 333)]):
        preprocess([src], str(tmp_path / f"o{i}"), bpe_spec, workers=workers, chunk_bytes=chunk, progress=False)
        outputs.append([open(str(tmp_path / f"o{i}_text_document") + ext, "rb").read() for ext in (".bin", ".idx")])
    assert outputs[0] == outputs[1] == outputs[2]


def test_byte_tokenizer_writes_uint16_and_a_large_vocabulary_writes_int32(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    src = jsonl(tmp_path / "in.jsonl", ["w69999 w1 w2", "w3"])
    preprocess([src], str(tmp_path / "b"), progress=False)
    assert IndexedDataset(str(tmp_path / "b_text_document")).dtype == np.uint16
    vocab = {f"w{i}": i for i in range(70000)} | {"<|endoftext|>": 70000, "[UNK]": 70001}
    big = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    big.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    big.save(str(tmp_path / "big.json"))
    preprocess([src], str(tmp_path / "w"), TokenizerSpec("HuggingFaceTokenizer", str(tmp_path / "big.json")),
               append_eod=True, progress=False)
    ds = IndexedDataset(str(tmp_path / "w_text_document"))
    assert ds.dtype == np.int32 and ds[0].tolist() == [69999, 1, 2, 70000]


def test_gzip_zstd_and_globbed_inputs_are_read_in_order(tmp_path):
    import zstandard
    (tmp_path / "a.jsonl.gz").write_bytes(gzip.compress(b'{"text": "first"}\n{"text": "second"}\n'))
    (tmp_path / "b.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(b'{"text": "third"}'))  # no final newline
    (tmp_path / "c.jsonl").write_text('{"text": "fourth"}\n')
    stats = preprocess([str(tmp_path / "*.jsonl*")], str(tmp_path / "o"), progress=False)
    assert stats.files == 3
    assert [bytes(x).decode() for x in read_back(str(tmp_path / "o_text_document"))] == ["first", "second", "third", "fourth"]


def test_a_truncated_gzip_stops_the_run_naming_the_file(tmp_path):
    data = gzip.compress(b'{"text": "a document"}\n' * 1000)
    (tmp_path / "cut.jsonl.gz").write_bytes(data[:len(data) // 2])
    with pytest.raises(BadInputError, match=r"cut\.jsonl\.gz:\d+: the compressed stream is corrupt or truncated"):
        preprocess([str(tmp_path / "cut.jsonl.gz")], str(tmp_path / "o"), progress=False)
    assert sorted(os.listdir(tmp_path)) == ["cut.jsonl.gz"]


def test_several_json_keys_write_one_aligned_dataset_each(tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text('{"q": "a", "r": "bb"}\n{"q": "ccc", "r": "d"}\n')
    stats = preprocess([str(src)], str(tmp_path / "o"), json_keys=["q", "r"], progress=False)
    assert set(stats.outputs) == {"q", "r"}
    assert read_back(str(tmp_path / "o_q_document")) == [[97], [99, 99, 99]]
    assert read_back(str(tmp_path / "o_r_document")) == [[98, 98], [100]]


BAD_LINES = [
    (b'{"text": "ok"', "malformed JSON"),
    (b'{"body": "no text key"}', "no key 'text'"),
    (b'{"text": 42}', "'text' is a JSON int, not a string"),
    (b'{"text": null}', "'text' is a JSON null, not a string"),
    (b'{"text": "caf\xe9"}', r"invalid UTF-8 \(byte 0xe9 at column 14\)"),
    (b'{"text": ""}', "empty document"),
    (b'["text", "a list"]', "a JSON list, not an object"),
    (b'{"text": "lone \\ud800 surrogate"}', "the tokenizer refused the text"),
]


@pytest.mark.parametrize("line, reason", BAD_LINES, ids=[r.split(" (")[0] for _, r in BAD_LINES])
def test_a_bad_line_stops_the_run_naming_file_and_line(tmp_path, line, reason):
    src = tmp_path / "in.jsonl"
    src.write_bytes(b'{"text": "good"}\n\n{"text": "good"}\n' + line + b'\n{"text": "good"}\n')
    with pytest.raises(BadInputError, match=rf"in\.jsonl:4: {reason}"):
        preprocess([str(src)], str(tmp_path / "o"), progress=False)
    assert sorted(os.listdir(tmp_path)) == ["in.jsonl"]  # nothing written, not even temporaries


@pytest.mark.parametrize("line, reason", BAD_LINES, ids=[r.split(" (")[0] for _, r in BAD_LINES])
def test_skip_bad_lines_skips_and_counts_them(tmp_path, line, reason):
    src = tmp_path / "in.jsonl"
    src.write_bytes(b'{"text": "good"}\n' + line + b'\n{"text": "also"}\n')
    stats = preprocess([str(src)], str(tmp_path / "o"), skip_bad_lines=True, progress=False)
    assert stats.documents == 2 and stats.bad_lines == 1
    assert stats.bad_examples[0].startswith(f"{src}:2: ")
    assert [bytes(x).decode() for x in read_back(str(tmp_path / "o_text_document"))] == ["good", "also"]


def test_empty_file_stops_the_run_or_is_skipped_and_counted(tmp_path):
    (tmp_path / "empty.jsonl").write_bytes(b"")
    good = jsonl(tmp_path / "good.jsonl", ["x"])
    with pytest.raises(BadInputError, match=r"empty\.jsonl:1: the file is empty"):
        preprocess([str(tmp_path / "empty.jsonl"), good], str(tmp_path / "o"), progress=False)
    stats = preprocess([str(tmp_path / "empty.jsonl"), good], str(tmp_path / "o"), skip_bad_lines=True, progress=False)
    assert stats.documents == 1 and stats.empty_files == [str(tmp_path / "empty.jsonl")]


def test_missing_inputs_and_unknown_tokenizer_paths_are_named(tmp_path):
    with pytest.raises(BadInputError, match=r"--input .*nope\.jsonl: no such file"):
        preprocess([str(tmp_path / "nope.jsonl")], str(tmp_path / "o"), progress=False)
    with pytest.raises(BadInputError, match=r"--input .*\*\.jsonl: the pattern matches no file"):
        preprocess([str(tmp_path / "*.jsonl")], str(tmp_path / "o"), progress=False)
    src = jsonl(tmp_path / "in.jsonl", ["x"])
    with pytest.raises(ConfigError, match=r"--tokenizer-model /no/tok: no such file"):
        preprocess([src], str(tmp_path / "o"), TokenizerSpec("HuggingFaceTokenizer", "/no/tok"), progress=False)


def test_a_failed_run_keeps_the_previous_output_whole(tmp_path):
    src = jsonl(tmp_path / "in.jsonl", ["first version"])
    preprocess([src], str(tmp_path / "o"), progress=False)
    with open(src, "a") as f:
        f.write('{"text": "second"}\n' * 200 + "not json\n")
    with pytest.raises(BadInputError, match=r"in\.jsonl:202: malformed JSON"):
        preprocess([src], str(tmp_path / "o"), chunk_bytes=64, progress=False)
    assert sorted(os.listdir(tmp_path)) == ["in.jsonl", "o_text_document.bin", "o_text_document.ids.json", "o_text_document.idx"]
    assert [bytes(x).decode() for x in read_back(str(tmp_path / "o_text_document"))] == ["first version"]


def test_script_prints_a_summary_and_exits_nonzero_with_the_sentence_on_bad_input(tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text('{"text": "hello"}\n{"text": 1}\n')
    script = [sys.executable, os.path.join(ROOT, "scripts", "preprocess_data.py"), "--input", str(src),
              "--output-prefix", str(tmp_path / "o"), "--append-eod"]
    failed = run_command(script, capture_output=True, text=True)
    assert failed.returncode == 2 and f"error: {src}:2: 'text' is a JSON int, not a string." in failed.stderr
    ok = run_command(script + ["--skip-bad-lines", "--workers", "2"], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    assert "1 documents, 6 tokens, 1 bad line(s) skipped" in ok.stdout and f"--data-path {tmp_path / 'o'}_text_document" in ok.stdout
    assert f"skipped {src}:2:" in ok.stderr and "docs/s" in ok.stderr and "MB/s" in ok.stderr
