"""Fine-tuning computes what transformers computes on the same Hugging Face model, at any layout.

SFT (tiny Qwen2 with tied embeddings, tiny Llama with untied GQA; TP2 x PP2 with ZeRO-1 and DP2 with
ZeRO-3; 3+ conversations packed per row): the first step's loss equals transformers' masked
next-token loss summed over the unpacked conversations / the global batch's loss tokens, and after
the step the weights equal a transformers + torch.optim.AdamW step; 4 accumulation steps equal 1;
letting packed samples attend to each other breaks the equality (the mutation check).

DPO (policy one HF model, reference another seed, 8 pairs of unequal lengths, one truncated): the
loss and the six metrics equal the formulas pinned in hybridlm/training/losses.py on transformers'
log-probabilities, for sigmoid (label smoothing 0 and 0.1), IPO, hinge and sigmoid + RPO, at both layouts; with
the policy as its own reference the loss is ln 2.
"""
from __future__ import annotations

import math
import os
import shutil

import pytest
import torch

from finetune_runs import (BETAS, CP2, DP2_ZERO3, EPS, LR, MODELS, OPTIM, SEQ, TP2, TP2PP2, as_hf_names, finetune, hf_model,
                           hf_model_dir, imported, preference_data, sample_labels, sft_data, token_loss_sums)
from harness import run_ranks

# world, flags, micro-batch (8 rows a step: GAS 4)
LAYOUTS = {"tp2_pp2_zero1": (4, TP2PP2, 2), "dp2_zero3": (2, DP2_ZERO3, 1), "tp2": (2, TP2, 2), "cp2": (2, CP2, 2)}
GLOBAL = 8


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """family -> (HF directory, imported checkpoint, SFT data prefix)."""
    root = tmp_path_factory.mktemp("finetune")
    out = {}
    for family in MODELS:
        hf = hf_model_dir(root / family / "hf", family)
        out[family] = (hf, imported(hf, root / family / "ckpt"), sft_data(root / family / "data", hf))
    return out


_runs: dict = {}


def sft_run(models, family: str, layout: str, micro_batch: int | None = None, mutate: bool = False, extra: tuple = (),
            packing: bool = True) -> dict:
    """rank 0's result of one SFT step of ``family`` at ``layout`` (+ ``extra`` flags), once per session."""
    key = (family, layout, micro_batch, mutate, extra, packing)
    if key not in _runs:
        hf, ckpt, data = models[family]
        world, flags, mb = LAYOUTS[layout]
        argv = ["--task", "sft", "--load", ckpt, "--data-path", data, "--seq-length", str(SEQ), "--micro-batch-size",
                str(micro_batch or mb), "--global-batch-size", str(GLOBAL), "--train-iters", "1"] + (["--packing"] if packing else [])
        _runs[key] = run_ranks(world, finetune, argv + OPTIM + flags + list(extra), 1, (), mutate)[0]
    return _runs[key]


def first_global_batch(data: str, packing: bool = True) -> list[list[int]]:
    """The documents in each row of step 0 (the rows every layout reads)."""
    from hybridlm.data.chat_dataset import ChatData, SFTRows
    rows = SFTRows(ChatData(data), SEQ, seed=11, pad=0, packing=packing)
    return [rows.row(i) for i in range(GLOBAL)]


def transformers_step(models, family: str, packing: bool = True) -> tuple[float, dict, float]:
    """transformers' loss on the unpacked conversations of step 0, its weights after one AdamW step and
    the step's gradient norm (which AdamW's first step, normalising each gradient, does not show)."""
    hf, _, data = models[family]
    model = hf_model(hf)
    docs = [d for row in first_global_batch(data, packing) for d in row]
    sums, counts = token_loss_sums(model, data, docs)
    loss = sums.sum() / counts.sum()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=0.0)
    loss.backward()
    grad_norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()])).item()
    optimizer.step()
    return loss.item(), {name: p.detach().clone() for name, p in model.named_parameters()}, grad_norm


def assert_step_matches(got: dict, want_loss: float, want_weights: dict, want_grad_norm: float, checkpoint: str) -> None:
    assert abs(got["losses"][0] - want_loss) <= 1e-5 * want_loss, (got["losses"][0], want_loss)
    assert abs(float(got["grad_norms"][0]) - want_grad_norm) <= 1e-5 * want_grad_norm, (got["grad_norms"][0], want_grad_norm)
    got_weights = as_hf_names(got["weights"], checkpoint)
    assert set(got_weights) == set(want_weights)
    for name, want in want_weights.items():
        diff = (got_weights[name] - want).abs().max().item()
        assert diff < 1e-4, f"{name}: max |difference| {diff:.2e} after one step"


@pytest.mark.parametrize("layout", ["tp2_pp2_zero1", "dp2_zero3"])
@pytest.mark.parametrize("family", list(MODELS))
def test_packed_sft_step_matches_transformers_and_torch_adamw(models, family, layout):
    assert min(len(row) for row in first_global_batch(models[family][2])) >= 3  # 3+ conversations per row
    assert_step_matches(sft_run(models, family, layout), *transformers_step(models, family), models[family][1])


@pytest.mark.parametrize("extra, packing", [
    pytest.param(("--sequence-parallel",), False, id="unpacked_tp2_sp"),
    pytest.param(("--recompute-granularity", "full"), True, id="packed_tp2_full_recompute_partitioned"),
])
def test_sft_under_sequence_parallelism_and_recompute_matches_transformers(models, extra, packing):
    # TP=2 on two ranks. Unpacked rows end in padding; under full recompute the position ids go through
    # DeepSpeed's activation checkpointing (activations partitioned over TP) as an integer argument.
    got = sft_run(models, "llama", "tp2", extra=extra, packing=packing)
    assert_step_matches(got, *transformers_step(models, "llama", packing), models["llama"][1])


@pytest.mark.parametrize("extra, packing", [
    pytest.param((), False, id="unpacked_p2p"),
    pytest.param(("--cp-comm-type", "a2a"), True, id="packed_a2a"),
])
def test_sft_under_context_parallelism_matches_transformers(models, extra, packing):
    # CP=2 on two ranks: each holds its load-balanced half of every row, labels (and position ids)
    # sliced alike, and the loss-token count is summed over DP x CP. Packed rows stay apart under
    # a2a, whose kernel sees the whole rows' position ids (p2p and allgather refuse --packing).
    got = sft_run(models, "llama", "cp2", extra=extra, packing=packing)
    assert_step_matches(got, *transformers_step(models, "llama", packing), models["llama"][1])


def test_four_accumulation_steps_equal_one(models):
    four, one = sft_run(models, "qwen2", "dp2_zero3"), sft_run(models, "qwen2", "dp2_zero3", micro_batch=4)
    assert abs(four["losses"][0] - one["losses"][0]) <= 1e-6 * one["losses"][0]
    for name, tensor in one["weights"].items():
        assert (four["weights"][name] - tensor).abs().max().item() < 1e-6, name


@pytest.mark.parametrize("tied", [True, False])
def test_the_head_runs_only_on_labelled_positions_with_the_same_loss_and_gradients(tied):
    # SequentialModel (PP 1) hands MaskedLMLoss the final hidden states before the head, which keeps
    # only the positions with a label; a row with none keeps one ignored position (loss 0).
    from hybridlm.config import ModelConfig
    from hybridlm.model.specs import build_model
    from hybridlm.model.weights import init_parameters
    from hybridlm.parallel.loss import LossReducer
    from hybridlm.parallel.plan import LayerFactory
    from hybridlm.parallel.state import SINGLE
    from hybridlm.parallel.tensor_parallel import IGNORE_INDEX
    from hybridlm.presets import LLAMA_BLOCK_SETTINGS
    from hybridlm.training.losses import MaskedLMLoss

    class EveryPosition(MaskedLMLoss):
        select_positions = None

    cfg = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=2, vocab_size=96, seq_length=12,
                      untie_embeddings_and_output_weights=not tied, **LLAMA_BLOCK_SETTINGS)
    cfg.padded_vocab_size = 128
    model = build_model(cfg, LayerFactory(), loss=MaskedLMLoss(LossReducer(), cfg.vocab_size))
    init_parameters(model, seed=0, tp=SINGLE)
    torch.manual_seed(0)
    seen = []
    head = model.forward_funcs[-1]
    model.forward_funcs[-1] = lambda x: seen.append(x.shape) or head(x)
    tokens = torch.randint(0, 96, (3, 12))
    labels = torch.randint(0, 96, (3, 12))
    labels[0, :7] = labels[1, 3:5] = labels[2] = IGNORE_INDEX
    scale = torch.tensor([0.25])
    results = []
    for loss_fn in (model.loss_fn, EveryPosition(LossReducer(), cfg.vocab_size)):
        model.loss_fn = loss_fn
        model.zero_grad()
        loss = model(tokens, (labels, scale))
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    assert seen == [torch.Size([5 + 10, 1, 32]), torch.Size([12, 3, 32])]
    (picked, picked_grads), (every, every_grads) = results
    assert torch.allclose(picked, every, rtol=1e-6), (picked, every)
    for name, grad in every_grads.items():
        assert torch.allclose(picked_grads[name], grad, rtol=1e-5, atol=1e-7), name
    labels[:] = IGNORE_INDEX
    model.loss_fn = MaskedLMLoss(LossReducer(), cfg.vocab_size)
    assert model(tokens, (labels, scale)).item() == 0.0 and seen[-1] == torch.Size([1, 1, 32])


def test_attention_across_packed_samples_breaks_the_match(models):
    # The mutation check: with a plain causal mask, packed conversations see their row neighbours, and
    # the comparison of the test above fails (a random tiny model attends almost uniformly, so the
    # difference is small: 1.6e-4 relative when this was written, 16x the tolerance).
    want_loss, _, _ = transformers_step(models, "qwen2")
    mutated = sft_run(models, "qwen2", "dp2_zero3", mutate=True)["losses"][0]
    assert abs(mutated - want_loss) > 1e-5 * want_loss, (mutated, want_loss)


# ---------------------------------------------------------------- DPO

DPO_SEQ = 48  # the last pair's chosen reply is longer: truncated as a row holds it
LOSSES = (("sigmoid", 0.0, None), ("sigmoid", 0.1, None), ("ipo", 0.0, None), ("hinge", 0.0, None), ("sigmoid", 0.0, 0.5))
BETA = 0.1


@pytest.fixture(scope="module")
def preference(tmp_path_factory):
    """(policy HF dir, policy checkpoint, reference HF dir, reference checkpoint, data directory)."""
    root = tmp_path_factory.mktemp("dpo")
    policy = hf_model_dir(root / "policy_hf", "qwen2", seed=0)
    reference = hf_model_dir(root / "reference_hf", "qwen2", seed=1)
    data = preference_data(root / "data", policy)
    return policy, imported(policy, root / "policy"), reference, imported(reference, root / "reference"), os.path.dirname(data)


def dpo_flags(preference, data_dir: str, layout: str, *, reference: bool = True, iters: int = 1) -> tuple[int, list[str]]:
    _, policy_ckpt, _, ref_ckpt, _ = preference
    world, flags, mb = LAYOUTS[layout]
    argv = ["--task", "dpo", "--load", policy_ckpt, "--data-path", os.path.join(data_dir, "pref"), "--seq-length", str(DPO_SEQ),
            "--micro-batch-size", str(mb), "--global-batch-size", str(GLOBAL), "--train-iters", str(iters), "--dpo-beta", str(BETA)]
    return world, argv + (["--ref-load", ref_ckpt] if reference else []) + OPTIM + flags


def pinned(policy_c, policy_r, ref_c, ref_r, kind: str, smoothing: float) -> dict:
    """The formulas of hybridlm/training/losses.py, restated."""
    h = (policy_c - ref_c) - (policy_r - ref_r)
    if kind == "sigmoid":
        losses = -(1 - smoothing) * torch.nn.functional.logsigmoid(BETA * h) - smoothing * torch.nn.functional.logsigmoid(-BETA * h)
    elif kind == "ipo":
        losses = (h - 1 / (2 * BETA)) ** 2
    else:
        losses = torch.relu(1 - BETA * h)
    chosen, rejected = BETA * (policy_c - ref_c), BETA * (policy_r - ref_r)
    return {"loss": losses.mean().item(), "rewards/chosen": chosen.mean().item(), "rewards/rejected": rejected.mean().item(),
            "rewards/accuracies": (chosen > rejected).double().mean().item(), "rewards/margins": (chosen - rejected).mean().item(),
            "logps/chosen": policy_c.mean().item(), "logps/rejected": policy_r.mean().item()}


def transformers_logps(model, prefix: str, pairs: list[int]) -> tuple[torch.Tensor, ...]:
    """(chosen sums, rejected sums, chosen counts, rejected counts) of each pair's reply, truncated as the rows are."""
    out = []
    for side in (0, 1):
        sums, counts = [], []
        for pair in pairs:
            ids, labels = sample_labels(prefix, 2 * pair + side, DPO_SEQ + 1)
            logps = -torch.nn.functional.cross_entropy(model(ids).logits[0, :-1], labels, ignore_index=-100, reduction="sum")
            sums.append(logps.double())
            counts.append((labels != -100).sum().double())
        out += [torch.stack(sums), torch.stack(counts)]
    return out[0], out[2], out[1], out[3]


@pytest.mark.parametrize("layout", ["tp2_pp2_zero1", "dp2_zero3", "cp2"])
def test_dpo_losses_and_metrics_equal_the_pinned_formulas(preference, tmp_path, layout):
    from hybridlm.data.chat_dataset import ChatData, DPOPairs
    policy_hf, _, reference_hf, _, data_dir = preference
    data = shutil.copytree(data_dir, tmp_path / "data")  # this layout computes its own reference
    prefix = os.path.join(data, "pref")
    world, flags = dpo_flags(preference, str(data), layout)
    got = run_ranks(world, finetune, flags, 1, LOSSES)[0]
    pairs = DPOPairs(ChatData(prefix), DPO_SEQ, seed=11, pad=0)
    ids = [pairs.pair(i) for i in range(GLOBAL)]
    assert len({len(ChatData(prefix).sample(2 * p, 10**6)[0]) for p in ids}) > 4  # unequal lengths
    policy = hf_model(policy_hf)
    pc, pr, nc, nr = transformers_logps(policy, prefix, ids)
    with torch.no_grad():
        rc, rr, _, _ = transformers_logps(hf_model(reference_hf), prefix, ids)
    for kind, smoothing, rpo in LOSSES:
        want = pinned(pc / nc, pr / nr, rc / nc, rr / nr, kind, smoothing) if kind == "ipo" else pinned(pc, pr, rc, rr, kind, smoothing)
        if rpo:  # + alpha x the chosen replies' next-token loss per chosen token
            want["loss"] += rpo * (-pc.sum() / nc.sum()).item()
        values = got["dpo"][(kind, smoothing, rpo)]
        for name, value in want.items():
            assert abs(values[name] - value) <= 1e-5 * max(1.0, abs(value)), f"{kind} {smoothing} {rpo} {name}: {values[name]} != {value}"
    assert abs(got["losses"][0] - got["dpo"][LOSSES[-1]]["loss"]) <= 1e-6  # training's first step: the same loss
    # ... and the same gradient as transformers' (its norm: the layouts' reductions and scales, CP's included)
    _, _, rpo = LOSSES[-1]
    h = (pc - rc) - (pr - rr)
    (-torch.nn.functional.logsigmoid(BETA * h).mean() - rpo * pc.sum() / nc.sum()).backward()
    want_norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in policy.parameters()])).item()
    assert abs(float(got["grad_norms"][0]) - want_norm) <= 1e-5 * want_norm, (got["grad_norms"][0], want_norm)
    assert [f for f in os.listdir(data) if f.startswith("pref.reference-")]  # computed and stored beside the data


def test_dpo_with_the_policy_as_reference_gives_ln2(preference, tmp_path):
    data = shutil.copytree(preference[4], tmp_path / "data")
    world, flags = dpo_flags(preference, str(data), "dp2_zero3", reference=False)  # --ref-load defaults to --load
    got = run_ranks(world, finetune, flags, 1, (("sigmoid", 0.1, None),))[0]
    assert abs(got["losses"][0] - math.log(2)) < 1e-6
    values = got["dpo"][("sigmoid", 0.1, None)]
    assert abs(values["loss"] - math.log(2)) < 1e-6 and abs(values["rewards/margins"]) < 1e-6


def test_a_resumed_dpo_run_keeps_its_reference(preference, tmp_path):
    # Resumed, --load names the policy's own checkpoint: the reference must stay the one the run began with.
    data = shutil.copytree(preference[4], tmp_path / "data")
    world, flags = dpo_flags(preference, str(data), "dp2_zero3", iters=2)
    straight = run_ranks(world, finetune, flags, 2)[0]
    run_dir = str(tmp_path / "run")
    first = run_ranks(world, finetune, flags + ["--save", run_dir], 1, (), False, True)[0]
    ref_at = flags.index("--ref-load")
    resumed_flags = flags[:ref_at] + flags[ref_at + 2:]
    resumed_flags[resumed_flags.index("--load") + 1] = run_dir
    resumed = run_ranks(world, finetune, resumed_flags, 1)[0]
    assert resumed["reference"] == first["reference"] == straight["reference"]
    assert abs(resumed["losses"][0] - straight["losses"][1]) <= 1e-6 * abs(straight["losses"][1])
    assert len([f for f in os.listdir(data) if f.startswith("pref.reference-")]) == 1  # computed once, then read


# ---------------------------------------------------------------- GPU

def _launch_finetune(flags: list[str], metrics) -> list[float]:
    """scripts/finetune.py on one GPU through DeepSpeed's launcher; the logged losses."""
    import json
    import sys

    from benchmarks.runner import gpu_choice
    from harness import free_port, retry_on_port_clash, run_command
    from oracle import ROOT
    env = {**os.environ, "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")}
    result = retry_on_port_clash(lambda: run_command(
        [sys.executable, "-m", "deepspeed.launcher.runner", "--master_port", str(free_port()), *gpu_choice(1),
         "scripts/finetune.py", *flags, "--metrics-file", str(metrics)], cwd=ROOT, timeout=600, env=env))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    with open(metrics) as f:
        return [r["loss"] for r in map(json.loads, f)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_packed_sft_in_bf16_tracks_the_fp32_block_mask_run(models, tmp_path):
    # In bf16 packed rows take a variable-length kernel (torch's under sdpa, flash-attn's under
    # flash), eager and compiled, with the sample starts the packer found on the host; in fp32 SDPA
    # takes the block-diagonal mask. Both compute the same function, so the losses track.
    from hybridlm.model.attention_backends import resolve_backend, torch_varlen_available
    hf, ckpt, data = models["qwen2"]
    flags = ["--task", "sft", "--load", ckpt, "--data-path", data, "--packing", "--seq-length", str(SEQ),
             "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "6", "--log-interval", "1",
             "--lr", "1e-3", "--lr-warmup-iters", "0", "--deepspeed_config", "ds_configs/zero1.json"]
    runs = {}
    if torch_varlen_available():
        runs["sdpa (torch varlen)"] = ["--bf16", "--attention-backend", "sdpa"]
        runs["sdpa (torch varlen), compiled"] = ["--bf16", "--attention-backend", "sdpa", "--torch-compile"]
    try:
        resolve_backend("flash", packing=True)
        runs["flash varlen"] = ["--bf16", "--attention-backend", "flash"]
    except ValueError:
        pass
    if not runs:
        pytest.skip("no variable-length kernel here (torch 2.10+ or flash-attn)")
    oracle = _launch_finetune(flags + ["--attention-backend", "sdpa"], tmp_path / "fp32.jsonl")
    for n, (name, extra) in enumerate(runs.items()):
        losses = _launch_finetune(flags + extra, tmp_path / f"run{n}.jsonl")
        assert len(losses) == len(oracle) == 6
        for step, (a, b) in enumerate(zip(losses, oracle), start=1):
            assert abs(a - b) <= 2e-2 * abs(b), f"step {step}: {name} in bf16 {a} vs the fp32 block mask {b}"
