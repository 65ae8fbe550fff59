"""LoRA adapters compute the single-process model at TP + SP and PP, and merge into a plain HF model.

With random non-zero B (so that the adapters' term is not zero) and two training steps (so that
A's and B's gradients, the sequence-parallel reduction of the replicated factor included, shape
the result), the layout's logits equal a single-process run's and the merged Hugging Face export's
in transformers (fp32, < 1e-4). At TP2 x PP2 three steps leave the adapters as one process leaves
them (relative 1e-5), the frozen base bit-identical, and the optimizer holding the adapters only.
"""
from __future__ import annotations

import os

import pytest
import torch

from harness import run_ranks
from interop_runs import BASE, _live_state
from oracle import assert_flat_matmul_for_batch_major_rows, ds_config, relative_error

LORA = ["--lora-rank", "4", "--lora-alpha", "8"]
# TP2 + SP with full recompute: the frozen embedding's output enters the checkpointed layers needing no gradient
LAYOUTS = {"tp2_sp": (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--recompute-granularity", "full"]),
           "pp2": (2, ["--pipeline-model-parallel-size", "2"]),
           "single": (1, [])}
B_STD = 0.05  # the random B of the logits tests (PEFT's, and ours, starts at zero)


def _tokens() -> torch.Tensor:
    return torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(3))


def random_b() -> None:
    """From now on (in this rank) B starts as N(0, B_STD) drawn by its name, like any weight: the same full
    tensor at every layout, before DeepSpeed copies it into its optimizer."""
    from hybridlm.parallel.lora import LoRA
    plain_init = LoRA.__init__

    def init(self, *args, **kwargs):
        plain_init(self, *args, **kwargs)
        self.b.init_std, self.b.init_value = B_STD, None

    LoRA.__init__ = init


def _layout_logits(run, tokens: torch.Tensor) -> torch.Tensor | None:
    """Full-vocabulary logits [b, s, v] of the layout's own forward (None on ranks that do not hold them)."""
    import torch.distributed as dist
    engine, ps, vocab = run.engine, run.ps, run.cfg.model.vocab_size
    if run.is_pipeline:
        _, local = engine.eval_batch(iter([(tokens, tokens)]), return_logits=True, num_micro_batches=1)
        if not ps.is_last_stage:
            return None
    else:
        engine.module.eval()
        with torch.no_grad():
            local = engine.module(tokens)
        engine.module.train()
    if ps.tp.size > 1:
        parts = [torch.empty_like(local) for _ in range(ps.tp.size)]
        dist.all_gather(parts, local.contiguous(), group=ps.tp.group)
        local = torch.cat(parts, dim=-1)
    return local.permute(1, 0, 2)[..., :vocab].detach().clone()


def random_b_run(flags: list[str], steps: int, save: str | None, mutate: bool = False) -> dict:
    """In each rank: random B, ``steps`` training steps, the layout's logits on ``_tokens()``, (save)."""
    import logging

    from deepspeed.utils import logger

    from hybridlm.config import parse_args
    from hybridlm.training.checkpoint import write_run_files
    from hybridlm.training.trainer import build_run, data_iterator, prepare_config, save_checkpoint, train_step

    logger.setLevel(logging.WARNING)
    if mutate:  # the mutation check: the replicated factor's gradient is not summed over TP under SP
        import hybridlm.parallel.lora as lora
        lora.sum_grad_over_tp = lambda param, tp: None
    from hybridlm.parallel.lora import adapters_disabled
    random_b()
    cfg, ds = prepare_config(parse_args(flags))
    run = build_run(cfg, ds)
    start = _layout_logits(run, _tokens())
    with adapters_disabled(run.engine.module):
        base = _layout_logits(run, _tokens())
    batches = data_iterator(run)
    losses = [train_step(run, batches).item() for _ in range(steps)]
    logits = _layout_logits(run, _tokens())
    if save:
        if torch.distributed.get_rank() == 0:
            write_run_files(save, cfg, ds)
        save_checkpoint(run)
    adapter_term = None if start is None else (start - base).abs().max().item()
    return {"losses": losses, "logits": logits, "adapter_term_at_start": adapter_term}


def _flags(layout: str, steps: int, save: str | None = None) -> tuple[int, list[str]]:
    world, extra = LAYOUTS[layout]
    return world, BASE + LORA + extra + ds_config("zero0") + ["--train-iters", str(steps)] + (["--save", save] if save else [])


_singles: dict = {}


def single_process(steps: int) -> dict:
    if steps not in _singles:
        world, flags = _flags("single", steps)
        _singles[steps] = run_ranks(world, random_b_run, flags, steps, None)[0]
    return _singles[steps]


def layout_logits(results: list[dict]) -> torch.Tensor:
    return next(r["logits"] for r in results if r["logits"] is not None)


@pytest.mark.parametrize("layout", ["tp2_sp", "pp2"])
def test_lora_logits_match_single_process_and_the_merged_hf_export(layout, tmp_path):
    from transformers import AutoModelForCausalLM

    from hybridlm.interop.export import export_to_hf
    run_dir = str(tmp_path / "run")
    world, flags = _flags(layout, 2, run_dir)
    results = run_ranks(world, random_b_run, flags, 2, run_dir)
    ours, single = layout_logits(results), single_process(2)
    # the random B is in place before the first step: the adapters already move the logits (with B = 0, PEFT's and
    # our default start, they would not, and the first step's A gradient would be zero at every layout alike)
    term = next(r["adapter_term_at_start"] for r in results if r["adapter_term_at_start"] is not None)
    assert term > 1e-3, f"the adapters change the starting logits by only {term:.1e}: B did not start random"
    for step, (got, want) in enumerate(zip(results[0]["losses"], single["losses"]), start=1):
        assert abs(got - want) <= 1e-5 * abs(want), f"step {step}: loss {got} != single-process {want}"
    assert (ours - single["logits"]).abs().max().item() < 1e-4
    summary = export_to_hf(run_dir, str(tmp_path / "hf"), merge_lora=True, progress=False, log=lambda line: None)
    model, info = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), output_loading_info=True, local_files_only=True)
    assert summary["architecture"] == type(model).__name__ and not info["missing_keys"] and not info["unexpected_keys"]
    with torch.no_grad():
        theirs = model.eval()(_tokens()).logits
    assert (theirs - ours).abs().max().item() < 1e-4
    # generate.py's decoder (KV cache) on the LoRA checkpoint itself: the same last-position logits
    from hybridlm.interop.generate import KVCache, load_for_generation
    from hybridlm.parallel.state import SINGLE
    generator, cfg, _ = load_for_generation(run_dir, SINGLE, "cpu", torch.float32)
    cache = KVCache(cfg.num_layers, 2, cfg.num_query_groups, 32, cfg.kv_channels, "cpu", torch.float32)
    assert (generator.forward_step(_tokens(), cache, 0) - theirs[:, -1]).abs().max().item() < 1e-4
    # the adapters matter: the same export without them (B = 0) is another model
    assert (theirs - ours).abs().max().item() * 100 < (ours - single_base_logits(run_dir)).abs().max().item()


def single_base_logits(run_dir: str) -> torch.Tensor:
    """Logits of the saved checkpoint's base alone (adapters switched off), one process."""
    from interop_runs import hybridlm_logits
    from hybridlm.interop.layout import resolve_tag_dir
    from hybridlm.interop.reader import CheckpointReader
    from hybridlm.parallel.lora import is_adapter_name
    weights = {n: (torch.zeros_like(w) if n.endswith(".lora.b") else w)
               for n, w in CheckpointReader(resolve_tag_dir(run_dir)).weights()}
    assert any(is_adapter_name(n) for n in weights)
    return hybridlm_logits(weights, run_dir, _tokens())


def test_without_the_sp_reduction_of_the_replicated_factor_tp2_sp_drifts_from_single_process():
    # The mutation check of the test above: the column's A and the row's B see only their rank's
    # tokens under SP; without summing their gradients over TP, training moves them differently.
    world, flags = _flags("tp2_sp", 2)
    mutated = run_ranks(world, random_b_run, flags, 2, None, True)
    assert (layout_logits(mutated) - single_process(2)["logits"]).abs().max().item() > 1e-3


def lora_steps(flags: list[str], steps: int) -> dict:
    """In each rank: full weights before and after ``steps`` steps, and the names the optimizer holds."""
    import logging

    from deepspeed.utils import logger

    from hybridlm.config import parse_args
    from hybridlm.training.trainer import build_run, data_iterator, prepare_config, train_step

    logger.setLevel(logging.WARNING)
    random_b()
    cfg, ds = prepare_config(parse_args(flags))
    run = build_run(cfg, ds)
    before = _live_state(run, False)["weight"]
    batches = data_iterator(run)
    losses = [train_step(run, batches).item() for _ in range(steps)]
    optimizer = run.engine.optimizer
    groups = optimizer.bit16_groups if hasattr(optimizer, "bit16_groups") else [g["params"] for g in optimizer.param_groups]
    held = {id(p) for group in groups for p in group}
    return {"losses": losses, "before": before, "after": _live_state(run, False)["weight"],
            "optimized": [n for n, p in run.engine.module.named_parameters() if id(p) in held]}


def test_lora_steps_at_tp2_pp2_equal_single_process_and_leave_the_base_untouched():
    from hybridlm.parallel.lora import is_adapter_name
    common = BASE + LORA + ["--train-iters", "3"]
    single = run_ranks(1, lora_steps, common + ds_config("zero0"), 3)[0]
    parallel = run_ranks(4, lora_steps, common + ds_config("zero1") + ["--tensor-model-parallel-size", "2",
                                                                       "--pipeline-model-parallel-size", "2"], 3)
    for step, (got, want) in enumerate(zip(parallel[0]["losses"], single["losses"]), start=1):
        assert abs(got - want) <= 1e-5 * abs(want), f"step {step}: loss {got} != single-process {want}"
    got = parallel[0]
    adapters = [n for n in single["after"] if is_adapter_name(n)]
    assert len(adapters) == 4 * 4 * 2  # 4 layers x (qkv, proj, fc1, fc2) x (A, B)
    for name in adapters:
        assert relative_error(got["after"][name], single["after"][name]) <= 1e-5, name
        assert not torch.equal(got["after"][name], got["before"][name]), f"{name} did not train"
    for name in set(single["after"]) - set(adapters):
        assert torch.equal(got["after"][name], got["before"][name]), f"frozen {name} changed"
    # ZeRO-1's partitions (and so its fp32 copies and Adam moments) are the adapters', every stage's
    optimized = {n for rank in parallel for n in rank["optimized"]}
    assert optimized == set(adapters)


# ---------------------------------------------------------------- fine-tuning (SFT, DPO) from an imported base

@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """(imported Llama checkpoint, SFT data prefix, preference data prefix)."""
    from finetune_runs import hf_model_dir, imported, preference_data, sft_data
    root = tmp_path_factory.mktemp("lora_base")
    hf = hf_model_dir(root / "hf", "llama")
    return imported(hf, root / "ckpt"), sft_data(root / "sft", hf), preference_data(root / "pref", hf)


def sft_flags(base, load: str, steps: int, save: str | None = None) -> list[str]:
    from finetune_runs import OPTIM, SEQ, TP2
    return (["--task", "sft", "--load", load, "--data-path", base[1], "--seq-length", str(SEQ), "--packing", "--micro-batch-size", "2",
             "--global-batch-size", "4", "--train-iters", str(steps)] + LORA + OPTIM + TP2 + (["--save", save] if save else []))


def test_lora_sft_resumes_bit_exact_and_keeps_the_imported_base(base, tmp_path):
    from finetune_runs import finetune
    from hybridlm.interop.layout import resolve_tag_dir
    from hybridlm.interop.reader import CheckpointReader
    from hybridlm.parallel.lora import is_adapter_name
    straight = run_ranks(2, finetune, sft_flags(base, base[0], 2), 2)[0]
    run_dir = str(tmp_path / "run")
    run_ranks(2, finetune, sft_flags(base, base[0], 2, run_dir), 1, (), False, True)
    resumed = run_ranks(2, finetune, sft_flags(base, run_dir, 2, run_dir), 1)[0]
    assert resumed["losses"][0] == straight["losses"][1]
    imported = dict(CheckpointReader(resolve_tag_dir(base[0])).weights())
    for name, tensor in straight["weights"].items():
        assert torch.equal(resumed["weights"][name], tensor), f"{name} differs after the resume"
        if not is_adapter_name(name):
            assert torch.equal(tensor, imported[name].float()), f"frozen {name} moved"


def dpo_reference(flags: list[str], lora_b: bool) -> object:
    """In each rank: the DPO reference log-probabilities the run computed."""
    from hybridlm.training.finetune import parse_finetune_args
    from hybridlm.training.trainer import build_run, prepare_config
    if lora_b:
        random_b()
    cfg, ds = prepare_config(parse_finetune_args(flags))
    return build_run(cfg, ds).task.reference


def test_lora_dpo_reference_is_the_base_with_the_adapters_off(base, tmp_path):
    # With random non-zero B the policy is not the base; the reference must still be the base's log-probs,
    # computed by the same engine with its adapters switched off (no --ref-load, no second model).
    import shutil

    from finetune_runs import OPTIM, TP2
    data = shutil.copytree(os.path.dirname(base[2]), tmp_path / "data")
    flags = ["--task", "dpo", "--load", base[0], "--data-path", os.path.join(data, "pref"), "--seq-length", "48",
             "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "1"] + OPTIM + TP2
    plain = run_ranks(2, dpo_reference, flags, False)[0]
    with_adapters = run_ranks(2, dpo_reference, flags + LORA, True)[0]
    assert abs(with_adapters - plain).max() <= 1e-6 * abs(plain).max()


@pytest.mark.parametrize("flags, message", [
    (["--lora-targets", "qkv,gate"], "unknown linear 'gate'"),
    (["--lora-rank", "-1"], "--lora-rank must be positive"),
    (["--lora-dropout", "1"], r"--lora-dropout must be in \[0, 1\)"),
    (["--num-experts", "4"], "adapters on routed experts are not implemented"),
    (ds_config("zero3"), "ZeRO stage 3"),
])
def test_what_lora_cannot_do_is_refused_in_one_sentence_before_any_process_group(flags, message):
    from hybridlm.config import ConfigError, parse_args
    from hybridlm.training.trainer import prepare_config
    with pytest.raises(ConfigError, match=message):
        prepare_config(parse_args(BASE + LORA + ["--train-iters", "1"] + flags), world_size=1)


@pytest.mark.parametrize("kind", ["column", "row"])
def test_a_frozen_base_linear_is_one_matrix_product_for_inputs_and_gradients_of_any_layout(kind):
    # LoRA's base weight needs no gradient, and torch's matmul then runs a 3-D input whose rows are not one view
    # as a batched product against the broadcast weight (the QLoRA test beside this one has the measured cost).
    from hybridlm.parallel.plan import LayerFactory
    factory = LayerFactory()
    linear = (factory.column_linear(64, [96], bias=False, init_std=0.02) if kind == "column"
              else factory.row_linear(64, 96, bias=False, init_std=0.02))
    with torch.no_grad():
        linear.weight.normal_(0.0, 0.02, generator=torch.Generator().manual_seed(0))
    linear.weight.requires_grad_(False)
    assert_flat_matmul_for_batch_major_rows(linear, linear.weight.detach())
