"""Chat data: rendering equals transformers' apply_chat_template, the loss mask is the prefix-render
spans, every input format reads as its messages, and bad input is one sentence naming file and line."""
from __future__ import annotations

import json
import os
import random

import numpy as np
import torch
import pytest

from chat_fixtures import KINDS, hf_tokenizer, random_conversation, tokenizer_dir, write_jsonl


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat_tokenizers")
    return {kind: tokenizer_dir(kind, root / kind) for kind in KINDS}


def _read(prefix: str):
    from hybridlm.data.chat_preprocess import manifest_path, mask_prefix
    from hybridlm.data.indexed import IndexedDataset
    tokens, mask = IndexedDataset(prefix), IndexedDataset(mask_prefix(prefix))
    with open(manifest_path(prefix)) as f:
        manifest = json.load(f)
    return [np.asarray(tokens[i]).tolist() for i in range(len(tokens))], [np.asarray(mask[i]).tolist() for i in range(len(mask))], manifest


def _preprocess(tmp_path, tokenizer, rows, **kwargs):
    from hybridlm.data.chat_preprocess import preprocess_chat
    path = write_jsonl(tmp_path / "in.jsonl", rows)
    prefix = str(tmp_path / "out" / "chat")
    preprocess_chat([path], prefix, tokenizer, progress=False, **kwargs)
    return _read(prefix)


def _prefix_render_mask(tok, messages, turns) -> list[int]:
    """The spec, in token space: assistant turn i is apply_chat_template(messages[:i+1]) minus
    apply_chat_template(messages[:i], add_generation_prompt=True)."""
    full = tok.apply_chat_template(messages, tokenize=True)["input_ids"]
    mask = [0] * len(full)
    for i in turns:
        before = tok.apply_chat_template(messages[:i], tokenize=True, add_generation_prompt=True)["input_ids"]
        upto = tok.apply_chat_template(messages[: i + 1], tokenize=True)["input_ids"]
        assert full[: len(upto)] == upto and upto[: len(before)] == before
        mask[len(before):len(upto)] = [1] * (len(upto) - len(before))
    return mask


@pytest.mark.parametrize("kind", list(KINDS))
def test_thirty_conversations_give_apply_chat_template_ids_and_prefix_render_masks(tmp_path, tokenizers, kind):
    rng = random.Random(kind)
    conversations = [random_conversation(rng) for _ in range(30)]
    ids, masks, manifest = _preprocess(tmp_path, tokenizers[kind], [{"messages": c} for c in conversations])
    tok = hf_tokenizer(tokenizers[kind])
    end_of_turn = tok.convert_tokens_to_ids(KINDS[kind]["end_of_turn"])
    assert len(ids) == 30 and manifest["kind"] == "sft" and manifest["dropped_no_loss_tokens"] == 0
    for messages, got_ids, got_mask in zip(conversations, ids, masks):
        assert got_ids == tok.apply_chat_template(messages, tokenize=True)["input_ids"]
        turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        assert got_mask == _prefix_render_mask(tok, messages, turns)
        trained = [t for t, m in zip(got_ids, got_mask) if m]
        assert trained.count(end_of_turn) == len(turns)  # each reply's end-of-turn token is trained
        if KINDS[kind]["bos"]:
            assert got_ids.count(tok.bos_token_id) == 1  # the template's BOS, not another from the tokenizer


def test_train_on_last_and_loss_false_choose_the_replies(tmp_path, tokenizers):
    tok = hf_tokenizer(tokenizers["chatml"])
    messages = random_conversation(random.Random(1), system=False, turns=3)
    flagged = [dict(m, loss=False) if i == 3 else m for i, m in enumerate(messages)]  # the second reply
    ids, masks, _ = _preprocess(tmp_path, tokenizers["chatml"], [{"messages": messages}, {"messages": flagged}], train_on="last")
    assert masks[0] == _prefix_render_mask(tok, messages, [5])
    ids, masks, _ = _preprocess(tmp_path, tokenizers["chatml"], [{"messages": flagged}])
    assert ids[0] == tok.apply_chat_template(messages, tokenize=True)["input_ids"]  # "loss" is not shown to the template
    assert masks[0] == _prefix_render_mask(tok, messages, [1, 5])


def test_sharegpt_and_alpaca_read_as_their_messages(tmp_path, tokenizers):
    tok = hf_tokenizer(tokenizers["llama3"])
    rows = [{"conversations": [{"from": "system", "value": "be brief"}, {"from": "human", "value": "hi there"},
                               {"from": "gpt", "value": "hello"}]},
            {"instruction": "add", "input": "2 and 3", "output": "5", "system": "math"}]
    expected = [[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}, {"role": "assistant", "content": "hello"}],
                [{"role": "system", "content": "math"}, {"role": "user", "content": "add\n2 and 3"}, {"role": "assistant", "content": "5"}]]
    ids, masks, _ = _preprocess(tmp_path, tokenizers["llama3"], rows)
    for messages, got_ids, got_mask in zip(expected, ids, masks):
        assert got_ids == tok.apply_chat_template(messages, tokenize=True)["input_ids"]
        assert got_mask == _prefix_render_mask(tok, messages, [2])


PAIR = {"prompt": [{"role": "user", "content": "the cat"}], "chosen": [{"role": "assistant", "content": "sat on a mat"}],
        "rejected": [{"role": "assistant", "content": "ran"}]}


@pytest.mark.parametrize("row", [
    pytest.param({"prompt": "the cat", "chosen": "sat on a mat", "rejected": "ran"}, id="strings"),
    pytest.param(PAIR, id="trl_conversational"),
    pytest.param({"chosen": PAIR["prompt"] + PAIR["chosen"], "rejected": PAIR["prompt"] + PAIR["rejected"]}, id="implicit_prompt"),
    pytest.param({"messages": PAIR["prompt"] + PAIR["chosen"], "rejected_response": "ran"}, id="ms_swift"),
])
def test_preference_formats_give_chosen_then_rejected_with_the_replies_trained(tmp_path, tokenizers, row):
    tok = hf_tokenizer(tokenizers["chatml"])
    ids, masks, manifest = _preprocess(tmp_path, tokenizers["chatml"], [row, row])
    assert manifest["kind"] == "preference" and manifest["samples"] == 2 and len(ids) == 4
    for side, got_ids, got_mask in zip(("chosen", "rejected"), ids, masks):
        messages = PAIR["prompt"] + PAIR[side]
        assert got_ids == tok.apply_chat_template(messages, tokenize=True)["input_ids"]
        assert got_mask == _prefix_render_mask(tok, messages, [len(PAIR["prompt"])])
    assert manifest["max_prompt_tokens"] == masks[0].index(1)


def test_manifest_counts_truncated_and_dropped_and_hashes_the_tokenizer(tmp_path, tokenizers):
    from hybridlm.data.chat_template import encoding_sha256, load_template
    rng = random.Random(2)
    long = random_conversation(rng, turns=4)
    no_reply = [{"role": "user", "content": "only a question"}]
    ids, masks, manifest = _preprocess(tmp_path, tokenizers["chatml"], [{"messages": long}, {"messages": no_reply}], seq_length=60)
    assert len(ids) == 1 and len(ids[0]) == 61 and manifest["truncated"] == 1 and manifest["dropped_no_loss_tokens"] == 1
    assert manifest["tokenizer"]["sha256"] == encoding_sha256(tokenizers["chatml"])
    assert manifest["template"]["sha256"] == load_template(tokenizers["chatml"]).sha256


def test_two_workers_write_what_one_writes(tmp_path, tokenizers):
    rng = random.Random(3)
    rows = [{"messages": random_conversation(rng)} for _ in range(40)]
    one = _preprocess(tmp_path / "one", tokenizers["llama3"], rows, chunk_bytes=1024)
    two = _preprocess(tmp_path / "two", tokenizers["llama3"], rows, chunk_bytes=1024, workers=2)
    assert one[:2] == two[:2]


# ---------------------------------------------------------------- refusals

REWRITES_HISTORY = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['role'] == 'assistant' and not loop.last %}"
                    "(earlier reply){% else %}{{ m['content'] }}{% endif %}<|im_end|>\n{% endfor %}"
                    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _script(argv, capsys):
    import importlib.util
    from oracle import ROOT
    spec = importlib.util.spec_from_file_location("preprocess_chat", os.path.join(ROOT, "scripts", "preprocess_chat.py"))
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    capsys.readouterr()
    code = script.main(argv)
    return code, capsys.readouterr().err.strip()


TWO_TURNS = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                          {"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}]}


@pytest.mark.parametrize("rows, extra, message", [
    pytest.param([TWO_TURNS], ["--chat-template", "REWRITES"], "in.jsonl:1: the chat template (--chat-template", id="not_prefix_consistent"),
    pytest.param([{"messages": [{"role": "user", "content": "q"}]}], [], "no example with a trained token", id="no_loss_tokens_at_all"),
    pytest.param([{"prompt": "the cat " * 20, "chosen": "a", "rejected": "b"}], ["--seq-length", "8"],
                 "in.jsonl:1: the chosen prompt is", id="dpo_prompt_longer_than_sequence"),
    pytest.param([TWO_TURNS, PAIR], [], "in.jsonl:2: a preference example among sft examples", id="mixed_kinds"),
    pytest.param([{"text": "plain"}], [], "in.jsonl:1: no 'messages'", id="unknown_format"),
    pytest.param([{"messages": [{"role": "user", "content": "q", "loss": True}]}], [], "only assistant turns are trained", id="loss_on_user"),
])
def test_bad_chat_input_is_one_sentence_and_writes_nothing(tmp_path, tokenizers, capsys, rows, extra, message):
    (tmp_path / "REWRITES").write_text(REWRITES_HISTORY)
    path = write_jsonl(tmp_path / "in.jsonl", rows)
    extra = [str(tmp_path / e) if e == "REWRITES" else e for e in extra]
    code, err = _script(["--input", path, "--output-prefix", str(tmp_path / "out" / "chat"), "--tokenizer-model",
                         tokenizers["chatml"], "--no-progress", *extra], capsys)
    assert code == 2 and err.startswith("error: ") and "\n" not in err and message in err, err
    assert not os.path.exists(tmp_path / "out") or not os.listdir(tmp_path / "out")


def test_train_on_last_accepts_a_template_that_rewrites_only_history(tmp_path, tokenizers):
    (tmp_path / "t.jinja").write_text(REWRITES_HISTORY)
    ids, masks, manifest = _preprocess(tmp_path, tokenizers["chatml"], [TWO_TURNS], chat_template=str(tmp_path / "t.jinja"),
                                       train_on="last")
    assert sum(masks[0]) > 0 and manifest["template"]["source"].startswith("--chat-template")


def test_best_fit_packing_fills_rows_as_the_quadratic_definition_does():
    from hybridlm.data.chat_dataset import pack_best_fit
    rng = np.random.RandomState(0)
    for capacity in (64, 1000):
        sizes = rng.randint(1, capacity + 1, size=300) // rng.randint(1, 6, size=300) + 1
        sizes = np.minimum(sizes, capacity)
        rows = pack_best_fit(sizes, capacity)
        assert sorted(i for row in rows for i in row) == list(range(len(sizes)))
        loads = sorted(int(sizes[row].sum()) for row in rows)
        assert loads[-1] <= capacity
        want: list[int] = []  # each item, largest first, into the open row with the least room that fits it
        for size in sorted(sizes.tolist(), reverse=True):
            fits = [r for r, load in enumerate(want) if load + size <= capacity]
            if fits:
                best = min(fits, key=lambda r: capacity - want[r])
                want[best] += size
            else:
                want.append(size)
        assert loads == sorted(want)


def test_packed_rows_carry_their_sample_starts_from_the_host(tmp_path, tokenizers):
    # The variable-length attention needs where each sample begins; the packer gives it with the
    # position ids (computed on the host), so the model does not read the device back to find it.
    from hybridlm.data.chat_dataset import ChatData, SFTRows
    from hybridlm.data.samples import micro_batches
    from hybridlm.model.attention_backends import SAMPLE_STARTS, sample_starts
    rng = np.random.RandomState(3)
    conversations = [{"messages": [{"role": "user", "content": " ".join(["a"] * rng.randint(1, 20))},
                                   {"role": "assistant", "content": " ".join(["b"] * rng.randint(1, 20))}]} for _ in range(40)]
    _preprocess(tmp_path, tokenizers["chatml"], conversations)
    rows = SFTRows(ChatData(str(tmp_path / "out" / "chat")), 128, seed=1, pad=0, packing=True)
    (tokens, positions), labels = next(micro_batches(rows, micro_batch_size=2, global_batch_size=2, dp_rank=0, dp_size=1,
                                                     device="cpu"))
    given = getattr(positions, SAMPLE_STARTS)
    flat = positions.reshape(-1)
    want = torch.tensor([i for i in range(flat.numel()) if flat[i] == 0] + [flat.numel()], dtype=torch.int32)
    assert torch.equal(given, want) and given.dtype == torch.int32
    fresh = positions.clone()  # ids without them (a pipeline stage's received copy) find the same starts
    assert not hasattr(fresh, SAMPLE_STARTS) and torch.equal(sample_starts(fresh), want)
