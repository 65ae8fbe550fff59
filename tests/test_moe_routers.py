"""The router options of Megatron's flags: each computes its per-token definition, the balancing
losses and the expert-bias update follow Megatron's formulas, and every option equals the
single-process model at EP2 x TP2 x PP2 with sequence parallelism on 8 gloo ranks (losses,
aux and z losses, gradient norms and step-1 gradients over 3 steps, and the expert biases)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from oracle import assert_matches
from hybridlm.presets import LLAMA_BLOCK_SETTINGS
from test_moe import EP2, PP2, RECOMPUTE_MOE, TP2, _tiny_layer, parallel, reference

SP = ["--sequence-parallel"]


# ---------------------------------------------------------------- routing, token by token

def _naive_route(row: torch.Tensor, opts, bias=None):
    """One token's (experts, weights), written from the flags' descriptions (Megatron's meaning)."""
    k = opts.topk
    if opts.score_function == "softmax":
        score = row.softmax(0) if opts.pre_softmax else row
    else:
        score = row.sigmoid() if opts.score_function == "sigmoid" else F.softplus(row).sqrt()
    select = score + bias if bias is not None else score
    allowed = list(range(row.numel()))
    if opts.num_groups:
        size = row.numel() // opts.num_groups
        group_score = [sorted(select[g * size:(g + 1) * size].tolist(), reverse=True)[:k // opts.group_topk]
                       for g in range(opts.num_groups)]
        best = sorted(range(opts.num_groups), key=lambda g: -sum(group_score[g]))[:opts.group_topk]
        allowed = [e for e in allowed if e // size in best]
    chosen = sorted(allowed, key=lambda e: -select[e].item())[:k]
    if opts.score_function == "softmax":
        weights = score[chosen] if opts.pre_softmax else row[chosen].softmax(0)
    else:
        weights = score[chosen] / score[chosen].sum() if k > 1 else score[chosen]
    return chosen, weights * (opts.scaling_factor or 1.0)


@pytest.mark.parametrize("options", [
    dict(),
    dict(pre_softmax=True),
    dict(score_function="sigmoid"),
    dict(score_function="sqrtsoftplus", scaling_factor=2.5),
    dict(num_groups=4, group_topk=2),
    dict(pre_softmax=True, num_groups=4, group_topk=2),
    dict(score_function="sigmoid", num_groups=4, group_topk=2, scaling_factor=2.5, bias=True),
    dict(score_function="sigmoid", topk=1, bias=True),
], ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()) or "mixtral")
def test_route_chooses_and_weighs_each_token_as_its_definition(options):
    from hybridlm.parallel.moe_routing import RouterOptions, route
    options = dict(options)
    with_bias = options.pop("bias", False)
    opts = RouterOptions(**{"topk": 4, **options})
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(50, 8, generator=generator)
    bias = torch.randn(8, generator=generator) * 0.3 if with_bias else None
    weights, index = route(logits, opts, bias)
    for t in range(logits.shape[0]):
        chosen, want = _naive_route(logits[t], opts, bias)
        assert index[t].tolist() == chosen, f"token {t}"
        torch.testing.assert_close(weights[t], want, rtol=1e-6, atol=1e-7)


# ---------------------------------------------------------------- balancing losses

def _layer(**overrides):
    from hybridlm.config import ModelConfig
    from hybridlm.model.weights import init_parameters
    from hybridlm.parallel.moe import MoELayer
    from hybridlm.parallel.state import SINGLE
    settings = dict(num_layers=1, hidden_size=16, num_attention_heads=2, ffn_hidden_size=32, num_experts=8,
                    moe_router_topk=2, moe_aux_loss_coeff=0.1, **LLAMA_BLOCK_SETTINGS)  # not Megatron's GPT defaults
    settings.update(overrides)
    layer = MoELayer(ModelConfig(**settings), layer_number=0)
    init_parameters(layer, seed=3, tp=SINGLE)
    return layer


def _switch(probs: torch.Tensor, chosen: torch.Tensor, k: int) -> torch.Tensor:
    """E x sum_e (mean probability of e) x (fraction of assignments to e)."""
    experts = probs.shape[-1]
    fraction = torch.bincount(chosen.reshape(-1), minlength=experts).float() / chosen.numel()
    return experts * (probs.mean(0) * fraction).sum()


@pytest.mark.parametrize("score_function", ["softmax", "sigmoid"])
@pytest.mark.parametrize("balancing", ["aux_loss", "seq_aux_loss"])
def test_balance_loss_and_its_gradient_follow_megatrons_formula(balancing, score_function):
    layer = _layer(moe_router_load_balancing_type=balancing, moe_router_score_function=score_function)
    s, b = 6, 3
    logits = torch.randn(s * b, 8, generator=torch.Generator().manual_seed(1), requires_grad=True)
    ours = layer._balance_loss(logits, s, b)
    grad_ours, = torch.autograd.grad(ours, logits)

    probs = logits.softmax(-1) if score_function == "softmax" else logits.sigmoid() / logits.sigmoid().sum(-1, keepdim=True)
    chosen = probs.topk(2, dim=-1).indices
    if balancing == "aux_loss":
        want = 0.1 * _switch(probs, chosen, 2)
    else:  # rows are [seq, batch]: sequence j is every b-th row from j
        want = 0.1 * torch.stack([_switch(probs.view(s, b, 8)[:, j], chosen.view(s, b, 2)[:, j], 2) for j in range(b)]).mean()
    grad_want, = torch.autograd.grad(want, logits)
    torch.testing.assert_close(ours, want, rtol=1e-6, atol=0)
    torch.testing.assert_close(grad_ours, grad_want, rtol=1e-5, atol=1e-8)


def test_global_balance_loss_takes_the_fractions_of_the_steps_micro_batches_so_far():
    from hybridlm.parallel.moe import end_moe_step
    from hybridlm.parallel.state import SINGLE
    layer = _layer(moe_router_load_balancing_type="global_aux_loss")
    generator = torch.Generator().manual_seed(2)
    first, second = torch.randn(12, 8, generator=generator), torch.randn(12, 8, generator=generator)
    layer._balance_loss(first, 12, 1)
    got = layer._balance_loss(second, 12, 1)
    chosen = torch.cat([x.softmax(-1).topk(2, dim=-1).indices for x in (first, second)])
    fraction = torch.bincount(chosen.reshape(-1), minlength=8).float() / chosen.numel()
    torch.testing.assert_close(got, 0.1 * 8 * (second.softmax(-1).mean(0) * fraction).sum())
    end_moe_step(layer, SINGLE, 1e-3)  # a new step forgets the counts
    torch.testing.assert_close(layer._balance_loss(second, 12, 1), 0.1 * _switch(second.softmax(-1), chosen[12:], 2))


# ---------------------------------------------------------------- auxiliary-loss-free balancing

def test_expert_bias_moves_by_the_rate_towards_the_mean_load():
    from hybridlm.parallel.moe_routing import updated_expert_bias
    bias = torch.tensor([0.5, 0.0, -0.25, 0.0])
    counts = torch.tensor([5, 1, 3, 3])  # mean 3: expert 0 overloaded, expert 1 underloaded, 2 and 3 even
    assert updated_expert_bias(bias, counts, 0.125).tolist() == [0.375, 0.125, -0.25, 0.0]


def test_expert_bias_counts_the_kept_assignments_of_a_step_and_steers_the_next():
    from hybridlm.parallel.moe import end_moe_step
    from hybridlm.parallel.moe_routing import expert_counts, keep_mask, route
    from hybridlm.parallel.state import SINGLE
    layer = _layer(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True, moe_capacity_factor=1.0)
    x = torch.randn(8, 2, 16, generator=torch.Generator().manual_seed(3))
    layer(x)
    layer(x)
    with torch.no_grad():
        weights, index = layer.router(x).view(-1, 8).sigmoid().topk(2, dim=-1)
    kept = expert_counts(index, 8, keep_mask(index, weights / weights.sum(-1, keepdim=True), 8, 1.0, "probs"))
    assert layer.router.tokens_since_update.tolist() == (2 * kept).tolist()
    end_moe_step(layer, SINGLE, 0.5)
    assert layer.router.expert_bias.tolist() == (0.5 * torch.sign(kept.double().mean() - kept)).tolist()
    assert layer.router.tokens_since_update.sum() == 0
    with torch.no_grad():
        layer.router.expert_bias[5] = 10.0  # a bias beyond any score difference: every token takes expert 5
        logits = layer.router(x).view(-1, 8)
        weights, index = route(logits, layer.options, layer.router.expert_bias)
    assert (index == 5).any(-1).all()  # the bias chooses ...
    chosen = logits.sigmoid().gather(-1, index)  # ... and the weights stay the raw scores of the chosen, normalised
    torch.testing.assert_close(weights, chosen / chosen.sum(-1, keepdim=True))


# ---------------------------------------------------------------- every option at EP2 x TP2 x PP2 with SP

SEQ_AUX_SIGMOID_GROUPS = ("--moe-router-load-balancing-type", "seq_aux_loss", "--moe-router-score-function", "sigmoid",
                          "--num-experts", "8", "--moe-router-topk", "4", "--moe-router-num-groups", "4",
                          "--moe-router-group-topk", "2", "--moe-router-topk-scaling-factor", "2.5")
# One micro-batch per rank and step (global batch = micro-batch x DP): the single process then sees the
# same tokens in its one micro-batch as the DP group does together. A lower LR: at 1e-2 with micro-batches
# of 4 the third step's gradient norm jumps to ~30 (with any balancing loss, on main too), and there the
# layouts' fp32 rounding differences grow past 1e-5.
GLOBAL_AUX_PRE_SOFTMAX = ("--moe-router-load-balancing-type", "global_aux_loss", "--moe-router-pre-softmax", "--lr", "3e-3",
                          "--micro-batch-size", "4", "--global-batch-size", "4")
EXPERT_BIAS = ("--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
               "--moe-router-bias-update-rate", "0.05", "--moe-router-load-balancing-type", "none")
SHARED_GATE_DROP_PROBS = ("--moe-shared-expert-intermediate-size", "64", "--moe-shared-expert-gate",
                          "--moe-capacity-factor", "1.0", "--moe-token-drop-policy", "probs")


@pytest.mark.parametrize("variant", [
    pytest.param(SEQ_AUX_SIGMOID_GROUPS, id="seq_aux_sigmoid_groups_scaling"),
    pytest.param(GLOBAL_AUX_PRE_SOFTMAX, id="global_aux_pre_softmax"),
    pytest.param(EXPERT_BIAS, id="expert_bias"),
    pytest.param(SHARED_GATE_DROP_PROBS, id="shared_gate_drop_probs"),
])
def test_router_option_at_ep2_tp2_pp2_sp_matches_single_process(variant):
    single = reference(variant)
    if "--moe-router-enable-expert-bias" in variant:
        assert any(any(v != 0 for v in bias) for bias in single["expert_bias"].values())
    if "--moe-capacity-factor" in variant:
        assert all(m["dropped_fraction"] > 0.0 for m in single["moe"])
    if variant is GLOBAL_AUX_PRE_SOFTMAX:  # the parallel run's micro-batch is the single one's halved over DP
        variant = variant[:-4] + ("--micro-batch-size", "2", "--global-batch-size", "4")
    assert_matches(single, parallel(8, EP2 + TP2 + PP2 + SP, "zero1", variant))


@pytest.mark.parametrize("policy", ["position", "choice_then_position"])
def test_other_drop_policies_under_expert_parallelism_match_single_process(policy):
    variant = ("--moe-capacity-factor", "0.75", "--moe-token-drop-policy", policy)
    single, split = reference(variant), parallel(2, EP2, "zero1", variant)
    assert all(m["dropped_fraction"] > 0.05 for m in single["moe"])
    assert_matches(single, split)


def test_expert_bias_with_more_data_parallel_ranks_than_ep_matches_single_process():
    # DP=4 over EP=2: the step's counts must be summed over all four, not over an EP group.
    assert_matches(reference(EXPERT_BIAS), parallel(4, EP2, "zero1", EXPERT_BIAS))


def test_full_recompute_under_ep2_pp2_routes_counts_and_balances_once_per_micro_batch():
    # The recompute in backward routes again: the balance loss is taken there, the counts of the
    # log and the expert bias only in the first pass.
    variant = EXPERT_BIAS + ("--moe-router-load-balancing-type", "seq_aux_loss")
    single, split = reference(variant), parallel(4, EP2 + PP2 + ["--recompute-granularity", "full"], "zero1", variant)
    assert [m["layers"]["0"]["tokens_per_expert"] for m in split["moe"]] == [m["layers"]["0"]["tokens_per_expert"] for m in single["moe"]]
    assert_matches(single, split)


# ---------------------------------------------------------------- --moe-router-force-load-balancing (benchmarks)

FORCED = ("--moe-router-force-load-balancing",)


def test_forced_load_balancing_routes_evenly_whatever_the_router_prefers_and_trains_it_straight_through():
    x = torch.rand(400, 2, 16, generator=torch.Generator().manual_seed(0)) + 0.5
    loads = {}
    for forced in (False, True):
        layer = _tiny_layer(moe_router_force_load_balancing=forced)
        with torch.no_grad():
            layer.router.weight.zero_()
            layer.router.weight[0] = 5.0  # expert 0 has every token's largest logit; expert 1..3 tie
        layer(x).sum().backward()
        loads[forced] = layer.stats.pop("cpu")[:4]
        assert torch.isfinite(layer.router.weight.grad).all() and layer.router.weight.grad.abs().sum() > 0
    assert loads[False][0] == 800, "the test's router sends all 800 tokens to expert 0"
    # 800 tokens x top-2 of 4: each expert's count has mean 400 and standard deviation ~14 under fair draws. Over
    # 300 seeds max/mean reached 1.11, so the bound of 1.2 (~5.7 deviations) holds for any seed, not a lucky one.
    assert loads[True].sum() == 1600 and loads[True].max() / loads[True].mean() < 1.2, loads[True]


def test_forced_load_balancing_draws_the_same_logits_when_recomputed_and_on_every_tp_rank():
    # The draws come from the default stream, which DeepSpeed's checkpoint restores for the recompute and which is
    # seeded alike on the TP ranks (without SP every TP rank routes the whole micro-batch and must agree).
    single = reference(FORCED)
    assert_matches(single, parallel(1, RECOMPUTE_MOE, "zero0", FORCED))
    assert_matches(single, parallel(2, TP2, "zero1", FORCED))
