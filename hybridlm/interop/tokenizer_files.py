"""Tokenizer files for a Hugging Face export: the run's own tokenizer, so that
``AutoTokenizer.from_pretrained(dir)`` encodes exactly as training did.

The built-in byte tokenizer (UTF-8 bytes are ids 0..255, 256 ends a document) is rebuilt as a
byte-level BPE with no merges whose vocabulary puts each byte at its own id; a Hugging Face
tokenizer directory or GPT-2 vocab/merges files are copied.
"""
from __future__ import annotations

import os
import shutil
from typing import Optional

EOD_TOKEN = "<|endoftext|>"
HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                       "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja")


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable characters (what ByteLevel pre-tokenizers use)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def byte_tokenizer():
    """The built-in ByteTokenizer as a ``tokenizers.Tokenizer``: byte b is id b, EOD_TOKEN is 256."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    vocab = {char: byte for byte, char in _bytes_to_unicode().items()}
    vocab[EOD_TOKEN] = 256
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([EOD_TOKEN])
    return tok


def write_tokenizer(settings: dict, output: str, model_max_length: int) -> tuple[Optional[int], str]:
    """Write the run's tokenizer into ``output``; returns (its end-of-document id or None, a log line)."""
    kind = settings.get("tokenizer_type") or "ByteTokenizer"
    if kind == "ByteTokenizer":
        from transformers import PreTrainedTokenizerFast
        fast = PreTrainedTokenizerFast(tokenizer_object=byte_tokenizer(), eos_token=EOD_TOKEN, bos_token=EOD_TOKEN,
                                       unk_token=None, model_max_length=model_max_length)
        fast.save_pretrained(output)
        return 256, "tokenizer: the built-in byte tokenizer, as a byte-level BPE (byte b = id b, <|endoftext|> = 256)"
    if kind == "HuggingFaceTokenizer":
        source = settings.get("tokenizer_model")
        if not source or not os.path.exists(source):
            return None, f"tokenizer: not written, --tokenizer-model {source} of the training run is not here"
        if os.path.isdir(source):
            copied = [f for f in HF_TOKENIZER_FILES if os.path.isfile(os.path.join(source, f))]
            for name in copied:
                shutil.copy2(os.path.join(source, name), os.path.join(output, name))
        else:
            shutil.copy2(source, os.path.join(output, "tokenizer.json"))
            copied = ["tokenizer.json"]
        eod = _eod(settings)
        if "tokenizer_config.json" not in copied:
            _write_fast_config(output, eod, model_max_length)
        return eod, f"tokenizer: copied {', '.join(copied)} from {source}"
    if kind == "GPT2BPETokenizer":
        vocab, merges = settings.get("vocab_file"), settings.get("merge_file")
        if not (vocab and merges and os.path.isfile(vocab) and os.path.isfile(merges)):
            return None, f"tokenizer: not written, --vocab-file {vocab} / --merge-file {merges} of the training run are not here"
        shutil.copy2(vocab, os.path.join(output, "vocab.json"))
        shutil.copy2(merges, os.path.join(output, "merges.txt"))
        from transformers import GPT2TokenizerFast
        GPT2TokenizerFast(vocab_file=vocab, merges_file=merges, model_max_length=model_max_length).save_pretrained(output)
        return _eod(settings), f"tokenizer: GPT-2 BPE from {vocab} and {merges}"
    return None, f"tokenizer: not written, unknown --tokenizer-type {kind}"


def _eod(settings: dict) -> Optional[int]:
    from ..config import ConfigError
    from ..data.tokenizers import build_tokenizer
    try:
        return build_tokenizer(settings.get("tokenizer_type"), settings.get("tokenizer_model"),
                               settings.get("vocab_file"), settings.get("merge_file")).eod
    except ConfigError:
        return None


def _write_fast_config(output: str, eod: Optional[int], model_max_length: int) -> None:
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer.from_file(os.path.join(output, "tokenizer.json"))
    eos = tok.id_to_token(eod) if eod is not None else None
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, model_max_length=model_max_length).save_pretrained(output)
