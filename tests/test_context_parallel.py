"""Context parallelism's pieces against their single-process definitions: the layout, the
log-sum-exp block kernel, and ring / all-to-all / all-gather attention, forward and backward,
equal to full causal attention on random q, k, v (gloo, fp32)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from harness import run_ranks
from oracle import assert_matches
from hybridlm.model.attention_backends import MathBlockAttention
from hybridlm.parallel.context import kv_replication, load_balanced_positions, merge_blocks, slice_for_rank
from hybridlm.parallel.state import layout_groups


def test_cp_sits_between_tp_and_dp_in_the_rank_order():
    groups = {kind: sorted(lists) for kind, lists in layout_groups(tp=2, pp=2, dp=2, cp=2).items()}
    assert groups["tp"][:2] == [[0, 1], [2, 3]]
    assert groups["cp"][:4] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert groups["dp"][:4] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert groups["grad_reduction"][:2] == [[0, 2, 4, 6], [1, 3, 5, 7]]  # what DeepSpeed averages gradients over
    assert groups["pp"][0] == [0, 8]
    with_ep = layout_groups(tp=1, pp=1, dp=1, cp=2, ep=2)
    assert with_ep["ep"] == [[0, 1]] and with_ep["expert_dp"] == [[0], [1]]  # EP is carved out of DP x CP


def test_rank_i_holds_chunks_i_and_2n_minus_1_minus_i():
    assert load_balanced_positions(16, 0, 2).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert load_balanced_positions(16, 1, 2).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    every = torch.cat([load_balanced_positions(24, r, 3) for r in range(3)])
    assert sorted(every.tolist()) == list(range(24))
    tokens = torch.arange(8).view(1, 8)
    assert slice_for_rank(tokens, 1, 1, 2).tolist() == [[2, 3, 4, 5]]


def test_a_batch_is_sliced_alike_in_everything_it_carries_but_per_row_values():
    # ((tokens, position ids), (labels, DPO pair ids)): every [rows, seq] tensor keeps the rank's
    # positions, the [rows] pair ids stay whole.
    from hybridlm.data.samples import context_slice
    rows = torch.arange(16).view(2, 8)
    (tokens, positions), (labels, pair_ids) = context_slice(((rows, rows % 8), (rows + 100, torch.tensor([5, 9]))), 1, 2)
    assert tokens.tolist() == [[2, 3, 4, 5], [10, 11, 12, 13]] and positions.tolist() == [[2, 3, 4, 5]] * 2
    assert labels.tolist() == [[102, 103, 104, 105], [110, 111, 112, 113]] and pair_ids.tolist() == [5, 9]


def test_kv_heads_are_replicated_only_as_far_as_cp_needs():
    assert [kv_replication(groups, 4) for groups in (1, 2, 4, 8)] == [4, 2, 1, 1]
    assert kv_replication(2, 3) == 3  # lcm(2, 3) = 6 heads of K/V, two per rank


def _random_qkv(seq: int, heads: int, groups: int, seed: int = 0, dim: int = 8, batch: int = 2):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(seq, batch, heads, dim, generator=generator, dtype=torch.float64)
    k = torch.randn(seq, batch, groups, dim, generator=generator, dtype=torch.float64)
    v = torch.randn(seq, batch, groups, dim, generator=generator, dtype=torch.float64)
    dout = torch.randn(seq, batch, heads, dim, generator=generator, dtype=torch.float64)
    return q, k, v, dout


def _full_attention(q, k, v, dout):
    """Causal attention through torch's SDPA (autograd): output and the gradients of <out, dout>."""
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(*(t.permute(1, 2, 0, 3) for t in (q, k, v)), is_causal=True,
                                         enable_gqa=q.shape[2] != k.shape[2]).permute(2, 0, 1, 3)
    (out * dout).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


@pytest.mark.parametrize("heads, groups", [(4, 4), (4, 2)], ids=["mha", "gqa"])
def test_block_kernel_merged_by_lse_equals_full_attention_forward_and_backward(heads, groups):
    # Queries 8..15 against keys 0..7 (no mask) and 8..15 (causal), merged: the last 8 rows of
    # causal attention over 16; the backward of each block, given the merged output and lse,
    # adds up to the full gradients.
    q, k, v, dout = _random_qkv(16, heads, groups)
    want, dq, dk, dv = _full_attention(q, k, v, dout)
    kernel, rows = MathBlockAttention(), slice(8, 16)
    out_a, lse_a = kernel.forward(q[rows], k[:8], v[:8], causal=False)
    out_b, lse_b = kernel.forward(q[rows], k[rows], v[rows], causal=True)
    out, lse = merge_blocks(out_a, lse_a, out_b, lse_b)
    torch.testing.assert_close(out.double(), want[rows], rtol=1e-5, atol=1e-6)
    grads_a = kernel.backward(dout[rows], q[rows], k[:8], v[:8], out.double(), lse, causal=False)
    grads_b = kernel.backward(dout[rows], q[rows], k[rows], v[rows], out.double(), lse, causal=True)
    torch.testing.assert_close((grads_a[0] + grads_b[0]).double(), dq[rows], rtol=1e-5, atol=1e-6)
    # keys 0..7 also get gradient from queries 0..7 (not computed here): compare keys 8..15 only
    torch.testing.assert_close(grads_b[1].double(), dk[rows], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grads_b[2].double(), dv[rows], rtol=1e-5, atol=1e-6)


CASES = [(12, 12), (12, 2)]  # MHA, and GQA with fewer K/V heads than some CP sizes (a2a replicates them)


def _cp_attention_on_rank(seq: int) -> dict:
    """Every comm type and head layout on this rank's slice; returns max errors against full attention."""
    import torch.distributed as dist
    from hybridlm.parallel.context import ContextParallelAttention
    from hybridlm.parallel.state import ParallelState
    from hybridlm.model.attention_backends import sdpa_attention
    from hybridlm.training.distributed import init_distributed
    init_distributed(1)
    ps = ParallelState(cp=dist.get_world_size())
    cp = ps.cp
    errors = {}
    for heads, groups in CASES:
        q, k, v, dout = _random_qkv(seq, heads, groups, seed=heads + groups)
        want = _full_attention(q, k, v, dout)
        mine = [slice_for_rank(t, 0, cp.rank, cp.size) for t in (q, k, v, dout)]
        for comm in ("p2p", "a2a", "allgather"):
            attention = ContextParallelAttention(cp, comm, sdpa_attention, MathBlockAttention())
            q_, k_, v_ = (t.clone().requires_grad_() for t in mine[:3])
            out = attention(q_, k_, v_)
            (out * mine[3]).sum().backward()
            got = (out.detach(), q_.grad, k_.grad, v_.grad)
            errors[(comm, heads, groups)] = [float((g - slice_for_rank(w, 0, cp.rank, cp.size)).abs().max())
                                             for g, w in zip(got, want)]
    return errors


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_ring_a2a_and_allgather_attention_equal_full_causal_attention_forward_and_backward(cp):
    for rank, errors in enumerate(run_ranks(cp, _cp_attention_on_rank, 8 * cp, timeout=120)):
        for (comm, heads, groups), (out, dq, dk, dv) in errors.items():
            assert max(out, dq, dk, dv) < 1e-10, (f"CP={cp} rank {rank} {comm} heads {heads} groups {groups}: "
                                                  f"max errors out {out:.1e} dq {dq:.1e} dk {dk:.1e} dv {dv:.1e}")


# ---------------------------------------------------------------- every CP layout equals one process

CP2, CP4 = ["--context-parallel-size", "2"], ["--context-parallel-size", "4"]
A2A, ALLGATHER = ["--cp-comm-type", "a2a"], ["--cp-comm-type", "allgather"]
TP2, PP2, EP2 = ["--tensor-model-parallel-size", "2"], ["--pipeline-model-parallel-size", "2"], ["--expert-model-parallel-size", "2"]


@pytest.mark.parametrize("world, layout, zero", [
    pytest.param(2, CP2, "zero0", id="cp2_p2p"),
    pytest.param(4, CP4, "zero1", id="cp4_p2p"),
    pytest.param(2, CP2 + A2A, "zero1", id="cp2_a2a"),
    pytest.param(4, CP4 + A2A, "zero0", id="cp4_a2a_kv_heads_replicated"),
    pytest.param(2, CP2 + ALLGATHER, "zero1", id="cp2_allgather"),
    pytest.param(4, TP2 + CP2 + ["--sequence-parallel"], "zero1", id="tp2_cp2_sp"),
    pytest.param(4, PP2 + CP2, "zero1", id="pp2_cp2"),
    pytest.param(4, PP2 + CP2 + ALLGATHER, "zero1", id="pp2_cp2_allgather"),
    pytest.param(4, CP4 + A2A, "zero3", id="cp4_a2a_zero3"),
    pytest.param(4, CP2, "zero2", id="cp2_dp2_zero2"),
    pytest.param(4, CP2, "zero3", id="cp2_dp2_zero3"),
    pytest.param(4, TP2 + CP2 + ["--recompute-granularity", "full"], "zero1", id="tp2_cp2_recompute_partitioned"),
    pytest.param(2, CP2 + ["--recompute-granularity", "selective"], "zero1", id="cp2_selective_recompute"),
])
def test_context_parallel_layout_matches_single_process(world, layout, zero):
    from test_oracle import parallel, reference
    assert_matches(reference(), parallel(world, layout, zero))


# Adam's eps at 1e-4: with 1e-8, gradient entries near eps turn CP's last-bit differences (the ring sums in
# another order) into visible parameter differences by step 3 (1.6e-4 in the grad norm with sigmoid scores
# and seq_aux_loss, 3.5e-7 with this eps; EP2 alone shows 2.4e-5 there too), while a wrong reduction moves
# the losses and the biases at step 1.
EXPERT_BIAS_SEQ_AUX = ("--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
                       "--moe-router-bias-update-rate", "0.05", "--moe-router-load-balancing-type", "seq_aux_loss",
                       "--adam-eps", "1e-4")


@pytest.mark.parametrize("world, variant", [
    pytest.param(2, (), id="aux_loss"),
    pytest.param(2, ("--moe-router-load-balancing-type", "global_aux_loss"), id="global_aux_loss"),
    pytest.param(4, EXPERT_BIAS_SEQ_AUX, id="dp2_expert_bias_seq_aux_loss"),
])
def test_cp2_ep2_moe_routes_local_tokens_with_the_single_process_balancing(world, variant):
    # EP carved out of DP x CP: the two CP ranks of one sample are also the two EP ranks. The balance
    # losses see whole sequences (their sums over CP); the global loss's counts and the expert bias's
    # load are summed over DP x CP, so every rank moves the bias as one process does.
    from test_moe import parallel, reference
    want, got = reference(variant), parallel(world, CP2 + EP2, "zero1", variant)
    if "--moe-router-enable-expert-bias" in variant:
        assert any(any(v != 0 for v in bias) for bias in want["expert_bias"].values())
    assert [m["layers"]["0"]["tokens_per_expert"] for m in got["moe"]] == [m["layers"]["0"]["tokens_per_expert"] for m in want["moe"]]
    assert_matches(want, got)  # losses, aux and z losses, expert biases, grad norms, gradients


# ---------------------------------------------------------------- checkpoints across CP sizes

def test_cp2_checkpoint_resumes_exactly_and_continues_at_cp1_and_cp4_with_the_same_losses(tmp_path_factory):
    # Weights are replicated over CP, so another CP size is another data-parallel layout: the
    # reshaping loader carries weights, fp32 masters, Adam moments, step and schedule.
    from interop_runs import BASE, saved_run, train
    from oracle import ds_config
    directory, first = saved_run(tmp_path_factory.mktemp("cp_runs"), 2, CP2, "zero1")

    def continued(world: int, layout: list[str]) -> dict:
        return run_ranks(world, train, BASE + layout + ds_config("zero1") + ["--train-iters", "4", "--load", directory], 2)[0]

    unchanged = continued(2, CP2)
    whole = run_ranks(2, train, BASE + CP2 + ds_config("zero1") + ["--train-iters", "4"], 4)[0]
    assert first["losses"] + unchanged["losses"] == whole["losses"]  # the same CP: bit for bit
    for world, layout in ((1, []), (4, CP4)):
        other = continued(world, layout)
        assert other["start"] == 2
        for step, (got, want) in enumerate(zip(other["losses"], unchanged["losses"]), start=3):
            assert abs(got - want) <= 1e-5 * abs(want), f"CP={world} step {step}: loss {got!r} != {want!r} at CP=2"


# ---------------------------------------------------------------- refusals, before any process group

@pytest.mark.parametrize("world, flags, sentence", [
    (2, ["--seq-length", "30"], "--seq-length 30 is not divisible by 2 x CP = 4"),
    (8, ["--seq-length", "36", "--tensor-model-parallel-size", "4", "--num-query-groups", "4", "--sequence-parallel"],
     "--seq-length 36 / CP 2 = 18 tokens per CP rank is not divisible by --tensor-model-parallel-size 4"),
    (8, ["--tensor-model-parallel-size", "2", "--context-parallel-size", "4", "--cp-comm-type", "a2a"],
     "--cp-comm-type a2a cannot split 2 attention heads per TP rank"),
    (3, [], "world size 3 is not a multiple of TP x PP x CP = 1 x 1 x 2"),
    (2, ["--position-embedding-type", "learned_absolute"], "--context-parallel-size 2 cannot be combined with --position-embedding-type learned_absolute: use rope"),
    (2, ["--attention-dropout", "0.1"], "--attention-dropout 0.1 with --cp-comm-type p2p"),
    (2, ["--torch-compile"], "cannot be combined with --torch-compile"),
    (2, ["--attention-backend", "te"], "cannot be combined with --attention-backend te"),
    (2, ["--num-experts", "4", "--moe-capacity-factor", "1.0"], "use dropless routing"),
    (2, ["--task", "sft", "--packing"], "--packing with --cp-comm-type p2p: its block-wise attention cannot keep packed samples apart; use --cp-comm-type a2a"),
    (2, ["--num-experts", "4", "--expert-model-parallel-size", "4"], "--expert-model-parallel-size 4 does not divide DP x CP = 1 x 2"),
])
def test_bad_cp_layout_is_one_sentence_naming_the_flag(world, flags, sentence):
    from hybridlm.config import ConfigError, parse_args
    from oracle import TINY
    with pytest.raises(ConfigError) as refused:
        parse_args(TINY + CP2 + flags).validate(world_size=world)
    assert sentence in str(refused.value) and str(refused.value).count(". ") == 0, str(refused.value)
