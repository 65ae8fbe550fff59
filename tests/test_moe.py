"""Mixture-of-Experts: the layer computes the naive per-token definition, every expert-parallel
layout computes the single-process run, dropping follows the capacity rule, the routing
statistics reach the log, and bad MoE input is one sentence."""
from __future__ import annotations

import contextlib
import io
import json

import pytest
import torch
import torch.nn.functional as F

from harness import run_ranks
from oracle import TINY, assert_matches, ds_config, train_and_probe
from hybridlm.presets import LLAMA_BLOCK_SETTINGS
from test_bad_input import _main_on_rank

MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-z-loss-coeff", "1e-3"]
EP2 = ["--expert-model-parallel-size", "2"]
TP2 = ["--tensor-model-parallel-size", "2"]
PP2 = ["--pipeline-model-parallel-size", "2"]

_references: dict = {}


def reference(variant: tuple[str, ...] = ()) -> dict:
    """The single-process run of TINY + MOE + variant (cached per variant for the session)."""
    if variant not in _references:
        _references[variant] = run_ranks(1, train_and_probe, TINY + MOE + list(variant) + ds_config("zero0"))[0]
    return _references[variant]


def parallel(world: int, layout: list[str], zero: str, variant: tuple[str, ...] = ()) -> dict:
    results = run_ranks(world, train_and_probe, TINY + MOE + list(variant) + layout + ds_config(zero))
    for other in results[1:]:
        assert other["losses"] == results[0]["losses"] and other["aux_losses"] == results[0]["aux_losses"], "ranks disagree"
    return results[0]


# ---------------------------------------------------------------- the layer against its definition

def _tiny_layer(**overrides):
    from hybridlm.config import ModelConfig
    from hybridlm.model.weights import init_parameters
    from hybridlm.parallel.moe import MoELayer
    from hybridlm.parallel.state import SINGLE
    settings = dict(num_layers=1, hidden_size=16, num_attention_heads=2, ffn_hidden_size=32, num_experts=4,
                    moe_router_topk=2, moe_aux_loss_coeff=0.1, moe_z_loss_coeff=0.01, **LLAMA_BLOCK_SETTINGS)
    settings.update(overrides)
    layer = MoELayer(ModelConfig(**settings), layer_number=0)
    init_parameters(layer, seed=3, tp=SINGLE)
    return layer


def _naive_moe(x, router, w1, w2, k: int, aux_coeff: float, z_coeff: float):
    """Each token through its top-k experts one at a time (SwiGLU, Mixtral's renormalised
    weights); Switch's balance loss E x sum_e f_e P_e; z-loss mean(logsumexp^2)."""
    tokens = x.reshape(-1, x.shape[-1])
    logits = tokens @ router.t()
    top_logits, top = logits.topk(k, dim=-1)
    weights = top_logits.softmax(-1)
    rows = []
    for t in range(tokens.shape[0]):
        row = 0
        for j in range(k):
            gate, up = (tokens[t] @ w1[top[t, j]].t()).chunk(2)
            row = row + weights[t, j] * ((F.silu(gate) * up) @ w2[top[t, j]].t())
        rows.append(row)
    experts = router.shape[0]
    fraction = torch.bincount(top.reshape(-1), minlength=experts) / top.numel()
    balance = experts * (fraction * logits.softmax(-1).mean(0)).sum()
    z = logits.logsumexp(-1).square().mean()
    return torch.stack(rows).view_as(x), aux_coeff * balance + z_coeff * z


@pytest.mark.parametrize("grouped", [True, False], ids=["grouped_gemm", "expert_loop"])
def test_moe_layer_equals_naive_per_token_definition_with_aux_loss_gradient(grouped):
    layer = _tiny_layer(moe_grouped_gemm=grouped)
    x = torch.randn(5, 3, 16, generator=torch.Generator().manual_seed(0), requires_grad=True)
    upstream = torch.randn(5, 3, 16, generator=torch.Generator().manual_seed(1))
    (layer(x) * upstream).sum().backward()  # aux_loss_scale 1: the aux losses count as if added to this loss

    params = [p.detach().clone().requires_grad_() for p in (layer.router.weight, layer.w1, layer.w2)]
    x_ref = x.detach().clone().requires_grad_()
    y_ref, aux_ref = _naive_moe(x_ref, *params, k=2, aux_coeff=0.1, z_coeff=0.01)
    ((y_ref * upstream).sum() + aux_ref).backward()

    assert torch.allclose(layer(x.detach()), y_ref, rtol=1e-5, atol=1e-6)
    assert torch.allclose(x.grad, x_ref.grad, rtol=1e-5, atol=1e-6)
    for param, ref in zip((layer.router.weight, layer.w1, layer.w2), params):
        assert torch.allclose(param.grad, ref.grad, rtol=1e-4, atol=1e-6)
    recorded = layer.stats.pop("cpu")  # two forwards were recorded
    assert recorded[-3:-1].sum().item() / 2 == pytest.approx(aux_ref.item(), rel=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (grouped_mm's bf16 kernel)")
def test_grouped_gemm_equals_expert_loop_on_gpu_in_bf16():
    from hybridlm.parallel.moe_dispatch import expert_matmul
    generator = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(96, 64, device="cuda", dtype=torch.bfloat16, generator=generator)
    w = torch.randn(4, 128, 64, device="cuda", dtype=torch.bfloat16, generator=generator)
    upstream = torch.randn(96, 128, device="cuda", dtype=torch.bfloat16, generator=generator)
    results = []
    for grouped in (True, False):
        xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = expert_matmul(xg, wg, [40, 0, 24, 32], grouped)
        (y.float() * upstream).sum().backward()
        results.append((y, xg.grad, wg.grad))
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)



@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (grouped_mm's bf16 kernel)")
@pytest.mark.parametrize("counts", [[512, 517, 0, 1019, 3, 1, 2000, 44], [1024, 1100, 936, 1036]], ids=["ep1", "ep2"])
def test_grouped_gemm_is_as_close_to_fp32_as_the_bf16_expert_loop_at_the_curve_models_shapes(counts):
    # The four-GPU MoE curve model's expert matrices (d768, SwiGLU width 2 x 1536) with the row counts one GPU (8
    # experts) and an EP=2 rank (4 local experts) see: uneven, unaligned, one expert empty. Forward, input and weight
    # gradients against fp32 arithmetic on the same bf16 values, no worse than the bf16 loop over experts.
    from hybridlm.parallel.moe_dispatch import expert_matmul
    generator = torch.Generator(device="cuda").manual_seed(0)
    rows, experts = sum(counts), len(counts)
    x = torch.randn(rows, 768, device="cuda", generator=generator).bfloat16()
    w = (torch.randn(experts, 3072, 768, device="cuda", generator=generator) * 0.02).bfloat16()
    upstream = torch.randn(rows, 3072, device="cuda", generator=generator).bfloat16()

    def run(grouped: bool, dtype):
        xg, wg = x.to(dtype).requires_grad_(), w.to(dtype).requires_grad_()
        y = expert_matmul(xg, wg, counts, grouped)
        (y.float() * upstream.float()).sum().backward()
        return y.float(), xg.grad.float(), wg.grad.float()

    exact, grouped, loop = run(False, torch.float32), run(True, torch.bfloat16), run(False, torch.bfloat16)
    for name, want, got, yardstick in zip(("output", "input gradient", "weight gradient"), exact, grouped, loop):
        err, bf16_err = float((got - want).norm() / want.norm()), float((yardstick - want).norm() / want.norm())
        assert err <= max(2 * bf16_err, 1e-2), f"grouped GEMM {name}: {err:.2e} from fp32, the bf16 loop {bf16_err:.2e}"
    empty = counts.index(0) if 0 in counts else None
    if empty is not None:
        assert grouped[2][empty].abs().max() == 0, "an expert without rows got a nonzero weight gradient"


@pytest.mark.gpu
@pytest.mark.gpus(4)
@pytest.mark.gpu_seconds(300)  # 399 s on 4 x H200 (d22e087) with a saver to step 3 and eight checkpoint loads
def test_every_four_gpu_ep_layout_takes_one_gpus_step_on_the_same_weights(tmp_path, record_property):
    # The sharp instrument for EP (benchmarks/same_weights.py --model moe): from the same weights, one step of each
    # layout; loss, clip norm and each group's gradient (dense, router, experts) against fp32 no further than one
    # GPU's own bf16 step is (from a checkpoint of iteration 60 on 4 H200s: every layout within rounding,
    # benchmarks/records). Here the weights are the seed's, which every layout builds alike: the saver and its
    # checkpoint were a serial launch and a 3.5 GiB load in each probe, for weights that three
    # warm-up steps (lr 4.5e-5 at step 3) had hardly moved. Resharding a checkpoint is the benchmark's to check, and
    # the CPU suite's (test_reshape.py). The jobs' seconds and set-up phases go to the gpu-tests record.
    from benchmarks.same_weights import SETUPS, faults, run
    summary = run(str(tmp_path), at=[0], steps=0, setup=SETUPS["moe"])
    record_property("jobs", summary["jobs"])
    assert not faults(summary), faults(summary)

# ---------------------------------------------------------------- every layout equals one process

@pytest.mark.parametrize("world, layout, zero", [
    pytest.param(2, EP2, "zero0", id="ep2"),
    pytest.param(4, EP2 + TP2, "zero0", id="ep2_tp2"),
    pytest.param(4, EP2 + TP2 + ["--sequence-parallel"], "zero1", id="ep2_tp2_sp"),
    pytest.param(4, EP2 + PP2, "zero1", id="ep2_pp2"),
    pytest.param(4, EP2, "zero1", id="ep2_dp2_zero1"),
    pytest.param(4, EP2, "zero2", id="ep2_dp2_zero2"),
])
def test_dropless_expert_parallel_layout_matches_single_process(world, layout, zero):
    assert_matches(reference(), parallel(world, layout, zero))


def test_capacity_large_enough_to_drop_nothing_matches_dropless_single_process():
    # 4 experts, top-2: a factor of 2 gives every expert room for every token.
    result = parallel(2, EP2, "zero1", ("--moe-capacity-factor", "2.0"))
    assert all(m["dropped_fraction"] == 0.0 for m in result["moe"])
    assert_matches(reference(), result)


def test_dropping_tokens_is_the_same_under_expert_parallelism():
    variant = ("--moe-capacity-factor", "0.75")
    single, split = reference(variant), parallel(2, EP2, "zero1", variant)
    assert all(m["dropped_fraction"] > 0.05 for m in single["moe"])
    assert [m["dropped_fraction"] for m in split["moe"]] == [m["dropped_fraction"] for m in single["moe"]]
    assert_matches(single, split)


RECOMPUTE_MOE = ["--recompute-granularity", "selective", "--recompute-modules", "moe"]


def test_recomputing_the_moe_layers_changes_no_bit_of_the_single_process_run():
    # Sigmoid scores with seq_aux_loss: one weight of layer 1 gets a first gradient below AdamW's eps, where
    # last-bit noise moves its update by 4e-4 and the next loss by 4e-5. A checkpoint that began at the residual
    # stream (norm + MoE) summed that stream's gradient in another order and failed here; one that begins at
    # the norm's output leaves every bit as it was.
    variant = ("--moe-router-score-function", "sigmoid", "--moe-router-load-balancing-type", "seq_aux_loss")
    single, split = reference(variant), parallel(1, RECOMPUTE_MOE, "zero0", variant)
    for key in ("losses", "grad_norms", "aux_losses", "z_losses"):
        assert split[key] == single[key], key
    for name, grad in single["grads"].items():
        assert torch.equal(split["grads"][name], grad), name


def test_recomputing_the_moe_layers_under_ep2_tp2_sp_matches_single_process():
    # the checkpoint keeps each TP rank's sequence slice; the recompute gathers it again and routes the same tokens
    assert_matches(reference(), parallel(4, EP2 + TP2 + ["--sequence-parallel"] + RECOMPUTE_MOE, "zero1"))


def _full_initial_weights(flags: list[str]) -> dict:
    from hybridlm.config import parse_args
    from hybridlm.model.weights import gather_full_state_dict
    from hybridlm.training.trainer import build_run, prepare_config
    run = build_run(*prepare_config(parse_args(flags)))
    module = run.engine.module
    local = {name: p.detach() for name, p in module.named_parameters()}
    return gather_full_state_dict(local, module, run.ps.tp, run.ps.dp, run.ps.ep)


def test_same_seed_gives_same_full_moe_model_at_any_ep_and_tp():
    single = run_ranks(1, _full_initial_weights, TINY + MOE + ds_config("zero0"))[0]
    split = run_ranks(4, _full_initial_weights, TINY + MOE + EP2 + TP2 + ds_config("zero0"))[0]
    assert set(split) == set(single) and single["1.mlp.moe.w1"].shape == (4, 256, 64)
    for name, tensor in single.items():
        assert torch.equal(split[name], tensor), name


# ---------------------------------------------------------------- dropping, by hand

@pytest.mark.parametrize("policy, kept", [
    # Expert 0 is the first choice of tokens 0 and 2 and the second choice of token 1.
    ("choice_then_position", [[True, True], [True, False], [True, True]]),  # token 1's second choice goes
    ("position", [[True, True], [True, True], [False, True]]),  # token 2, the last, goes
    ("probs", [[False, True], [True, True], [True, True]]),  # the lowest weight, token 0's 0.5, goes
])
def test_each_drop_policy_keeps_what_it_prefers(policy, kept):
    from hybridlm.parallel.moe_routing import keep_mask
    # 3 tokens, top-2, 3 experts, factor 1: capacity ceil(3 x 2 / 3) = 2 per expert.
    experts = torch.tensor([[0, 1], [1, 0], [0, 2]])
    weights = torch.tensor([[0.5, 0.5], [0.4, 0.6], [0.7, 0.3]])
    keep = keep_mask(experts, weights, num_experts=3, factor=1.0, policy=policy)
    assert keep.tolist() == kept


def test_dropped_fraction_and_outputs_match_a_hand_computed_case():
    # Router rows are unit vectors, so token t goes to the expert its input points at:
    # experts [0, 0, 0, 0, 1, 1, 2, 3] for 8 tokens, top-1, factor 1 -> capacity 2: expert 0
    # keeps tokens 0 and 1 (earlier first) and drops 2 and 3, 2 of 8 assignments.
    layer = _tiny_layer(moe_router_topk=1, moe_router_pre_softmax=True, moe_capacity_factor=1.0, moe_aux_loss_coeff=0.0,
                        moe_z_loss_coeff=0.0, moe_token_drop_policy="position")
    with torch.no_grad():
        layer.router.weight.zero_()
        layer.router.weight[torch.arange(4), torch.arange(4)] = 10.0
    routes = [0, 0, 0, 0, 1, 1, 2, 3]
    x = torch.zeros(8, 1, 16)
    x[torch.arange(8), 0, torch.tensor(routes)] = 1.0
    y = layer(x).squeeze(1)
    stats = layer.stats.pop("cpu")
    counts, dropped, assigned = stats[:4], stats[4], stats[5]
    assert counts.tolist() == [4, 2, 1, 1] and dropped.item() / assigned.item() == 0.25
    assert torch.all(y[2:4] == 0) and torch.all(y[[0, 1, 4, 5, 6, 7]].abs().sum(-1) > 0)
    gate, up = (x[0, 0] @ layer.w1[0].t()).chunk(2)  # token 0 through expert 0, weighted by its probability
    weight = torch.tensor([10.0, 0, 0, 0]).softmax(0)[0]
    assert torch.allclose(y[0], weight * (F.silu(gate) * up) @ layer.w2[0].t())


def _train_and_capture(flags: list[str]) -> str:
    from hybridlm.training.trainer import pretrain
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        pretrain(flags)
    return out.getvalue()


def test_routing_statistics_reach_the_log_line_and_the_metrics_file(tmp_path):
    from hybridlm.presets import model_flags
    metrics = tmp_path / "metrics.jsonl"
    flags = model_flags("mixtral-tiny") + EP2 + ds_config("zero1") + [
        "--moe-capacity-factor", "1.0", "--micro-batch-size", "2", "--train-iters", "2", "--log-interval", "1",
        "--metrics-file", str(metrics)]
    stdout = run_ranks(2, _train_and_capture, flags)[0]
    assert stdout.count("moe | aux loss") == 2 and "L3 [" in stdout and "drop " in stdout
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    for record in records:
        assert sorted(record["moe_layers"]) == ["0", "1", "2", "3"]
        for layer in record["moe_layers"].values():
            # global batch 4 samples x 64 tokens, 2 assignments each, over 8 experts
            assert len(layer["tokens_per_expert"]) == 8 and sum(layer["tokens_per_expert"]) == 4 * 64 * 2
            assert 0.0 <= layer["dropped_fraction"] < 1.0 and layer["aux_loss"] > 0.0
        assert record["moe_aux_loss"] == pytest.approx(sum(v["aux_loss"] for v in record["moe_layers"].values()))
        assert record["moe_dropped_fraction"] > 0.0


def test_tracker_metrics_chart_each_layers_load_and_drops_as_scalars():
    from hybridlm.training.metrics import _moe_line
    from hybridlm.training.moe_metrics import tracker_metrics
    layers = {"0": {"tokens_per_expert": [30.0, 10.0, 20.0, 20.0], "dropped_fraction": 0.25, "aux_loss": 0.01, "z_loss": 0.0},
              "2": {"tokens_per_expert": [20.0] * 64, "dropped_fraction": 0.0, "aux_loss": 0.02, "z_loss": 0.0}}
    metrics = tracker_metrics({"iteration": 3, "loss": 2.0, "time": 0.0, "moe_layers": layers})
    assert all(isinstance(v, float) for v in metrics.values())
    assert metrics["moe/layer0/max_load"] == 1.5 and metrics["moe/layer0/expert1_load"] == 0.5
    assert metrics["moe/layer0/dropped_fraction"] == 0.25 and metrics["moe/layer2/expert63_load"] == 1.0
    line = _moe_line({"aux_loss": 0.03, "z_loss": 0.0, "dropped_fraction": 0.1, "layers": layers})
    assert "L0 [30 10 20 20] drop 25.0%" in line and "L2 load max 1.00x min 1.00x drop 0.0%" in line  # 64 experts: a summary


def test_fine_grained_experts_64_of_width_32_top8_at_ep2_match_single_process():
    variant = ("--num-experts", "64", "--moe-router-topk", "8", "--moe-ffn-hidden-size", "32")
    assert_matches(reference(variant), parallel(2, EP2, "zero1", variant))


@pytest.mark.slow
def test_torch_compile_of_moe_layers_computes_the_eager_function():
    # What MoE adds under torch.compile is where dynamo's graphs break (around the expert loop and its all-to-alls) and
    # what AOT autograd makes of the router, the balancing losses and the routed statistics: aot_eager traces forward and
    # backward as Inductor's front half does, without Inductor's C++ build of each of the ~36 kernels of a cold cache
    # (about 60 s of CPU here). Inductor's own kernels of these layers, Triton's as users run them: the GPU test below;
    # Inductor's CPU kernels of a layer: test_oracle.py's one-process compile test. torch.compile's shape check of
    # grouped_mm demands bf16, so fp32 CPU runs loop over experts there.
    flags = TINY + MOE + ["--torch-compile", "--torch-compile-backend", "aot_eager"] + ds_config("zero1")
    assert_matches(reference(), run_ranks(1, train_and_probe, flags, timeout=600)[0])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (Inductor's Triton kernels)")
def test_torch_compile_of_moe_layers_on_a_gpu_computes_the_eager_function():
    # Inductor's Triton kernels of the MoE layers (router, top-k, balancing and z losses, the pieces between the experts),
    # fp32 without TF32: the eager run on the same GPU is the oracle, to the rounding of kernels that sum in another order.
    # Spawned ranks: a forked one cannot use CUDA once the test process has asked torch.cuda.is_available().
    flags = TINY + MOE + ds_config("zero1")
    eager, compiled = (run_ranks(1, train_and_probe, flags + extra, timeout=600, start_method="spawn")[0]
                       for extra in ([], ["--torch-compile"]))
    assert_matches(eager, compiled, tol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (host syncs are a device matter)")
def test_dropless_expert_layer_at_ep1_never_waits_for_the_host_on_gpu():
    layer = _tiny_layer(hidden_size=128, ffn_hidden_size=256, num_experts=64, moe_router_topk=8).cuda().bfloat16()
    x = torch.randn(64, 2, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    layer(x).sum().backward()  # warm-up (allocator, kernels)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        layer(x).sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_mixtral_8x7b_preset_counts_its_active_parameters():
    from hybridlm.config import parse_args
    from hybridlm.presets import model_flags
    from hybridlm.training.metrics import matmul_params
    cfg = parse_args(model_flags("mixtral-8x7b") + ["--bf16", "--expert-model-parallel-size", "8"]).validate(world_size=8)
    # Mixtral-8x7B: 12.9B active parameters per token, 0.13B of them the input embedding (not a matmul).
    assert matmul_params(cfg.model) == pytest.approx(12.75e9, rel=1e-3)


# ---------------------------------------------------------------- bad input

@pytest.mark.parametrize("world, flags, sentence", [
    pytest.param(2, ["--num-experts", "3"] + EP2, "--num-experts 3 is not divisible by --expert-model-parallel-size 2",
                 id="experts_not_divisible_by_ep"),
    pytest.param(1, ["--num-experts", "2", "--moe-router-topk", "3"],
                 "--moe-router-topk 3 must be between 1 and --num-experts 2", id="topk_exceeds_experts"),
    pytest.param(2, ["--num-experts", "4", "--expert-model-parallel-size", "4"],
                 "--expert-model-parallel-size 4 does not divide the data-parallel size 2", id="ep_not_dividing_dp"),
    pytest.param(2, EP2, "--expert-model-parallel-size 2 needs --num-experts", id="ep_without_experts"),
    pytest.param(2, ["--num-experts", "4"] + ds_config("zero3"), "--num-experts cannot be combined with ZeRO stage 3", id="zero3"),
    pytest.param(1, ["--num-experts", "4", "--moe-router-topk", "1"],
                 "--moe-router-topk 1 with softmax scores needs --moe-router-pre-softmax", id="top1_post_softmax"),
    pytest.param(1, ["--num-experts", "4", "--moe-router-enable-expert-bias"],
                 "--moe-router-enable-expert-bias needs --moe-router-score-function sigmoid", id="expert_bias_with_softmax"),
    pytest.param(1, ["--num-experts", "8", "--moe-router-num-groups", "3", "--moe-router-group-topk", "1"],
                 "--moe-router-num-groups 3 must divide --num-experts 8", id="groups_not_dividing_experts"),
    pytest.param(1, ["--num-experts", "8", "--moe-router-num-groups", "4"],
                 "--moe-router-num-groups and --moe-router-group-topk go together", id="groups_without_group_topk"),
    pytest.param(1, ["--num-experts", "4", "--moe-shared-expert-gate"],
                 "--moe-shared-expert-gate needs --moe-shared-expert-intermediate-size", id="gate_without_shared_expert"),
    pytest.param(2, ["--num-experts", "4", "--torch-compile"] + EP2,
                 "--torch-compile cannot be combined with --expert-model-parallel-size 2", id="compile_with_ep"),
])
def test_bad_moe_input_is_one_sentence_and_exit_2_on_every_rank(world, flags, sentence):
    for rank, (code, stderr) in enumerate(run_ranks(world, _main_on_rank, TINY + ds_config("zero1") + flags, timeout=60)):
        lines = [line for line in stderr.splitlines() if line.strip()]
        assert code == 2 and len(lines) == 1 and sentence in lines[0], f"rank {rank}: {stderr!r}"
