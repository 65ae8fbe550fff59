"""Tokenizers: the three kinds behind one interface, trained and loaded offline, bad flags in one sentence."""
import json
import os
import sys

import pytest

from hybridlm.config import ConfigError
from hybridlm.data.builtin import builtin_documents
from hybridlm.data.tokenizers import ByteTokenizer, build_tokenizer, save_tokenizer, train_byte_level_bpe
from harness import run_command

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEXT = "def f(x):\n    return x ** 2  # naïve, ünïcödé, 東京\n"


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    """A tiny byte-level BPE trained on the built-in corpus, saved in all three layouts."""
    root = tmp_path_factory.mktemp("bpe")
    tok = train_byte_level_bpe(builtin_documents()[:20], vocab_size=400)
    save_tokenizer(tok, str(root / "hfdir"))
    save_tokenizer(tok, str(root / "tokenizer.json"))
    (root / "gpt2").mkdir()
    tok.model.save(str(root / "gpt2"))
    return root


def test_byte_tokenizer_is_the_default_and_round_trips():
    tok = build_tokenizer()
    assert isinstance(tok, ByteTokenizer) and tok.vocab_size == 257 and tok.eod == tok.pad == 256
    assert tok.decode(tok.encode(TEXT)) == TEXT
    assert tok.encode_batch([TEXT, "a"]) == [tok.encode(TEXT), [97]]


def test_huggingface_tokenizer_loads_from_a_json_file_or_a_directory_alike(bpe):
    from_dir = build_tokenizer("HuggingFaceTokenizer", str(bpe / "hfdir"))
    from_file = build_tokenizer("HuggingFaceTokenizer", str(bpe / "tokenizer.json"))
    assert from_dir.vocab_size == from_file.vocab_size == 400
    assert from_dir.eod == from_file.eod == from_dir.tok.token_to_id("<|endoftext|>")
    assert from_dir.pad == from_dir.eod  # no pad token: pad falls back to end-of-document
    assert from_dir.encode(TEXT) == from_file.encode(TEXT)
    assert from_dir.decode(from_dir.encode(TEXT)) == TEXT


def test_encode_batch_equals_encode_one_by_one(bpe):
    tok = build_tokenizer("HuggingFaceTokenizer", str(bpe / "hfdir"))
    texts = builtin_documents()[20:40]
    assert tok.encode_batch(texts) == [tok.encode(t) for t in texts]


def test_gpt2_bpe_from_vocab_and_merges_encodes_like_the_trained_tokenizer(bpe):
    gpt2 = build_tokenizer("GPT2BPETokenizer", vocab_file=str(bpe / "gpt2/vocab.json"), merge_file=str(bpe / "gpt2/merges.txt"))
    hf = build_tokenizer("HuggingFaceTokenizer", str(bpe / "hfdir"))
    assert gpt2.vocab_size == 400 and gpt2.eod == gpt2.pad == hf.eod
    assert gpt2.encode(TEXT) == hf.encode(TEXT) and gpt2.decode(gpt2.encode(TEXT)) == TEXT


def test_a_directory_with_gpt2_files_loads_as_a_huggingface_tokenizer(bpe):
    tok = build_tokenizer("HuggingFaceTokenizer", str(bpe / "gpt2"))
    assert tok.vocab_size == 400 and tok.decode(tok.encode(TEXT)) == TEXT


def test_eos_and_pad_come_from_tokenizer_config(bpe, tmp_path):
    tok = train_byte_level_bpe(["some text " * 50], vocab_size=300, eod_token="</s>")
    tok.add_special_tokens(["<pad>"])
    save_tokenizer(tok, str(tmp_path / "t"), eod_token="</s>")
    loaded = build_tokenizer("HuggingFaceTokenizer", str(tmp_path / "t"))
    assert loaded.eod == loaded.tok.token_to_id("</s>") and loaded.pad == loaded.tok.token_to_id("<pad>")


@pytest.mark.parametrize("args, message", [
    (("Sentencepiece",), r"--tokenizer-type Sentencepiece: unknown"),
    (("HuggingFaceTokenizer",), r"needs --tokenizer-model"),
    (("HuggingFaceTokenizer", "/no/such/tokenizer"), r"--tokenizer-model /no/such/tokenizer: no such file"),
    (("GPT2BPETokenizer", None, "/no/vocab.json", "/no/merges.txt"), r"--vocab-file /no/vocab.json: no such file"),
    (("GPT2BPETokenizer", None, None, None), r"needs --vocab-file"),
])
def test_bad_tokenizer_flags_raise_one_sentence_naming_the_flag(args, message):
    with pytest.raises(ConfigError, match=message):
        build_tokenizer(*args)


def test_unreadable_or_incomplete_tokenizer_files_are_named(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ConfigError, match=r"tokenizer\.json: not a readable Hugging Face tokenizer\.json"):
        build_tokenizer("HuggingFaceTokenizer", str(tmp_path / "tokenizer.json"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="holds neither tokenizer.json nor vocab.json"):
        build_tokenizer("HuggingFaceTokenizer", str(tmp_path / "empty"))
    (tmp_path / "vocab.json").write_text(json.dumps({"a": 0, "b": 1, "ab": 2}))
    (tmp_path / "merges.txt").write_text("#version: 0.2\na b\n")
    with pytest.raises(ConfigError, match=r"has no <\|endoftext\|> token"):
        build_tokenizer("GPT2BPETokenizer", vocab_file=str(tmp_path / "vocab.json"), merge_file=str(tmp_path / "merges.txt"))


def test_train_tokenizer_script_writes_a_loadable_tokenizer(tmp_path):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"text": d}) + "\n" for d in builtin_documents()[:10]))
    done = run_command([sys.executable, os.path.join(ROOT, "scripts", "train_tokenizer.py"), "--input", str(corpus),
                           "--vocab-size", "300", "--output", str(tmp_path / "tok")], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "--tokenizer-model" in done.stdout
    tok = build_tokenizer("HuggingFaceTokenizer", str(tmp_path / "tok"))
    assert tok.vocab_size == 300 and tok.decode(tok.encode(TEXT)) == TEXT
