"""Files a Megatron-LM user arrives with, made offline and small: a SentencePiece tokenizer model
(Llama 2 / Mixtral style), GPT-2 vocab.json + merges.txt, and a JSONL corpus."""
from __future__ import annotations

import json
import os

from hybridlm.data.builtin import builtin_documents


def corpus_jsonl(path: str, documents: int = 40) -> str:
    """The first ``documents`` of the built-in corpus as {"text": ...} lines."""
    with open(path, "w", encoding="utf-8") as f:
        for text in builtin_documents()[:documents]:
            f.write(json.dumps({"text": text}) + "\n")
    return path


def sentencepiece_model(directory: str, vocab_size: int = 500) -> str:
    """A BPE SentencePiece model with Llama's special ids (<unk> 0, <s> 1, </s> 2), trained with
    sentencepiece's own trainer on the built-in corpus; returns the .model path."""
    import sentencepiece
    prefix = os.path.join(directory, "tokenizer")
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(builtin_documents()[:30]), model_prefix=prefix, vocab_size=vocab_size, model_type="bpe",
        unk_id=0, bos_id=1, eos_id=2, pad_id=-1, num_threads=1, minloglevel=2, max_sentence_length=1 << 20)
    return prefix + ".model"


def gpt2_vocab_and_merges(directory: str, vocab_size: int = 400) -> tuple[str, str]:
    """GPT-2-style byte-level BPE files (vocab.json, merges.txt) trained on the built-in corpus."""
    from hybridlm.data.tokenizers import train_byte_level_bpe
    tok = train_byte_level_bpe(builtin_documents()[:20], vocab_size=vocab_size)
    tok.model.save(directory)
    return os.path.join(directory, "vocab.json"), os.path.join(directory, "merges.txt")
