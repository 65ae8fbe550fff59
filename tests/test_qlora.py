"""QLoRA: LoRA adapters on a 4-bit base (bitsandbytes NF4, double quantization) compute what PEFT computes.

The base is a tiny Llama imported from Hugging Face (hidden 128, so that every TP2 slice is whole
64-weight blocks). A run fine-tunes it with SFT on packed rows, starting from random non-zero B so
that the adapters already move the logits, and saves. Then, in fp32 on the CPU:

- the 4-bit base holds the very bits transformers' BitsAndBytesConfig gives the same model, weight
  for weight, and the run's logits equal PEFT's on that base with the run's adapters, loaded from the
  adapter-only export (< 1e-4), while the same adapters on the dense base differ (the base matters);
- the merged export (base dequantized + (alpha/R) B A) loads in transformers with the same logits, and
  generate.py runs the checkpoint itself alike;
- at TP2 + SP (full recompute) and at PP2 two steps give a single process's losses and adapters (and
  at TP2 its logits): every TP rank slices one quantization of the full weight, while quantizing each
  rank's shard on its own drifts;
- a resumed run continues bit for bit, and its checkpoint holds the adapters and the name of its base;
- DPO's reference is the 4-bit base with the adapters off; what QLoRA cannot do is refused in one sentence.
"""
from __future__ import annotations

import importlib.util
import json
import math
import os

import pytest
import torch

from harness import run_ranks
from oracle import assert_flat_matmul_for_batch_major_rows, ds_config

pytestmark = [pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None,
                                 reason="QLoRA's base is bitsandbytes' (pip install 'hybridlm[qlora]')"),
              pytest.mark.skipif(importlib.util.find_spec("peft") is None,
                                 reason="the QLoRA model is compared with PEFT's (pip install peft)")]


@pytest.fixture(scope="module", autouse=True)
def _imported_once_for_the_forked_ranks():
    """bitsandbytes and PEFT (transformers with it: ~6.7 s of CPU) imported in the test process, once, by the
    pytest-xdist worker that runs this file, so that its forked ranks inherit them. Imported at module level, they
    cost every worker that time at collection, before its first test."""
    import bitsandbytes  # noqa: F401
    import peft  # noqa: F401

QLORA = ["--lora-rank", "4", "--lora-alpha", "8", "--quant-bits", "4"]
SHAPE = dict(hidden_size=128, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)
# TP2 + SP with full recompute: the 4-bit GEMMs run again inside the checkpointed layers' backward
TP2_SP = ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--recompute-granularity", "full"]
PP2 = ["--pipeline-model-parallel-size", "2"]


def _tokens() -> torch.Tensor:
    return torch.randint(0, 400, (2, 24), generator=torch.Generator().manual_seed(5))


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """(Hugging Face model directory, its hybridlm import, SFT data prefix)."""
    from finetune_runs import hf_model_dir, imported, sft_data
    root = tmp_path_factory.mktemp("qlora_base")
    hf = hf_model_dir(root / "hf", "llama", **SHAPE)
    return hf, imported(hf, root / "ckpt"), sft_data(root / "sft", hf)


def sft_flags(base, load: str, steps: int, save: str | None = None, layout: list[str] = ()) -> list[str]:
    from finetune_runs import OPTIM, SEQ
    return (["--task", "sft", "--load", load, "--data-path", base[2], "--seq-length", str(SEQ), "--packing",
             "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", str(steps)] + QLORA + OPTIM
            + list(layout) + ds_config("zero1") + (["--save", save] if save else []))


def qlora_run(flags: list[str], steps: int, save: bool = False, per_shard: bool = False) -> dict:
    """In each rank: random B, ``steps`` SFT steps, (save); the losses, the layout's logits on ``_tokens()``,
    the base's logits (adapters off), the live adapters, and this rank's dequantized 4-bit weights."""
    import logging

    from deepspeed.utils import logger

    from hybridlm.parallel.lora import adapters_disabled, describe_adapters, is_adapter_name
    from hybridlm.parallel.quantized import quantized_weights
    from hybridlm.training.distributed import device
    from hybridlm.training.finetune import parse_finetune_args
    from hybridlm.training.trainer import build_run, data_iterator, prepare_config, save_checkpoint, train_step
    from interop_runs import _live_state
    from test_lora import _layout_logits, random_b

    logger.setLevel(logging.WARNING)
    if per_shard:  # the mutation check: each TP rank quantizes its own shard instead of slicing the full weight's quantization
        from hybridlm.parallel.quantized import QuantizedWeight, quantize
        from hybridlm.parallel.tensor_parallel import Sharding

        def assign(self, full):
            shard = Sharding(self.tp_sharding.dim, self.tp_sharding.blocks).shard(full, self.tp.rank, self.tp.size)
            rows = [r // self.tp.size for r in self.part_rows] if self.column else [shard.shape[0]]
            self.parts = [quantize(part, self.spec) for part in torch.split(shard, rows, dim=0)]
        QuantizedWeight.assign = assign
    random_b()
    cfg, ds = prepare_config(parse_finetune_args(flags))
    run = build_run(cfg, ds)
    batches = data_iterator(run)
    losses = [train_step(run, batches).item() for _ in range(steps)]
    logits = base_logits = None
    if not run.is_pipeline:  # (the pipeline engine's eval_batch takes the task's batches, not bare tokens)
        tokens = _tokens().to(device())
        logits = _layout_logits(run, tokens)
        with adapters_disabled(run.engine.module):
            base_logits = _layout_logits(run, tokens)
    if save:
        save_checkpoint(run)
    weights = _live_state(run, False)["weight"]
    cpu = lambda t: None if t is None else t.float().cpu()  # noqa: E731 (CUDA tensors do not outlive the rank)
    return {"losses": losses, "logits": cpu(logits), "base_logits": cpu(base_logits),
            "described": describe_adapters(run.engine.module, cfg.model),
            "adapters": {n: w for n, w in weights.items() if is_adapter_name(n)},
            "frozen": {n: w for n, w in weights.items() if not is_adapter_name(n)},
            "dequantized": {n: cpu(w.dequantize()) for n, w in quantized_weights(run.engine.module)},
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None}


def first(results: list[dict], key: str):
    return next(r[key] for r in results if r[key] is not None)


_single: dict = {}


def single_process(base, tmp_path_factory) -> tuple[dict, str]:
    """(rank 0's result, run directory) of the one-process run, trained two steps and saved; once per session."""
    if not _single:
        run_dir = str(tmp_path_factory.mktemp("qlora_single") / "run")
        _single["run"] = (run_ranks(1, qlora_run, sft_flags(base, base[1], 2, run_dir), 2, True)[0], run_dir)
    return _single["run"]


def bnb_model(hf_dir: str, device: str = "cpu", dtype: torch.dtype = torch.float32):
    """transformers' own 4-bit model of ``hf_dir``: what a PEFT QLoRA user loads (``dtype``: weights and compute)."""
    import bitsandbytes as bnb
    import transformers
    quant = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                            bnb_4bit_compute_dtype=dtype)
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, quantization_config=quant, dtype=dtype,
                                                              device_map=device, local_files_only=True)
    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            # bitsandbytes' CPU inference kernel (avx512-bf16, taken in eval mode without gradients) repacks the weight and
            # computes in bf16; without it Linear4bit dequantizes and multiplies in the compute dtype, as on a GPU
            module.support_avx512bf16_for_cpu = False
    return model


def test_qlora_equals_peft_on_the_same_bitsandbytes_base_and_both_exports_load(base, tmp_path_factory, tmp_path):
    import peft
    import transformers
    from bitsandbytes.functional import dequantize_4bit

    from hybridlm.interop.export import export_to_hf
    from hybridlm.interop.peft_adapter import export_peft_adapter
    ours, run_dir = single_process(base, tmp_path_factory)
    tokens, logits = _tokens(), ours["logits"]
    assert (logits - ours["base_logits"]).abs().max().item() > 1e-2, "the adapters do not move the logits: B did not start random"
    assert "held 4-bit nf4 with double quantization, computing in fp32" in ours["described"], ours["described"]

    # the same base, bit for bit: transformers' Linear4bit of each q/k/v/o/gate/up/down is one of our parts
    hf4 = bnb_model(base[0])
    for layer in range(2):
        block = hf4.model.layers[layer]
        theirs = {"attention.qkv": [block.self_attn.q_proj, block.self_attn.k_proj, block.self_attn.v_proj],
                  "attention.proj": [block.self_attn.o_proj], "mlp.fc1": [block.mlp.gate_proj, block.mlp.up_proj],
                  "mlp.fc2": [block.mlp.down_proj]}
        for ours_name, linears in theirs.items():
            dense = torch.cat([dequantize_4bit(m.weight.data, m.weight.quant_state) for m in linears])
            assert torch.equal(dense, ours["dequantized"][f"{layer + 1}.{ours_name}.weight"]), f"layer {layer} {ours_name}"

    # PEFT on that base with our adapters, from the adapter-only export
    adapter = str(tmp_path / "adapter")
    export_peft_adapter(run_dir, adapter, log=lambda line: None)
    with open(os.path.join(adapter, "adapter_config.json")) as f:
        assert json.load(f)["target_modules"] == sorted(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    qlora_peft = peft.PeftModel.from_pretrained(hf4, adapter).eval()
    with torch.no_grad():
        theirs = qlora_peft(tokens).logits
    assert (theirs - logits).abs().max().item() < 1e-4
    # the base matters: the same adapters on the dense base are another model
    dense_peft = peft.PeftModel.from_pretrained(
        transformers.AutoModelForCausalLM.from_pretrained(base[0], dtype=torch.float32, local_files_only=True), adapter).eval()
    with torch.no_grad():
        assert (dense_peft(tokens).logits - logits).abs().max().item() > 100 * (theirs - logits).abs().max().item()

    # the merged export: the dequantized base plus (alpha/R) B A, a plain model for transformers
    merged = str(tmp_path / "merged")
    export_to_hf(run_dir, merged, merge_lora=True, progress=False, log=lambda line: None)
    model, info = transformers.AutoModelForCausalLM.from_pretrained(merged, output_loading_info=True, local_files_only=True,
                                                                    dtype=torch.float32)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    with torch.no_grad():
        assert (model.eval()(tokens).logits - logits).abs().max().item() < 1e-4

    # generate.py's decoder (KV cache) on the QLoRA checkpoint itself: its base quantized again, the adapters beside it
    from hybridlm.interop.generate import KVCache, load_for_generation
    from hybridlm.parallel.state import SINGLE
    generator, cfg, _ = load_for_generation(run_dir, SINGLE, "cpu", torch.float32)
    cache = KVCache(cfg.num_layers, 2, cfg.num_query_groups, tokens.shape[1], cfg.kv_channels, "cpu", torch.float32)
    assert (generator.forward_step(tokens, cache, 0) - logits[:, -1]).abs().max().item() < 1e-4


@pytest.mark.parametrize("layout", ["tp2_sp", "pp2"])
def test_qlora_at_tp2_sp_and_pp2_matches_single_process(base, tmp_path_factory, tmp_path, layout):
    from safetensors.torch import load_file

    from hybridlm.interop.peft_adapter import export_peft_adapter
    single, single_dir = single_process(base, tmp_path_factory)
    run_dir = str(tmp_path / "run")
    results = run_ranks(2, qlora_run, sft_flags(base, base[1], 2, run_dir, TP2_SP if layout == "tp2_sp" else PP2), 2, True)
    for step, (got, want) in enumerate(zip(results[0]["losses"], single["losses"]), start=1):
        assert abs(got - want) <= 1e-5 * abs(want), f"step {step}: loss {got} != single-process {want}"
    if layout == "tp2_sp":
        assert (first(results, "logits") - single["logits"]).abs().max().item() < 1e-4
    for name, tensor in single["adapters"].items():
        got = results[0]["adapters"][name]
        assert (got - tensor).abs().max().item() <= 1e-5 * tensor.abs().max().item(), name
    # the layout's checkpoint (TP shards, or a file per pipeline layer, of adapters only) exports what one process's does
    for directory, where in ((run_dir, "layout"), (single_dir, "single")):
        export_peft_adapter(directory, str(tmp_path / where), log=lambda line: None)
    ours, theirs = (load_file(str(tmp_path / where / "adapter_model.safetensors")) for where in ("layout", "single"))
    assert ours.keys() == theirs.keys()
    for name, tensor in theirs.items():
        assert (ours[name] - tensor).abs().max().item() <= 1e-5 * tensor.abs().max().item(), name


def test_quantizing_each_tp_shard_on_its_own_drifts_from_single_process(base, tmp_path_factory):
    # The mutation check of the test above: a rank that quantizes its own shard has other block scales
    # (double quantization's second level spans the shard) and another base.
    single, _ = single_process(base, tmp_path_factory)
    mutated = run_ranks(2, qlora_run, sft_flags(base, base[1], 2, layout=TP2_SP), 2, False, True)
    assert (first(mutated, "logits") - single["logits"]).abs().max().item() > 1e-3


def test_the_4bit_linear_is_one_matrix_product_for_inputs_and_gradients_of_any_layout():
    # W needs no gradient, so torch's matmul of a 3-D input that does not flatten as a view runs a batched
    # product per row against the broadcast W: half of a compiled, fully recomputed 7B QLoRA step on an H200.
    from hybridlm.parallel.plan import LayerFactory
    from hybridlm.parallel.quantized import QuantSpec, quantize_linear
    factory = LayerFactory()
    linear = factory.column_linear(64, [128], bias=False, init_std=0.02)
    quantized = quantize_linear(linear, QuantSpec("nf4", True, torch.float32), factory.tp)
    quantized.assign(torch.randn(128, 64, generator=torch.Generator().manual_seed(0)) * 0.02)
    assert_flat_matmul_for_batch_major_rows(linear.local_matmul, quantized.dequantize())


def test_qlora_sft_resumes_bit_exact_from_a_checkpoint_of_adapters_and_the_name_of_its_base(base, tmp_path):
    from hybridlm.interop.layout import fingerprint, read_info, resolve_tag_dir
    from hybridlm.interop.reader import load_file
    from hybridlm.parallel.lora import is_adapter_name
    straight = run_ranks(2, qlora_run, sft_flags(base, base[1], 2, layout=TP2_SP), 2)[0]
    run_dir = str(tmp_path / "run")
    run_ranks(2, qlora_run, sft_flags(base, base[1], 2, run_dir, TP2_SP), 1, True)
    tag = resolve_tag_dir(run_dir)
    info = read_info(tag)
    assert info.quantized_base == {"checkpoint": os.path.abspath(resolve_tag_dir(base[1])),
                                   "fingerprint": fingerprint(resolve_tag_dir(base[1]))}
    saved = [key for rank in range(2) for key in load_file(os.path.join(tag, f"mp_rank_{rank:02d}_model_states.pt"))["module"]]
    assert saved and all(is_adapter_name(key) for key in saved), "the checkpoint stores more than the adapters"
    resumed = run_ranks(2, qlora_run, sft_flags(base, run_dir, 2, run_dir, TP2_SP), 1)[0]
    assert resumed["losses"][0] == straight["losses"][1]
    for name, tensor in straight["adapters"].items():
        assert torch.equal(resumed["adapters"][name], tensor), f"{name} differs after the resume"
    for name, tensor in straight["frozen"].items():
        assert torch.equal(resumed["frozen"][name], tensor), f"frozen {name} differs after the resume"


def test_qlora_dpo_reference_is_the_4bit_base_with_the_adapters_off(base, tmp_path):
    # With random non-zero B the policy is not the base; DPO's reference must be the 4-bit base's log-probs (adapters
    # switched off in the same engine), which differ from the dense base's by the quantization.
    from finetune_runs import OPTIM, finetune, preference_data
    from test_lora import dpo_reference
    data = preference_data(tmp_path / "pref", base[0])
    flags = ["--task", "dpo", "--load", base[1], "--data-path", data, "--seq-length", "48", "--micro-batch-size", "2",
             "--global-batch-size", "4", "--train-iters", "1", "--lora-rank", "4", "--lora-alpha", "8"] + OPTIM + ds_config("zero1")
    dense = run_ranks(1, dpo_reference, flags, False)[0]
    quantized_b0 = run_ranks(1, dpo_reference, flags + ["--quant-bits", "4"], False)[0]
    quantized = run_ranks(1, dpo_reference, flags + ["--quant-bits", "4"], True)[0]
    assert abs(quantized - quantized_b0).max() <= 1e-6 * abs(quantized_b0).max()
    assert abs(quantized - dense).max() > 100 * 1e-6 * abs(dense).max()
    # and it trains: from B = 0 the policy is that same 4-bit base, so the first step's loss is -log sigmoid(0) = log 2
    trained = run_ranks(1, finetune, flags + ["--quant-bits", "4"], 1)[0]
    assert abs(trained["losses"][0] - math.log(2)) < 1e-6


# ---------------------------------------------------------------- refusals

@pytest.mark.parametrize("world, flags, message", [
    (1, ["--lora-rank", "0"], r"--quant-bits 4 needs --lora-rank: a quantized base cannot be trained \(full fine-tuning\)"),
    (1, ["--fp8-format", "hybrid", "--bf16"], "--quant-bits 4 cannot be combined with --fp8-format hybrid"),
    (1, ds_config("zero3"), "--quant-bits 4 cannot be combined with ZeRO stage 3"),
    (1, ["--save", "runs/never"], "--quant-bits 4 cannot be combined with --save runs/never without --load"),
    # TINY's attention output projection has 64 inputs: 32 a rank at TP2, half a quantization block
    (2, ["--tensor-model-parallel-size", "2"], r"attention's output projection input \(heads x kv-channels\) gives 64 / TP 2 = 32"),
])
def test_what_qlora_cannot_do_is_refused_in_one_sentence_before_any_process_group(world, flags, message):
    from hybridlm.config import ConfigError, parse_args
    from hybridlm.training.trainer import prepare_config
    from interop_runs import BASE
    with pytest.raises(ConfigError, match=message):
        prepare_config(parse_args(BASE + QLORA + ["--train-iters", "1"] + ds_config("zero1") + flags), world_size=world)


def test_qlora_without_bitsandbytes_is_refused_naming_the_package(monkeypatch):
    import sys

    from hybridlm.config import ConfigError, parse_args
    from hybridlm.training.trainer import prepare_config
    from interop_runs import BASE
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # what importlib sees where the package is not installed
    with pytest.raises(ConfigError, match=r"--quant-bits 4 needs bitsandbytes, which is not installed here \(pip install 'hybridlm\[qlora\]'"):
        prepare_config(parse_args(BASE + QLORA + ["--train-iters", "1"]), world_size=1)


def _resume_flags(base, run_dir: str) -> list[str]:
    return sft_flags(base, run_dir, 3)


@pytest.mark.parametrize("change, message", [
    ("quant_type", r"holds adapters trained on a base quantized with --quant-bits 4 --quant-type nf4 --double-quant; "
                   r"continue with the same settings \(this run has --quant-bits 4 --quant-type fp4 --double-quant\)"),
    ("dense", r"holds QLoRA adapters trained on a 4-bit base \(--quant-bits 4 --quant-type nf4 --double-quant\); continue with those flags"),
    ("base_gone", "its adapters were trained on the 4-bit base quantized from .* which no longer exists"),
    ("base_changed", "whose files have changed since"),
])
def test_a_qlora_checkpoint_continues_only_on_its_own_base_and_settings(base, tmp_path_factory, tmp_path, change, message):
    import shutil

    import yaml

    from hybridlm.config import ConfigError, parse_args
    from hybridlm.interop.layout import INFO_FILE, resolve_tag_dir
    from hybridlm.training.finetune import parse_finetune_args
    from hybridlm.training.trainer import prepare_config
    _, saved = single_process(base, tmp_path_factory)
    run_dir = shutil.copytree(saved, tmp_path / "run")
    flags = _resume_flags(base, str(run_dir))
    info_path = os.path.join(resolve_tag_dir(str(run_dir)), INFO_FILE)
    with open(info_path) as f:
        info = json.load(f)
    if change == "base_gone":
        info["quantized_base"]["checkpoint"] = str(tmp_path / "gone")
    if change == "base_changed":
        info["quantized_base"]["fingerprint"] = "0" * 32
    with open(info_path, "w") as f:
        json.dump(info, f)
    with pytest.raises(ConfigError, match=message):
        if change == "dense":  # the run's settings without --quant-bits, as scripts/pretrain.py would take them
            with open(os.path.join(resolve_tag_dir(str(run_dir)), "config.yaml")) as f:
                settings = {k: v for k, v in yaml.safe_load(f).items() if k not in ("quant-bits", "save")}
            with open(tmp_path / "dense.yaml", "w") as f:
                yaml.safe_dump(settings, f)
            prepare_config(parse_args(["--config", str(tmp_path / "dense.yaml"), "--load", str(run_dir)]), world_size=1)
        else:
            prepare_config(parse_finetune_args(flags + (["--quant-type", "fp4"] if change == "quant_type" else [])), world_size=1)


# ---------------------------------------------------------------- on the GPU machine (pytest -m gpu)

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (bitsandbytes' CUDA kernels)")
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_qlora_on_cuda_equals_peft_on_transformers_4bit_base(base, tmp_path, precision):
    # bitsandbytes' CUDA kernels: the same bits as transformers' CUDA quantization, and PEFT's logits with the run's
    # adapters (fp32: < 1e-3, TF32-free GEMMs in another order; bf16: within bf16's rounding of logits of about 1)
    import peft

    from hybridlm.interop.peft_adapter import export_peft_adapter
    run_dir = str(tmp_path / "run")
    flags = sft_flags(base, base[1], 2, run_dir) + (["--bf16"] if precision == "bf16" else [])
    # a spawned rank: a forked one cannot use CUDA once the test process has asked torch.cuda.is_available()
    ours = run_ranks(1, qlora_run, flags, 2, True, timeout=600, start_method="spawn")[0]
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    hf4 = bnb_model(base[0], "cuda", dtype)
    from bitsandbytes.functional import dequantize_4bit
    q_proj = hf4.model.layers[0].self_attn.q_proj
    theirs_q = dequantize_4bit(q_proj.weight.data, q_proj.weight.quant_state).float().cpu()
    assert torch.equal(theirs_q, ours["dequantized"]["1.attention.qkv.weight"][: theirs_q.shape[0]])
    adapter = str(tmp_path / "adapter")
    export_peft_adapter(run_dir, adapter, log=lambda line: None)
    model = peft.PeftModel.from_pretrained(hf4, adapter).eval()
    with torch.no_grad():
        theirs = model(_tokens().cuda()).logits.float().cpu()
    tolerance = 1e-3 if precision == "fp32" else 5e-2
    assert (theirs - ours["logits"]).abs().max().item() < tolerance
    assert (ours["logits"] - ours["base_logits"]).abs().max().item() > 10 * tolerance
