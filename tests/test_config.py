"""The configuration: flags -> dataclasses, derived values, and the flag table in the README."""
from __future__ import annotations

import os

import pytest

from hybridlm.config import ConfigError, effective_yaml, flags_markdown, megatron, parse_args
from oracle import ROOT


def test_megatron_flag_names_fill_the_dataclasses():
    cfg = parse_args(["--num-layers", "8", "--hidden-size", "256", "--num-attention-heads", "8", "--group-query-attention",
                      "--num-query-groups", "2",
                      "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--sequence-parallel",
                      "--bf16", "--micro-batch-size", "2", "--global-batch-size", "16", "--local_rank=3"])
    assert (cfg.model.num_layers, cfg.model.hidden_size, cfg.model.num_query_groups) == (8, 256, 2)
    assert cfg.parallel.sequence_parallel and cfg.train.bf16
    assert {"num_layers", "bf16", "global_batch_size"} <= cfg.explicit


def test_validate_derives_dp_accumulation_and_padded_vocab():
    cfg = parse_args(["--tensor-model-parallel-size", "2", "--micro-batch-size", "2", "--global-batch-size", "16",
                      "--vocab-size", "257"]).validate(world_size=8)
    assert cfg.parallel.data_parallel_size == 4
    assert cfg.gradient_accumulation_steps == 2
    assert cfg.model.padded_vocab_size == 512  # a multiple of 128 x TP


def test_a_run_naming_no_model_is_the_builtin_llama_style_tiny_one():
    builtin = parse_args([])
    assert builtin.model.model == "tiny"
    m, t = builtin.model, builtin.train
    assert (m.normalization, m.position_embedding_type, m.swiglu, m.add_bias_linear, m.hidden_dropout) == ("RMSNorm", "rope", True, False, 0.0)
    assert (m.num_layers, m.hidden_size, m.ffn_hidden_size) == (4, 128, 384)  # the model it always was
    assert (t.adam_beta2, t.weight_decay, t.lr_decay_style, t.min_lr, t.lr_warmup_fraction) == (0.95, 0.1, "cosine", 3e-4, 0.05)


def test_flags_a_script_leaves_out_take_megatron_defaults():
    cfg = parse_args(["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--num-query-groups", "2"])
    m, t = cfg.model, cfg.train
    assert m.model is None
    assert (m.normalization, m.position_embedding_type, m.swiglu, m.add_bias_linear) == ("LayerNorm", "learned_absolute", False, True)
    assert (m.hidden_dropout, m.attention_dropout, m.moe_aux_loss_coeff, m.transformer_impl) == (0.1, 0.1, 0.0, "local")
    assert m.num_query_groups == 4, "without --group-query-attention Megatron ignores --num-query-groups"
    assert m.ffn_hidden_size == 4 * 64
    assert (t.adam_beta2, t.weight_decay, t.lr_decay_style, t.min_lr, t.lr_warmup_iters) == (0.999, 0.01, "linear", 0.0, 0)
    assert (t.log_interval, t.eval_iters, t.lr_wsd_decay_style, t.exit_signal) == (100, 100, "exponential", "SIGTERM")


@pytest.mark.parametrize("hidden, ffn", [(4096, 10880), (2048, 5440), (64, 128), (128, 320)])
def test_swiglu_width_is_rounded_down_to_64_as_megatron(hidden, ffn):
    assert parse_args(["--num-layers", "1", "--hidden-size", str(hidden), "--num-attention-heads", "4", "--swiglu"]).model.ffn_hidden_size == ffn


def test_fp8_without_transformer_impl_picks_transformer_engine():
    fp8 = parse_args(["--num-layers", "1", "--fp8-format", "hybrid"]).model
    assert fp8.transformer_impl == "transformer_engine"
    assert parse_args(["--num-layers", "1", "--fp8-format", "hybrid", "--transformer-impl", "local"]).model.transformer_impl == "local"


def test_effective_yaml_shows_the_defaults_it_filled_in_and_reproduces_the_run(tmp_path):
    import yaml
    cfg = parse_args(["--num-layers", "2"])
    (tmp_path / "config.yaml").write_text(effective_yaml(cfg))
    written = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert (written["normalization"], written["adam-beta2"], written["hidden-dropout"], written["transformer-impl"]) == \
        ("LayerNorm", 0.999, 0.1, "local")
    assert parse_args(["--config", str(tmp_path / "config.yaml")]).to_dict() == cfg.to_dict()
    builtin = parse_args([])
    (tmp_path / "tiny.yaml").write_text(effective_yaml(builtin))
    assert parse_args(["--config", str(tmp_path / "tiny.yaml")]).to_dict() == builtin.to_dict()
def test_partitioned_activations_default_on_for_tp_full_recompute_and_refused_with_sp():
    cfg = parse_args(["--tensor-model-parallel-size", "2", "--recompute-granularity", "full"]).validate(2)
    assert cfg.parallel.partition_activations
    with pytest.raises(ConfigError, match="--partition-activations cannot be combined with --sequence-parallel"):
        parse_args(["--tensor-model-parallel-size", "2", "--sequence-parallel", "--partition-activations"]).validate(2)


def test_readme_flag_table_is_generated_from_the_config():
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    assert flags_markdown() in readme, "README's flag table is stale: regenerate with `python -m hybridlm.config --markdown`"
    assert megatron.markdown() in readme, \
        "README's Megatron-LM table is stale: regenerate with `python -m hybridlm.config --megatron-markdown`"


def test_yaml_run_file_fills_the_config_and_flags_win(tmp_path):
    run_file = tmp_path / "run.yaml"
    run_file.write_text("num-layers: 6\nhidden_size: 96\nlr: 3e-4\nsequence-parallel: true\n")
    cfg = parse_args(["--config", str(run_file), "--num-layers", "2"])
    assert (cfg.model.num_layers, cfg.model.hidden_size, cfg.train.lr, cfg.parallel.sequence_parallel) == (2, 96, 3e-4, True)
    assert "hidden_size" in cfg.explicit


@pytest.mark.parametrize("text, sentence", [
    ("hiden-size: 64\n", "unknown setting 'hiden-size'"),
    ("num-layers: four\n", "'num-layers' should be an integer, got 'four'"),
    ("num-layers: [1,\n", "invalid YAML at line"),
])
def test_bad_yaml_run_file_is_one_sentence(tmp_path, text, sentence):
    run_file = tmp_path / "run.yaml"
    run_file.write_text(text)
    with pytest.raises(ConfigError, match=sentence.replace("[", r"\[")):
        parse_args(["--config", str(run_file)])


@pytest.mark.parametrize("flags, modules, note", [
    (["--recompute-granularity", "selective"], ["core_attn"], None),  # Megatron-LM's default
    (["--recompute-granularity", "selective", "--recompute-modules", "mlp", "core_attn", "mlp"], ["mlp", "core_attn"], None),
    (["--recompute-granularity", "selective", "--recompute-modules", "moe"], [], "--recompute-modules moe does nothing here"),
    (["--recompute-granularity", "selective", "--recompute-modules", "moe", "--num-experts", "4"], ["moe"], None),
    (["--recompute-granularity", "selective", "--recompute-modules"], [], None),  # selective, nothing named: nothing rebuilt
    (["--recompute-granularity", "full", "--recompute-modules", "mlp"], [], "--recompute-modules mlp does nothing without"),
])
def test_recompute_modules_take_megatrons_default_and_apply_to_selective_recompute_only(flags, modules, note):
    cfg = parse_args(flags).validate(1)
    assert cfg.parallel.recompute_modules == modules
    assert (note is None and not cfg.notes) or any(n.startswith(note) for n in cfg.notes)


@pytest.mark.parametrize("name, sentence", [
    ("moe_act", "--recompute-modules moe_act: Megatron-LM's recompute of that part is not implemented here; hybridlm recomputes core_attn, mlp, moe."),
    ("layernorm", "--recompute-modules layernorm: Megatron-LM's recompute of that part is not implemented here"),
    ("attention", "--recompute-modules attention: unknown module; hybridlm recomputes core_attn, mlp, moe."),
])
def test_recompute_modules_hybridlm_does_not_rebuild_are_refused_by_name(name, sentence):
    with pytest.raises(ConfigError) as refused:
        parse_args(["--recompute-granularity", "selective", "--recompute-modules", name]).validate(1)
    assert str(refused.value).startswith(sentence)


def test_a_compile_backend_is_taken_with_torch_compile_and_refused_without_it():
    assert parse_args(["--torch-compile", "--torch-compile-backend", "aot_eager"]).validate(1).model.torch_compile_backend == "aot_eager"
    with pytest.raises(ConfigError) as refused:
        parse_args(["--torch-compile-backend", "aot_eager"]).validate(1)
    assert str(refused.value) == "--torch-compile-backend aot_eager needs --torch-compile: without it nothing is compiled."


@pytest.mark.parametrize("flags, counts", [
    ([], [4, 4, 4, 4]),
    (["--decoder-first-pipeline-num-layers", "7"], [7, 3, 3, 3]),
    (["--decoder-last-pipeline-num-layers", "1"], [5, 5, 5, 1]),
    (["--decoder-first-pipeline-num-layers", "2", "--decoder-last-pipeline-num-layers", "6"], [2, 4, 4, 6]),
])
def test_the_first_and_last_pipeline_stages_take_the_layers_asked_and_the_others_share_the_rest(flags, counts):
    from hybridlm.config import pipeline_stage_layers
    p = parse_args(["--num-layers", "16", "--pipeline-model-parallel-size", "4", *flags]).validate(4).parallel
    assert pipeline_stage_layers(16, 4, p.decoder_first_pipeline_num_layers, p.decoder_last_pipeline_num_layers) == counts


@pytest.mark.parametrize("flags, sentence", [
    (["--decoder-first-pipeline-num-layers", "2"],
     "--decoder-first-pipeline-num-layers 2 needs --pipeline-model-parallel-size > 1: one stage holds every layer."),
    (["--pipeline-model-parallel-size", "4", "--decoder-first-pipeline-num-layers", "6"],
     "--decoder-first-pipeline-num-layers 6 leave 10 of --num-layers 16 for the other 3 pipeline stage(s), which must share "
     "them evenly with at least one layer each."),
    (["--pipeline-model-parallel-size", "2", "--decoder-first-pipeline-num-layers", "9", "--decoder-last-pipeline-num-layers", "8"],
     "--decoder-first-pipeline-num-layers 9 and --decoder-last-pipeline-num-layers 8 must add up to --num-layers 16 with two "
     "pipeline stages."),
])
def test_an_uneven_pipeline_split_that_cannot_hold_is_refused_in_one_sentence(flags, sentence):
    with pytest.raises(ConfigError) as refused:
        parse_args(["--num-layers", "16", *flags]).validate(4)
    assert str(refused.value) == sentence
