"""Megatron-LM's flags here: each accepted with Megatron's meaning, or refused in one sentence
before any process group (hybridlm/config/megatron.py is the table)."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from harness import run_command, run_ranks
from hybridlm.config import ConfigError, build_parser, megatron, parse_args
from hybridlm.presets import LLAMA_BLOCK
from megatron_files import corpus_jsonl, gpt2_vocab_and_merges, sentencepiece_model
from oracle import ROOT, TINY, assert_matches, ds_config, train_and_probe

SMALL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32", "--vocab-size", "512"]


def _refusal(argv: list[str], world: int = 1) -> str:
    from hybridlm.training.trainer import prepare_config
    with pytest.raises(ConfigError) as caught:
        prepare_config(parse_args(argv), world_size=world)
    return str(caught.value)


# ---------------------------------------------------------------- the table

@pytest.mark.parametrize("entry", megatron.REFUSED, ids=lambda e: e.flag)
def test_each_refused_flag_is_one_sentence_naming_it_and_what_to_use(entry):
    argv = [entry.flag] + (["1"] if entry.takes_value else [])
    message = _refusal(argv)
    assert message.startswith(entry.flag) and message.endswith(".") and "\n" not in message
    assert any(word in message for word in ("use", "drop", "give", "set")), message


@pytest.mark.parametrize("entry", [e for e in megatron.IGNORED if e.flag != "--no-position-embedding"], ids=lambda e: e.flag)
def test_each_ignored_flag_is_accepted_and_the_run_log_says_why(entry):
    argv = [entry.flag] + ([entry.accepts[0] if entry.accepts else "v2"] if entry.takes_value else [])
    cfg = parse_args(argv)
    assert any(line.startswith(f"{entry.flag}: accepted and ignored") for line in cfg.notes)
    assert cfg.to_dict() == parse_args([]).to_dict(), f"{entry.flag} changed a setting"


def test_help_says_which_flags_are_ignored_and_which_refused():
    text = build_parser().format_help()
    assert "Accepted and ignored: Megatron-LM ignores it too" in text
    assert "Refused: --tp-comm-overlap" in text


@pytest.mark.parametrize("alias", megatron.ALIASES, ids=lambda a: a.flag)
def test_each_alias_sets_what_the_flag_it_names_sets(alias):
    value = "x" if alias.const is megatron._VALUE else None
    ours = "--" + alias.field.replace("_", "-")
    if isinstance(alias.const, bool):
        canonical = [ours if alias.const else "--no-" + ours[2:]]
    else:
        canonical = [ours, value or str(alias.const)]
    got = parse_args([alias.flag] + ([value] if value else []))
    assert got.to_dict() == parse_args(canonical).to_dict()


def test_declared_aliases_are_honoured():
    assert parse_args(["--external-cuda-graph"]).model.cuda_graphs
    assert parse_args(["--deepspeed-config", "x.json"]).train.deepspeed_config == "x.json"


def test_megatron_value_names_map_onto_ours():
    assert parse_args(["--attention-backend", "fused"]).model.attention_backend == "cudnn"
    assert parse_args(["--attention-backend", "unfused"]).model.attention_backend == "sdpa"
    assert parse_args(["--fp8-recipe", "tensorwise"]).model.fp8_recipe == "current"
    assert parse_args(["--lr-decay-style", "WSD"]).train.lr_decay_style == "WSD"


def test_no_position_embedding_is_a_no_op_with_rope_and_refused_without():
    assert parse_args(["--no-position-embedding"]).model.position_embedding_type == "rope"  # the tiny run
    assert "use --position-embedding-type rope" in _refusal(SMALL + ["--no-position-embedding"])


def test_dataloader_type_single_is_accepted_and_cyclic_refused():
    parse_args(["--dataloader-type", "single"])
    assert "--dataloader-type cyclic" in _refusal(["--dataloader-type", "cyclic"])


@pytest.mark.parametrize("argv, sentence", [
    (["--use-distributed-optimizer", *ds_config("zero0")], "has ZeRO stage 0; use ds_configs/zero1.json"),
    (["--overlap-param-gather", "--overlap-grad-reduce"], "--overlap-param-gather needs --use-distributed-optimizer"),
    (["--rotary-percent", "0.5"], "--rotary-percent 0.5: hybridlm applies RoPE to the whole head dimension"),
    (["--num-experts", "4", "--moe-token-dispatcher-type", "flex"], "flex selects Megatron's DeepEP"),
    (["--fp8-param-gather"], "--fp8-param-gather needs --fp8-format"),
    (["--profile", "--profile-step-range", "1,2"], "--profile cannot be combined with --profile-step-range"),
    (["--recompute-method", "uniform"], "--recompute-method needs --recompute-granularity full"),
    (["--recompute-granularity", "full", "--recompute-method", "block"], "needs --recompute-num-layers"),
])
def test_mapped_flags_refuse_what_cannot_hold(argv, sentence):
    assert sentence in _refusal(argv)


def test_distributed_optimizer_and_overlap_map_onto_zero_and_overlap_comm():
    from hybridlm.training.trainer import prepare_config
    cfg, ds = prepare_config(parse_args(["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"]),
                             world_size=1)
    assert ds["zero_optimization"]["overlap_comm"] is True
    assert any("ZeRO stage 1" in n for n in cfg.notes) and any("no effect with ZeRO stage 1" in n for n in cfg.notes)
    _, plain = prepare_config(parse_args([]), world_size=1)
    assert plain["zero_optimization"]["overlap_comm"] is False  # zero1.json says "auto": Megatron's default, off
    piped, _ = prepare_config(parse_args(["--overlap-grad-reduce", "--pipeline-model-parallel-size", "2"]), world_size=2)
    assert any("DeepSpeed's pipeline engine turns overlap_comm off" in n for n in piped.notes)


def test_profile_flags_map_onto_the_profile_window():
    cfg = parse_args(["--profile", "--profile-step-start", "4", "--profile-step-end", "6"]).validate(1)
    assert cfg.train.profile_step_range == "4,6"


def test_ckpt_format_torch_dist_is_accepted_with_a_log_line():
    cfg = parse_args(["--ckpt-format", "torch_dist"]).validate(1)
    assert any(n.startswith("--ckpt-format torch_dist: checkpoints are DeepSpeed's") for n in cfg.notes)


# ---------------------------------------------------------------- schedule flags

def test_sample_based_schedule_counts_as_megatron():
    from test_schedule import megatron_get_lr

    from hybridlm.training.optim import WarmupDecayLR
    cfg = parse_args(["--global-batch-size", "8", "--train-samples", "100", "--lr-decay-samples", "90",
                      "--lr-warmup-samples", "13", "--lr-warmup-init", "1e-4", "--lr", "1e-3", "--min-lr", "1e-5",
                      "--lr-decay-style", "cosine"]).validate(1)
    assert cfg.train.train_iters == 12  # 100 // 8, as Megatron's update_train_iters
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)
    schedule = WarmupDecayLR.from_config(optimizer, cfg.train)
    want = [megatron_get_lr(i * 8, init_lr=1e-4, max_lr=1e-3, min_lr=1e-5, warmup=13, decay=90, style="cosine")
            for i in range(12)]
    assert [schedule.lr_at(i) for i in range(12)] == pytest.approx(want, rel=1e-12)


def test_warmup_fraction_is_of_the_decay():
    cfg = parse_args(["--global-batch-size", "8", "--train-iters", "100", "--lr-decay-iters", "80", "--min-lr", "1e-5",
                      "--lr-warmup-fraction", "0.05"]).validate(1)
    assert cfg.train.schedule_in_samples()[:2] == (0.05 * 80 * 8, 80 * 8)


@pytest.mark.parametrize("argv, sentence", [
    (["--train-samples", "64", "--lr-decay-iters", "4"], "--lr-decay-iters; use --lr-decay-samples"),
    (["--train-samples", "64", "--train-iters", "3"], "--train-iters 3 (give one of them"),
    (["--lr-decay-samples", "64"], "--lr-decay-samples needs --train-samples"),
    (["--lr-warmup-fraction", "0.1", "--lr-warmup-iters", "2"], "--lr-warmup-fraction cannot be combined"),
    (["--train-iters", "10", "--lr-warmup-iters", "10"], "must end before the decay"),
])
def test_schedule_flags_refuse_what_megatron_refuses(argv, sentence):
    assert sentence in _refusal(argv)


def test_decoupled_lr_gives_embedding_and_output_their_own_rate_on_the_same_schedule():
    from hybridlm.model.specs import build_model
    from hybridlm.parallel.plan import LayerFactory
    from hybridlm.training.optim import WarmupDecayLR, param_groups
    cfg = parse_args(SMALL + ["--untie-embeddings-and-output-weights", "--train-iters", "10", "--lr", "1e-3",
                              "--min-lr", "1e-4", "--decoupled-lr", "5e-4", "--decoupled-min-lr", "4.5e-5"]).validate(1)
    cfg.model.padded_vocab_size = 512
    model = build_model(cfg.model, LayerFactory())
    groups = param_groups(model, 0.1, cfg.train.decoupled_lr, cfg.train.decoupled_min_lr)
    decoupled = next(g for g in groups if g["name"] == "decoupled_lr")
    assert {id(p) for p in decoupled["params"]} == {id(model.forward_funcs[0].word_embeddings.weight),
                                                     id(model.forward_funcs[-1].linear.weight)}
    optimizer = torch.optim.AdamW(groups)
    schedule = WarmupDecayLR.from_config(optimizer, cfg.train)
    for _ in range(5):
        schedule.step()
    by_name = {g["name"]: g["lr"] for g in optimizer.param_groups}
    assert by_name["decay"] == pytest.approx(schedule.rate(5 * cfg.train.global_batch_size))
    assert by_name["decoupled_lr"] == pytest.approx(schedule.rate(5 * cfg.train.global_batch_size, 5e-4, 4.5e-5))


# ---------------------------------------------------------------- model flags

def test_uniform_recompute_checkpoints_groups_of_layers_and_block_the_first_layers():
    from hybridlm.model.execution import apply_recompute
    from hybridlm.model.specs import build_model
    from hybridlm.model.weights import init_parameters
    from hybridlm.parallel.plan import LayerFactory
    from hybridlm.parallel.state import SINGLE
    calls = []

    def counting_checkpoint(function, x):
        calls.append(function)
        return function(x)
    cfg = parse_args(SMALL + ["--num-layers", "5", *LLAMA_BLOCK]).model
    cfg.padded_vocab_size = 512
    tokens = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(0))
    losses = {}
    for method, n, units in ((None, None, 0), ("uniform", 2, 3), ("block", 2, 2), ("uniform", 1, 5)):
        torch.manual_seed(0)
        model = build_model(cfg, LayerFactory())
        init_parameters(model, 5, SINGLE)
        if method:
            assert apply_recompute(model, n, method, checkpoint=counting_checkpoint) == units
        calls.clear()
        losses[method, n] = model(tokens, tokens).item()
        assert len(calls) == units
    assert len(set(losses.values())) == 1, f"recompute changed the function: {losses}"


def test_uniform_recompute_trains_as_without_recompute():
    plain = run_ranks(1, train_and_probe, TINY + ds_config("zero0"))[0]
    uniform = run_ranks(1, train_and_probe, TINY + ds_config("zero0") + ["--recompute-granularity", "full",
                                                                           "--recompute-method", "uniform",
                                                                           "--recompute-num-layers", "2"])[0]
    assert_matches(plain, uniform)


@pytest.mark.parametrize("normalization", ["RMSNorm", "LayerNorm"])
def test_layernorm_1p_is_the_same_function_with_the_gain_minus_one(normalization):
    from hybridlm.interop.hf_names import LLAMA, parameter_rules
    from hybridlm.model.specs import build_model
    from hybridlm.parallel.plan import LayerFactory
    flags = SMALL + [*LLAMA_BLOCK, "--normalization", normalization]
    plain, one_p = parse_args(flags).model, parse_args(flags + ["--apply-layernorm-1p"]).model
    plain.padded_vocab_size = one_p.padded_vocab_size = 512
    torch.manual_seed(0)
    a = build_model(plain, LayerFactory())
    b = build_model(one_p, LayerFactory())
    with torch.no_grad():
        for (name, p), q in zip(a.named_parameters(), b.parameters()):
            p.normal_(0.0, 0.1)
            q.copy_(p - 1 if name.endswith("norm.weight") else p)
    tokens = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(0))
    assert torch.allclose(a(tokens, tokens), b(tokens, tokens), rtol=1e-6, atol=1e-6)
    if normalization == "RMSNorm":
        rule = parameter_rules(LLAMA, one_p, ["1.input_norm.weight"])["1.input_norm.weight"]
        assert torch.equal(rule.split(torch.zeros(3))[0], torch.ones(3))  # Hugging Face gets the gain


def test_load_balancing_none_drops_the_aux_loss_whatever_its_coefficient():
    from test_moe import _naive_moe, _tiny_layer
    layer = _tiny_layer(moe_router_load_balancing_type="none")  # --moe-aux-loss-coeff 0.1 there
    x = torch.randn(5, 3, 16, generator=torch.Generator().manual_seed(0))
    layer(x).sum().backward()
    params = [p.detach().clone().requires_grad_() for p in (layer.router.weight, layer.w1, layer.w2)]
    y_ref, aux_ref = _naive_moe(x, *params, k=2, aux_coeff=0.0, z_coeff=0.01)
    (y_ref.sum() + aux_ref).backward()
    assert torch.allclose(layer.router.weight.grad, params[0].grad, rtol=1e-4, atol=1e-6)


# ---------------------------------------------------------------- tokenizers and data

@pytest.fixture(scope="module")
def sp_model(tmp_path_factory):
    return sentencepiece_model(str(tmp_path_factory.mktemp("sp")))


def test_llama2_tokenizer_ids_are_sentencepieces_plus_megatrons_end_of_document(sp_model, tmp_path):
    import sentencepiece

    from hybridlm.data.indexed import IndexedDataset
    from hybridlm.data.tokenizers import build_tokenizer
    sp = sentencepiece.SentencePieceProcessor()
    sp.Load(sp_model)
    tok = build_tokenizer("Llama2Tokenizer", sp_model)
    text = "The   walrus operator := binds names.\n  Indented  line."
    assert tok.encode(text) == sp.encode_as_ids(text)  # no BOS, as Megatron-LM's SentencePiece tokenizer
    assert (tok.vocab_size, tok.eod) == (sp.get_piece_size(), sp.eos_id())
    corpus = corpus_jsonl(str(tmp_path / "c.jsonl"), documents=3)
    prefix = str(tmp_path / "sp")
    run_command([sys.executable, os.path.join(ROOT, "scripts/preprocess_data.py"), "--input", corpus, "--output-prefix",
                    prefix, "--tokenizer-type", "Llama2Tokenizer", "--tokenizer-model", sp_model, "--append-eod",
                    "--workers", "1", "--no-progress"], check=True, capture_output=True)
    import json
    written = IndexedDataset(prefix + "_text_document")
    for i, line in enumerate(open(corpus)):
        assert list(written.get(i)) == sp.encode_as_ids(json.loads(line)["text"]) + [sp.eos_id()]


def test_file_flags_the_tokenizer_would_not_read_are_refused():
    assert "--vocab-file is read only by --tokenizer-type GPT2BPETokenizer, and this run's is ByteTokenizer" in \
        _refusal(["--vocab-file", "gpt2-vocab.json", "--merge-file", "gpt2-merges.txt"])


def test_gpt2_bpe_files_train_through_the_megatron_flags(tmp_path):
    vocab, merges = gpt2_vocab_and_merges(str(tmp_path))
    corpus = corpus_jsonl(str(tmp_path / "c.jsonl"), documents=10)
    run_command([sys.executable, os.path.join(ROOT, "scripts/preprocess_data.py"), "--input", corpus, "--output-prefix",
                    str(tmp_path / "gpt"), "--vocab-file", vocab, "--tokenizer-type", "GPT2BPETokenizer", "--merge-file",
                    merges, "--append-eod", "--workers", "1", "--no-progress"], check=True, capture_output=True)
    from hybridlm.training.trainer import prepare_config
    cfg, _ = prepare_config(parse_args(SMALL[:-2] + ["--data-path", str(tmp_path / "gpt_text_document"), "--vocab-file", vocab,
                                                     "--merge-file", merges, "--tokenizer-type", "GPT2BPETokenizer"]), 1)
    assert cfg.model.vocab_size == 400


def megatron_mock_document(idx, vocab_size, eod):
    """megatron/core/datasets/gpt_dataset.py MockGPTLowLevelDataset.__getitem__, transcribed."""
    rng = np.random.default_rng(seed=0)
    lengths = rng.integers(low=1, high=4096, size=100000, dtype=np.int32)
    length = lengths[idx]
    return np.int64(np.concatenate([(np.arange(length - 1) + 1) % vocab_size, [eod]]))


def test_mock_documents_are_megatrons():
    from hybridlm.data.mock import MockDocuments
    from hybridlm.data.tokenizers import build_tokenizer
    tok = build_tokenizer("NullTokenizer", vocab_size=300)
    assert (tok.vocab_size, tok.eod) == (300, 299)  # megatron/core/tokenizers/.../null_tokenizer.py
    mock = MockDocuments(tok.vocab_size, tok.eod)
    for idx in (0, 1, 12345, 99999):
        assert np.array_equal(mock.get(idx), megatron_mock_document(idx, 300, 299))
        assert np.array_equal(mock.get(idx, 3, 5), megatron_mock_document(idx, 300, 299)[3:8])


def test_split_tolerates_a_launch_scripts_literal_quotes():
    from hybridlm.data.gpt_dataset import parse_split
    assert parse_split("'99,1,0'") == parse_split("99,1,0")


# ---------------------------------------------------------------- preprocess_data.py

def _preprocess(tmp_path, *extra) -> subprocess.CompletedProcess:
    corpus = corpus_jsonl(str(tmp_path / "c.jsonl"), documents=4)
    return run_command([sys.executable, os.path.join(ROOT, "scripts/preprocess_data.py"), "--input", corpus,
                           "--output-prefix", str(tmp_path / "out"), "--workers", "2", "--no-progress", *extra],
                          capture_output=True, text=True)


@pytest.mark.parametrize("extra, sentence", [
    (["--split-sentences"], "error: --split-sentences prepares BERT sentence pairs"),
    (["--partitions", "2"], "error: --partitions 2 without --keep-sequential-samples reorders the documents"),
    (["--find-optimal-num-workers"], "error: --find-optimal-num-workers is not implemented; set --workers."),
])
def test_preprocess_refuses_what_cannot_apply_in_one_sentence(tmp_path, extra, sentence):
    result = _preprocess(tmp_path, *extra)
    lines = result.stderr.strip().splitlines()
    assert result.returncode != 0 and len(lines) == 1 and lines[0].startswith(sentence), result.stderr
    assert not os.path.exists(tmp_path / "out_text_document.bin")


def test_preprocess_accepts_megatrons_partitions_with_sequential_samples_and_log_interval(tmp_path):
    result = _preprocess(tmp_path, "--partitions", "2", "--keep-sequential-samples", "--log-interval", "100")
    assert result.returncode == 0, result.stderr
    assert "--partitions: accepted and ignored" in result.stderr


# ---------------------------------------------------------------- training-loop flags

def _main(argv):
    from test_bad_input import _main_on_rank_after_setup
    return _main_on_rank_after_setup(argv)


@pytest.mark.parametrize("flag, stopped_at", [(["--exit-interval", "2"], 2), (["--exit-duration-in-mins", "0"], 1)])
def test_exit_interval_and_duration_save_and_end_the_run_cleanly(tmp_path, flag, stopped_at):
    flags = TINY + ds_config("zero1") + ["--train-iters", "6", "--save", str(tmp_path)] + flag
    results = run_ranks(2, _main, flags)
    assert [code for code, _ in results] == [0, 0], results[0][1][-2000:]
    assert (tmp_path / "latest").read_text() == f"global_step{stopped_at}"


def _resumed(flags: list[str]) -> dict:
    from hybridlm.training.trainer import build_run, prepare_config
    cfg, ds = prepare_config(parse_args(flags))
    run = build_run(cfg, ds)
    optimizer = run.engine.optimizer
    from hybridlm.training.checkpoint import rng_state
    streams = rng_state()
    return {"iteration": run.iteration, "schedule_samples": run.engine.lr_scheduler.num_steps, "lr": run.engine.get_lr()[0],
            "adam_state": sum(len(s) for s in optimizer.state.values()),
            "rng": torch.cat([streams["torch"], *[t.flatten() for t in streams["tracker"].values()]]),
            "weight": run.engine.module.forward_funcs[1].attention.qkv.weight.detach().clone()}


def test_no_load_optim_keeps_weights_and_iteration_and_starts_optimizer_and_schedule_afresh(tmp_path):
    base = TINY + ds_config("zero0") + ["--lr-warmup-iters", "2", "--lr-decay-iters", "8", "--hidden-dropout", "0.1",
                                         "--save", str(tmp_path)]
    run_ranks(1, _main, base + ["--train-iters", "3"])
    resume = base + ["--load", str(tmp_path), "--train-iters", "6"]
    kept = run_ranks(1, _resumed, resume)[0]
    assert (kept["iteration"], kept["schedule_samples"], kept["adam_state"] > 0) == (3, 3 * 8, True)
    fresh = run_ranks(1, _resumed, resume + ["--no-load-optim"])[0]
    assert (fresh["iteration"], fresh["schedule_samples"], fresh["lr"], fresh["adam_state"]) == (3, 0, 0.0, 0)
    assert torch.equal(fresh["weight"], kept["weight"])
    assert torch.equal(fresh["rng"], kept["rng"]), "--no-load-optim alone still restores the random streams"
    unseeded = run_ranks(1, _resumed, resume + ["--no-load-rng"])[0]
    seeded = run_ranks(1, _resumed, TINY + ds_config("zero0") + ["--hidden-dropout", "0.1"])[0]
    assert torch.equal(unseeded["rng"], seeded["rng"]) and not torch.equal(unseeded["rng"], kept["rng"])


def _valid_losses_and_by_hand(flags: list[str]) -> tuple[list[float], list[float]]:
    from hybridlm.training.trainer import build_run, data_iterator, pretrain, prepare_config
    logged = [r["valid_loss"] for r in pretrain(flags) if "valid_loss" in r]
    cfg, ds = prepare_config(parse_args(flags))
    run = build_run(cfg, ds)
    model = run.engine.module.eval()
    by_hand = []
    for evaluation in range(len(logged)):
        batches = data_iterator(run, run.valid_data, start_iteration=evaluation * cfg.train.eval_iters)
        steps = cfg.train.eval_iters * cfg.gradient_accumulation_steps
        with torch.no_grad():
            by_hand.append(sum(model(*next(batches)).item() for _ in range(steps)) / steps)
    return logged, by_hand


def test_each_evaluation_draws_fresh_validation_batches_as_megatron():
    frozen = TINY + ds_config("zero0") + ["--lr", "0", "--min-lr", "0", "--train-iters", "4", "--eval-interval", "2",
                                           "--eval-iters", "1"]
    logged, by_hand = run_ranks(1, _valid_losses_and_by_hand, frozen)[0]
    assert len(logged) == 2 and logged[0] != logged[1], "the second evaluation saw the same batches"
    assert logged == pytest.approx(by_hand, rel=1e-6)
