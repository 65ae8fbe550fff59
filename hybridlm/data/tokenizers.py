"""Tokenizers behind one small interface: vocab_size, eod, pad, encode, encode_batch, decode.

Named as Megatron-LM names them so its recipes carry over:

* ``ByteTokenizer`` (the default): UTF-8 bytes plus one end-of-document id; needs no file.
* ``HuggingFaceTokenizer``: a ``tokenizer.json`` file, or a local Hugging Face tokenizer
  directory holding one. Loaded with the Rust ``tokenizers`` library only, offline, so the
  batch encoder runs on all cores without the Python ``transformers`` layer in between.
* ``GPT2BPETokenizer``: GPT-2 byte-level BPE from ``vocab.json`` + ``merges.txt``.
* ``Llama2Tokenizer``: a SentencePiece ``.model`` file, encoded as Megatron-LM's
  SentencePiece tokenizer does (megatron/core/tokenizers/text/libraries/sentencepiece_tokenizer.py):
  SentencePiece's own ids, no BOS, the model's ``</s>`` as end of document.
* ``NullTokenizer``: no text at all, for ``--mock-data``: ids 0..--vocab-size-1, the last one
  ending a document (megatron/core/tokenizers/text/libraries/null_tokenizer.py).

Every failure to load says which flag and which path in one sentence (``ConfigError``),
because a tokenizer problem found at step 0 of a 1000-GPU job should read like a typo,
not like a Rust panic.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Optional, Protocol, Sequence

from ..config import ConfigError
from . import builtin

TOKENIZER_TYPES = ("ByteTokenizer", "HuggingFaceTokenizer", "GPT2BPETokenizer", "Llama2Tokenizer", "NullTokenizer")
# which tokenizer types read which file flags (the others would silently ignore them)
_READS = {"--vocab-file": ("GPT2BPETokenizer",), "--merge-file": ("GPT2BPETokenizer",),
          "--tokenizer-model": ("HuggingFaceTokenizer", "Llama2Tokenizer")}

# Names an end-of-document token goes by, most common first (GPT-2/NeoX, Llama 3, Llama 2/Mistral, Gemma).
_EOD_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>")
_PAD_NAMES = ("<pad>", "[PAD]", "<|padding|>", "<|pad|>")


class Tokenizer(Protocol):
    vocab_size: int  # ids are in [0, vocab_size); the model pads this further for TP
    eod: int  # appended after each document with --append-eod; separates documents in samples
    pad: int  # fills positions that carry no token (equals eod when the tokenizer has no pad)

    def encode(self, text: str) -> list[int]: ...
    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]: ...
    def decode(self, ids: Sequence[int]) -> str: ...


class ByteTokenizer(builtin.ByteTokenizer):
    """The built-in byte tokenizer, with the rest of the interface (pad, encode_batch)."""
    pad = builtin.ByteTokenizer.eod

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]


class HFTokenizer:
    """A ``tokenizers.Tokenizer`` with eod/pad resolved; the base of both file-based kinds."""

    def __init__(self, tok, eod: int, pad: int, add_special_tokens: bool = True):
        tok.no_truncation()  # a tokenizer.json saved with truncation/padding would cut documents
        tok.no_padding()
        self.tok, self.eod, self.pad = tok, eod, pad
        self.add_special_tokens = add_special_tokens
        self.vocab_size = max(tok.get_vocab_size(with_added_tokens=True), max(tok.get_vocab().values()) + 1)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=self.add_special_tokens).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Encodes on all cores (the library's Rust thread pool); offsets are not computed (tokenizers >= 0.20)."""
        encode = getattr(self.tok, "encode_batch_fast", self.tok.encode_batch)
        return [e.ids for e in encode(list(texts), add_special_tokens=self.add_special_tokens)]

    def decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=False)


def _special_id(tok, config: dict, key: str, names: Sequence[str]) -> Optional[int]:
    """The id of ``config[key]`` (tokenizer_config.json), else of the first known name in the vocabulary."""
    value = config.get(key)
    if isinstance(value, dict):
        value = value.get("content")
    for name in ([value] if isinstance(value, str) else []) + list(names):
        token_id = tok.token_to_id(name)
        if token_id is not None:
            return token_id
    return None


def _load_tokenizer_json(path: str, flag: str):
    from tokenizers import Tokenizer as RustTokenizer
    try:
        return RustTokenizer.from_file(path)
    except Exception as e:  # the Rust error text is long and names no flag
        raise ConfigError(f"{flag} {path}: not a readable Hugging Face tokenizer.json ({str(e).splitlines()[0][:200]}).") from None


def load_huggingface_tokenizer(path: str, flag: str = "--tokenizer-model") -> HFTokenizer:
    """A ``tokenizer.json`` file, or a directory with ``tokenizer.json`` (+ optional
    ``tokenizer_config.json`` naming eos/pad), or a directory with GPT-2 style
    ``vocab.json`` + ``merges.txt``. Never touches the network."""
    if not os.path.exists(path):
        raise ConfigError(f"{flag} {path}: no such file or directory.")
    directory = path if os.path.isdir(path) else os.path.dirname(path)
    config = {}
    config_path = os.path.join(directory, "tokenizer_config.json")
    if os.path.isfile(config_path):
        try:
            with open(config_path, encoding="utf-8") as f:
                config = json.load(f)
        except (OSError, ValueError) as e:
            raise ConfigError(f"{flag} {path}: {config_path} is not valid JSON ({e}).") from None
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, "tokenizer.json")):
            tok = _load_tokenizer_json(os.path.join(path, "tokenizer.json"), flag)
        elif os.path.isfile(os.path.join(path, "vocab.json")) and os.path.isfile(os.path.join(path, "merges.txt")):
            return load_gpt2_bpe(os.path.join(path, "vocab.json"), os.path.join(path, "merges.txt"))
        else:
            raise ConfigError(f"{flag} {path}: the directory holds neither tokenizer.json nor vocab.json + merges.txt "
                              "(only fast Hugging Face tokenizers are supported).")
    else:
        tok = _load_tokenizer_json(path, flag)
    eod = _special_id(tok, config, "eos_token", _EOD_NAMES)
    if eod is None:
        raise ConfigError(f"{flag} {path}: the tokenizer has no end-of-document token (none of eos_token, "
                          f"{', '.join(_EOD_NAMES)}); add one when training it.")
    pad = _special_id(tok, config, "pad_token", _PAD_NAMES)
    return HFTokenizer(tok, eod=eod, pad=eod if pad is None else pad)


def load_gpt2_bpe(vocab_file: Optional[str], merge_file: Optional[str]) -> HFTokenizer:
    """GPT-2's byte-level BPE, as Megatron's GPT2BPETokenizer: eod = ``<|endoftext|>``, pad = eod,
    and a literal ``<|endoftext|>`` inside a document is encoded as ordinary text."""
    from tokenizers import Tokenizer as RustTokenizer, decoders, models, pre_tokenizers
    for flag, p in (("--vocab-file", vocab_file), ("--merge-file", merge_file)):
        if p is None:
            raise ConfigError(f"GPT2BPETokenizer needs {flag}.")
        if not os.path.isfile(p):
            raise ConfigError(f"{flag} {p}: no such file.")
    try:
        model = models.BPE.from_file(vocab_file, merge_file)
    except Exception as e:
        raise ConfigError(f"--vocab-file {vocab_file} / --merge-file {merge_file}: not a GPT-2 BPE vocabulary "
                          f"({str(e).splitlines()[0][:200]}).") from None
    tok = RustTokenizer(model)
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    eod = tok.token_to_id("<|endoftext|>")
    if eod is None:
        raise ConfigError(f"--vocab-file {vocab_file}: has no <|endoftext|> token, which GPT2BPETokenizer uses as end of document.")
    return HFTokenizer(tok, eod=eod, pad=eod, add_special_tokens=False)


class SentencePieceTokenizer:
    """Megatron-LM's ``Llama2Tokenizer``: ``SentencePieceProcessor.encode_as_ids`` on the text as
    it is (no BOS; ``--append-eod`` adds the model's end-of-sentence id, Megatron's ``eod``)."""

    def __init__(self, path: str):
        import sentencepiece
        if not os.path.isfile(path):
            raise ConfigError(f"--tokenizer-model {path}: no such file (Llama2Tokenizer reads a SentencePiece .model file).")
        self.sp = sentencepiece.SentencePieceProcessor()
        try:
            self.sp.Load(path)
        except (OSError, RuntimeError) as e:
            raise ConfigError(f"--tokenizer-model {path}: not a SentencePiece model ({str(e).splitlines()[0][:200]}).") from None
        self.vocab_size = self.sp.get_piece_size()
        self.eod = self.sp.eos_id()
        if self.eod < 0:
            raise ConfigError(f"--tokenizer-model {path}: the SentencePiece model has no end-of-sentence piece, which "
                              "Llama2Tokenizer uses to end documents.")
        self.pad = self.sp.pad_id() if self.sp.pad_id() >= 0 else self.eod

    def encode(self, text: str) -> list[int]:
        return self.sp.encode_as_ids(text)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return self.sp.encode(list(texts), out_type=int)

    def decode(self, ids: Sequence[int]) -> str:
        return self.sp.decode_ids(list(ids))


class NullTokenizer:
    """Megatron-LM's NullTokenizer: text is space-separated ids; the last id ends a document."""

    def __init__(self, vocab_size: Optional[int]):
        if vocab_size is None:
            raise ConfigError("--tokenizer-type NullTokenizer needs --vocab-size.")
        self.vocab_size = int(vocab_size)
        self.eod = self.pad = self.vocab_size - 1

    def encode(self, text: str) -> list[int]:
        return [int(x) for x in text.split()]

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: Sequence[int]) -> str:
        return " ".join(str(i) for i in ids)


@dataclass(frozen=True)
class TokenizerSpec:
    """The flags that name a tokenizer: hashable and picklable, so worker processes and
    index caches can rebuild or key on it without shipping the tokenizer itself."""
    tokenizer_type: str = "ByteTokenizer"
    tokenizer_model: Optional[str] = None
    vocab_file: Optional[str] = None
    merge_file: Optional[str] = None
    vocab_size: Optional[int] = None

    def build(self) -> Tokenizer:
        return build_tokenizer(self.tokenizer_type, self.tokenizer_model, self.vocab_file, self.merge_file, self.vocab_size)

    def flags(self) -> dict:
        """{field: value} of the flags given, files as absolute paths (recorded beside preprocessed data)."""
        files = ("tokenizer_model", "vocab_file", "merge_file")
        return {name: os.path.abspath(value) if name in files else value
                for name, value in vars(self).items() if value is not None}


def flags_text(flags: dict) -> str:
    """{"tokenizer_type": "X", ...} -> '--tokenizer-type X ...', as a user types them."""
    return " ".join(f"--{name.replace('_', '-')} {value}" for name, value in flags.items())


def build_tokenizer(tokenizer_type: str = "ByteTokenizer", tokenizer_model: Optional[str] = None,
                    vocab_file: Optional[str] = None, merge_file: Optional[str] = None,
                    vocab_size: Optional[int] = None) -> Tokenizer:
    """The tokenizer the flags name; ``ConfigError`` (one sentence naming the flag) otherwise,
    also for a file flag this tokenizer type would not read."""
    for flag, value in (("--vocab-file", vocab_file), ("--merge-file", merge_file), ("--tokenizer-model", tokenizer_model)):
        if value is not None and tokenizer_type not in _READS[flag]:
            raise ConfigError(f"{flag} is read only by --tokenizer-type {' or '.join(_READS[flag])}, and this run's is "
                              f"{tokenizer_type}; name the tokenizer type or drop {flag}.")
    if tokenizer_type == "Llama2Tokenizer":
        if tokenizer_model is None:
            raise ConfigError("--tokenizer-type Llama2Tokenizer needs --tokenizer-model (a SentencePiece .model file).")
        return SentencePieceTokenizer(tokenizer_model)
    if tokenizer_type == "NullTokenizer":
        return NullTokenizer(vocab_size)
    if tokenizer_type == "ByteTokenizer":
        return ByteTokenizer()
    if tokenizer_type == "HuggingFaceTokenizer":
        if tokenizer_model is None:
            raise ConfigError("--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model (a tokenizer.json or a tokenizer directory).")
        return load_huggingface_tokenizer(tokenizer_model)
    if tokenizer_type == "GPT2BPETokenizer":
        return load_gpt2_bpe(vocab_file, merge_file)
    raise ConfigError(f"--tokenizer-type {tokenizer_type}: unknown; choose one of {', '.join(TOKENIZER_TYPES)}.")


def train_byte_level_bpe(texts, vocab_size: int, min_frequency: int = 2, eod_token: str = "<|endoftext|>"):
    """A GPT-2-style byte-level BPE trained on an iterable of strings; every byte is in the
    initial alphabet, so no text is ever out of vocabulary. Returns a ``tokenizers.Tokenizer``
    whose end-of-document token is ``eod_token`` (a special token, never produced from text)."""
    from tokenizers import Tokenizer as RustTokenizer, decoders, models, pre_tokenizers, trainers
    if vocab_size < 257:
        raise ConfigError(f"--vocab-size {vocab_size} is too small: a byte-level BPE needs 256 byte tokens and one end-of-document token.")
    tok = RustTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=[eod_token],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def save_tokenizer(tok, output: str, eod_token: str = "<|endoftext|>") -> str:
    """``output`` ending in .json: that file; otherwise a directory with tokenizer.json and a
    tokenizer_config.json naming the eos token (what ``--tokenizer-model`` and transformers read)."""
    if output.endswith(".json"):
        os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
        tok.save(output)
        return output
    os.makedirs(output, exist_ok=True)
    tok.save(os.path.join(output, "tokenizer.json"))
    with open(os.path.join(output, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eod_token, "bos_token": eod_token,
                   "unk_token": eod_token, "model_max_length": 1 << 30}, f, indent=2)
    return output
