"""The configuration: flags -> dataclasses, derived values, and the flag table in the README."""
from __future__ import annotations

import os

import pytest

from hybridlm.config import ConfigError, flags_markdown, parse_args
from oracle import ROOT


def test_megatron_flag_names_fill_the_dataclasses():
    cfg = parse_args(["--num-layers", "8", "--hidden-size", "256", "--num-attention-heads", "8", "--num-query-groups", "2",
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


def test_llama_defaults_and_gpt2_variant_by_flags():
    llama = parse_args([]).model
    assert (llama.normalization, llama.position_embedding_type, llama.swiglu, llama.add_bias_linear) == ("RMSNorm", "rope", True, False)
    assert llama.ffn_hidden_size % 64 == 0
    gpt2 = parse_args(["--normalization", "LayerNorm", "--position-embedding-type", "learned_absolute", "--no-swiglu",
                       "--add-bias-linear"]).model
    assert gpt2.ffn_hidden_size == 4 * gpt2.hidden_size


def test_partitioned_activations_default_on_for_tp_full_recompute_and_refused_with_sp():
    cfg = parse_args(["--tensor-model-parallel-size", "2", "--recompute-granularity", "full"]).validate(2)
    assert cfg.parallel.partition_activations
    with pytest.raises(ConfigError, match="--partition-activations cannot be combined with --sequence-parallel"):
        parse_args(["--tensor-model-parallel-size", "2", "--sequence-parallel", "--partition-activations"]).validate(2)


def test_readme_flag_table_is_generated_from_the_config():
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    assert flags_markdown() in readme, "README's flag table is stale: regenerate with `python -m hybridlm.config --markdown`"


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
