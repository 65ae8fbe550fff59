"""Hugging Face export and import.

Export: checkpoints trained at several layouts (TP2xPP2 tied and untied with GQA, MoE at EP=2,
the GPT-2 variant, ZeRO-3 partitions, context parallelism) are read back exactly as the live engine held them, and
the exported directory, loaded by transformers, computes hybridlm's logits (fp32, < 1e-4).
Import: a Hugging Face model -> hybridlm -> Hugging Face is bit-identical, the imported model
computes the original's logits, and training continues from it at another layout with the loss
transformers computes on the same batch. Bad input is one sentence and exit code 2.
"""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from harness import run_ranks
from interop_runs import BASE, EP2, GPT2, MOE, QWEN2_MOE, TP2PP2, UNTIED, hybridlm_logits, saved_run, train
from oracle import ds_config

# (world, flags, ZeRO config, Hugging Face class)
EXPORTS = {
    "tp2pp2_tied_gqa": (4, TP2PP2, "zero1", "LlamaForCausalLM"),
    "tp2pp2_untied_gqa": (4, TP2PP2 + UNTIED, "zero0", "LlamaForCausalLM"),
    "moe_ep2": (2, MOE + EP2, "zero1", "MixtralForCausalLM"),
    "qwen2_moe_ep2": (2, QWEN2_MOE + EP2, "zero1", "Qwen2MoeForCausalLM"),
    "gpt2_tp2_zero2": (2, GPT2 + ["--tensor-model-parallel-size", "2"], "zero2", "GPT2LMHeadModel"),
    "dp2_zero3": (2, [], "zero3", "LlamaForCausalLM"),
    "cp2_zero3": (2, ["--context-parallel-size", "2"], "zero3", "LlamaForCausalLM"),  # ZeRO partitions over CP too
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("convert_runs")
    return lambda case: saved_run(root, *EXPORTS[case][:3])


@pytest.mark.parametrize("case", list(EXPORTS))
def test_reader_returns_exactly_what_the_live_engine_held(runs, case):
    from hybridlm.interop.layout import resolve_tag_dir
    from hybridlm.interop.reader import CheckpointReader
    directory, live = runs(case)
    reader = CheckpointReader(resolve_tag_dir(directory))
    assert set(reader.names()) == set(live["weight"])
    assert reader.optimizer_step() == 2
    for name in reader.names():
        assert torch.equal(reader.weight(name), live["weight"][name].to(reader.weight(name).dtype)), f"{name}: weight"
        saved = reader.optimizer_state(name)
        for key in ("fp32", "exp_avg", "exp_avg_sq"):
            assert torch.equal(saved[key], live[key][name].float()), f"{name}: {key}"


def test_a_checkpoint_saved_before_layouts_were_recorded_is_read_from_the_run_config(runs, tmp_path):
    from hybridlm.interop.layout import CONFIG_FILE, INFO_FILE, resolve_tag_dir
    from hybridlm.interop.reader import CheckpointReader
    directory, live = runs("tp2pp2_tied_gqa")
    old = shutil.copytree(directory, tmp_path / "old")
    tag = resolve_tag_dir(str(old))
    os.remove(os.path.join(tag, INFO_FILE))
    os.remove(os.path.join(tag, CONFIG_FILE))
    reader = CheckpointReader(tag)
    assert reader.layout.describe() == "TP=2 PP=2 DP=1 EP=1 ZeRO-1 fp32"
    for name, tensor in live["weight"].items():
        assert torch.equal(reader.weight(name), tensor), name


@pytest.mark.parametrize("case", list(EXPORTS))
def test_exported_model_computes_hybridlm_logits(runs, case, tmp_path):
    from transformers import AutoModelForCausalLM
    from hybridlm.interop.export import export_to_hf
    directory, live = runs(case)
    summary = export_to_hf(directory, str(tmp_path / "hf"), progress=False, log=lambda line: None)
    assert summary["architecture"] == EXPORTS[case][3]
    model, info = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), output_loading_info=True, local_files_only=True)
    assert type(model).__name__ == EXPORTS[case][3]
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    tokens = torch.randint(0, 512, (3, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        theirs = model.eval()(tokens).logits
    ours = hybridlm_logits(live["weight"], directory, tokens)
    assert (theirs - ours).abs().max().item() < 1e-4


def test_export_writes_shards_an_index_and_a_tokenizer_that_encodes_like_training(runs, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoTokenizer
    from hybridlm.data.builtin import ByteTokenizer
    from hybridlm.interop.export import export_to_hf
    directory, _ = runs("tp2pp2_tied_gqa")
    out = tmp_path / "hf"
    export_to_hf(directory, str(out), dtype="bf16", max_shard_size="60KB", progress=False, log=lambda line: None)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and sorted(f for f in os.listdir(out) if f.endswith(".safetensors")) == shards
    tensors = {k: v for s in shards for k, v in load_file(str(out / s)).items()}
    assert set(tensors) == set(index["weight_map"]) and "lm_head.weight" not in tensors  # tied
    assert all(t.dtype == torch.bfloat16 for t in tensors.values())
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 256
    text = "def f(x):\n    return 'é' * x  # ✓"
    assert AutoTokenizer.from_pretrained(str(out)).encode(text, add_special_tokens=False) == ByteTokenizer().encode(text)
    assert not [f for f in os.listdir(tmp_path) if "partial" in f]


# ---------------------------------------------------------------- import

def _hf_model(kind: str, directory, **overrides):
    """A tiny random Hugging Face model saved (safetensors) to ``directory``."""
    import transformers
    torch.manual_seed(0)
    common = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, rope_theta=50000.0)  # not the default base
    configs = {
        "llama": lambda: transformers.LlamaConfig(**common, tie_word_embeddings=False),
        "mistral": lambda: transformers.MistralConfig(**common, sliding_window=None, head_dim=32),
        "qwen2": lambda: transformers.Qwen2Config(**common, tie_word_embeddings=True),
        "mixtral": lambda: transformers.MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2),
        # dense layers 1 and 3, pre-softmax top-2 of 8, a gated shared expert, query/key/value biases
        "qwen2_moe": lambda: transformers.Qwen2MoeConfig(**{**common, "num_hidden_layers": 4}, moe_intermediate_size=32,
                                                         shared_expert_intermediate_size=48, num_experts=8,
                                                         num_experts_per_tok=2, norm_topk_prob=False, mlp_only_layers=[1, 3]),
        "gpt2": lambda: transformers.GPT2Config(vocab_size=300, n_embd=64, n_layer=2, n_head=4, n_positions=64,
                                                bos_token_id=0, eos_token_id=0),
    }
    config = configs[kind]()
    for key, value in overrides.items():
        setattr(config, key, value)
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.save_pretrained(str(directory))
    return model.eval()


def _tensors(directory) -> dict:
    from safetensors.torch import load_file
    return {k: v for f in sorted(os.listdir(directory)) if f.endswith(".safetensors") for k, v in load_file(os.path.join(directory, f)).items()}


@pytest.mark.parametrize("kind, tp, pp, ep", [("llama", 2, 2, 1), ("mistral", 1, 2, 1), ("qwen2", 2, 1, 1),
                                              ("mixtral", 2, 1, 2), ("qwen2_moe", 2, 2, 2), ("gpt2", 2, 2, 1)])
def test_hf_to_hybridlm_to_hf_is_bit_identical(tmp_path, kind, tp, pp, ep):
    from hybridlm.interop.export import export_to_hf
    from hybridlm.interop.import_ import import_from_hf
    _hf_model(kind, tmp_path / "hf")
    import_from_hf(str(tmp_path / "hf"), str(tmp_path / "ckpt"), tp=tp, pp=pp, ep=ep, progress=False, log=lambda line: None)
    export_to_hf(str(tmp_path / "ckpt"), str(tmp_path / "back"), progress=False, log=lambda line: None)
    original, back = _tensors(tmp_path / "hf"), _tensors(tmp_path / "back")
    assert set(back) == set(original)
    for name, tensor in original.items():
        assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor), name


@pytest.mark.parametrize("kind", ["llama", "mixtral", "qwen2_moe"])
def test_imported_model_computes_the_original_logits(tmp_path, kind):
    from hybridlm.interop.import_ import import_from_hf
    from hybridlm.interop.reader import CheckpointReader
    from hybridlm.interop.layout import resolve_tag_dir
    original = _hf_model(kind, tmp_path / "hf")
    import_from_hf(str(tmp_path / "hf"), str(tmp_path / "ckpt"), tp=2, pp=2, progress=False, log=lambda line: None)
    reader = CheckpointReader(resolve_tag_dir(str(tmp_path / "ckpt")))
    tokens = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(1))
    ours = hybridlm_logits(dict(reader.weights()), str(tmp_path / "ckpt"), tokens)
    with torch.no_grad():
        theirs = original(tokens).logits
    assert (ours - theirs).abs().max().item() < 1e-4


def _first_global_batch(flags: list[str], world: int):
    """Samples [0, G) in order: the batch of iteration 0 at any layout."""
    from hybridlm.config import parse_args
    from hybridlm.training.trainer import build_datasets, prepare_config
    cfg, _ = prepare_config(parse_args(flags), world_size=world)
    return build_datasets(cfg)[0].batch(0, cfg.train.global_batch_size)


def test_pretrain_continues_an_import_at_another_layout_from_the_original_loss(tmp_path):
    from hybridlm.interop.import_ import import_from_hf
    original = _hf_model("llama", tmp_path / "hf", vocab_size=257)  # the built-in corpus's byte tokens
    ckpt = str(tmp_path / "ckpt")
    import_from_hf(str(tmp_path / "hf"), ckpt, tp=2, pp=2, seq_length=32, progress=False, log=lambda line: None)
    flags = ["--config", os.path.join(ckpt, "config.yaml"), "--load", ckpt, "--micro-batch-size", "2", "--global-batch-size", "4",
             "--lr-warmup-iters", "0", "--train-iters", "1", "--tensor-model-parallel-size", "1",
             "--pipeline-model-parallel-size", "2"] + ds_config("zero1")
    tokens, labels = run_ranks(1, _first_global_batch, flags, 2)[0]
    with torch.no_grad():
        logits = original(tokens).logits
    expected = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)).item()
    result = run_ranks(2, train, flags, 1)[0]
    assert result["start"] == 0
    assert abs(result["losses"][0] - expected) <= 1e-5 * expected


# ---------------------------------------------------------------- bad input

def _run_script(module: str, argv: list[str], capsys) -> tuple[int, str]:
    import importlib.util
    from oracle import ROOT
    spec = importlib.util.spec_from_file_location(module, os.path.join(ROOT, "scripts", f"{module}.py"))
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    capsys.readouterr()  # only what the script itself writes
    code = script.main(argv)
    return code, capsys.readouterr().err.strip()


def _break_config(directory, **changes):
    path = directory / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def _sharded(directory):
    _hf_model("llama", directory)
    from transformers import AutoModelForCausalLM
    AutoModelForCausalLM.from_pretrained(str(directory)).save_pretrained(str(directory), max_shard_size="100KB")
    os.remove(directory / "model.safetensors") if (directory / "model.safetensors").exists() else None


def _pickle_weights(directory, name: str) -> None:
    """Replace model.safetensors by a torch pickle of the same tensors, under ``name``."""
    tensors = {k: v.clone() for k, v in _tensors(directory).items()}
    os.remove(directory / "model.safetensors")
    torch.save(tensors, directory / name)


IMPORT_CASES = [
    pytest.param(lambda d: (_hf_model("llama", d), _break_config(d, architectures=["BertForMaskedLM"], model_type="bert")),
                 "architecture BertForMaskedLM is not supported", id="wrong_architecture"),
    pytest.param(lambda d: (_sharded(d), os.remove(d / sorted(f for f in os.listdir(d) if f.startswith("model-"))[1])),
                 "named in model.safetensors.index.json is missing", id="missing_shard"),
    pytest.param(lambda d: (_sharded(d), shutil.copy(d / sorted(f for f in os.listdir(d) if f.startswith("model-"))[0],
                                                       d / "model-00099-of-00099.safetensors")),
                 "extra shard model-00099-of-00099.safetensors", id="extra_shard"),
    pytest.param(lambda d: (_hf_model("llama", d), _break_config(d, intermediate_size=128)),
                 "has shape (96, 64), but config.json implies (128, 64)", id="shape_mismatch"),
    pytest.param(lambda d: (_hf_model("llama", d), _pickle_weights(d, "model.safetensors")),
                 "model.safetensors is not a safetensors file", id="pickle_named_safetensors"),
    pytest.param(lambda d: (_hf_model("llama", d), _pickle_weights(d, "pytorch_model.bin")),
                 "holds only pickled weights", id="pickle_only"),
    pytest.param(lambda d: (_hf_model("llama", d), _break_config(d, rope_scaling={"rope_type": "linear", "factor": 2.0},
                                                                 rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4})),
                 "uses RoPE scaling 'linear'", id="rope_scaling"),
]


@pytest.mark.parametrize("make, message", IMPORT_CASES)
def test_bad_hf_input_is_one_sentence(tmp_path, capsys, make, message):
    (tmp_path / "hf").mkdir()
    make(tmp_path / "hf")
    code, err = _run_script("convert_from_hf", ["--hf", str(tmp_path / "hf"), "--output", str(tmp_path / "ckpt"), "--no-progress"], capsys)
    assert code == 2 and err.startswith("error: ") and "\n" not in err and message in err, err
    assert not os.path.exists(tmp_path / "ckpt")


def _weights_only_checkpoint(directory, flags: list[str]) -> None:
    from hybridlm.config import parse_args
    from hybridlm.interop.layout import parameter_table
    from hybridlm.interop.writer import write_checkpoint
    run = parse_args(flags + ["--vocab-size", "512"]).validate(world_size=1)
    table = parameter_table(run.model, 1)
    write_checkpoint(str(directory), run, lambda name: torch.zeros(table[name].full_shape))


EXPORT_CASES = [
    pytest.param(lambda d: os.makedirs(d), "not a hybridlm checkpoint folder", id="not_a_checkpoint"),
    pytest.param(lambda d: _weights_only_checkpoint(d, BASE + MOE + ["--moe-layer-freq", "2"]),
                 "Qwen2-MoE always has a gated shared expert", id="dense_layers_without_shared_expert"),
    pytest.param(lambda d: _weights_only_checkpoint(d, BASE + MOE + ["--moe-router-score-function", "sigmoid"]),
                 "which neither Mixtral nor Qwen2-MoE computes", id="sigmoid_router"),
]


@pytest.mark.parametrize("make, message", EXPORT_CASES)
def test_bad_export_input_is_one_sentence(tmp_path, capsys, make, message):
    make(tmp_path / "ckpt")
    code, err = _run_script("convert_to_hf", ["--checkpoint", str(tmp_path / "ckpt"), "--output", str(tmp_path / "hf"), "--no-progress"], capsys)
    assert code == 2 and err.startswith("error: ") and "\n" not in err and message in err, err


@pytest.mark.parametrize("damage, message", [
    pytest.param(lambda tag: os.remove(os.path.join(tag, "layer_03-model_01-model_states.pt")),
                 "layer_03-model_01-model_states.pt is missing; the checkpoint is incomplete", id="missing_shard"),
    pytest.param(lambda tag: shutil.copy(os.path.join(tag, "mp_rank_00_model_states.pt"), os.path.join(tag, "mp_rank_07_model_states.pt")),
                 "unexpected file mp_rank_07_model_states.pt for a checkpoint saved at TP=2 PP=2", id="extra_shard"),
])
def test_a_damaged_checkpoint_is_one_sentence(runs, tmp_path, capsys, damage, message):
    from hybridlm.interop.layout import resolve_tag_dir
    directory, _ = runs("tp2pp2_tied_gqa")
    copy = shutil.copytree(directory, tmp_path / "copy")
    damage(resolve_tag_dir(str(copy)))
    code, err = _run_script("convert_to_hf", ["--checkpoint", str(copy), "--output", str(tmp_path / "hf"), "--no-progress"], capsys)
    assert code == 2 and err.startswith("error: ") and "\n" not in err and message in err, err
    assert not os.path.exists(tmp_path / "hf") and not [f for f in os.listdir(tmp_path) if "partial" in f]


def test_export_refuses_an_existing_output(runs, tmp_path, capsys):
    directory, _ = runs("tp2pp2_tied_gqa")
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "keep.txt").write_text("mine")
    code, err = _run_script("convert_to_hf", ["--checkpoint", directory, "--output", str(tmp_path / "hf")], capsys)
    assert code == 2 and "already exists" in err and (tmp_path / "hf" / "keep.txt").read_text() == "mine"
