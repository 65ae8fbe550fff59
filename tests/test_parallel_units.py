"""The building blocks, each against its single-process definition."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from harness import run_ranks
from oracle import TINY, ds_config
from hybridlm.presets import LLAMA_BLOCK_SETTINGS
from hybridlm.parallel.state import layout_groups
from hybridlm.parallel.tensor_parallel import Sharding


def test_tp_is_innermost_then_dp_then_pp():
    groups = layout_groups(tp=2, pp=2, dp=2)
    assert groups["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert groups["dp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert groups["pp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_expert_groups_are_carved_out_of_each_dp_group():
    groups = layout_groups(tp=1, pp=1, dp=4, ep=2)
    assert groups["ep"] == [[0, 1], [2, 3]]
    assert groups["expert_dp"] == [[0, 2], [1, 3]]
    with_tp = layout_groups(tp=2, pp=1, dp=4, ep=2)
    assert with_tp["ep"] == [[0, 2], [4, 6], [1, 3], [5, 7]]
    assert with_tp["expert_dp"] == [[0, 4], [2, 6], [1, 5], [3, 7]]


def test_blockwise_sharding_round_trips_and_keeps_each_block_split():
    full = torch.arange(12.0).reshape(6, 2)  # blocks of 4 rows (q) and 2 rows (k)
    sharding = Sharding(dim=0, blocks=(4, 2))
    shards = [sharding.shard(full, r, 2) for r in range(2)]
    assert shards[0].tolist() == [[0, 1], [2, 3], [8, 9]]  # q rows 0-1, k row 0
    assert shards[1].tolist() == [[4, 5], [6, 7], [10, 11]]
    assert torch.equal(sharding.unshard(shards), full)


def _vocab_parallel_ce(seed: int):
    import torch.distributed as dist
    from hybridlm.parallel.state import ParallelState
    from hybridlm.parallel.tensor_parallel import vocab_parallel_cross_entropy
    from hybridlm.training.distributed import init_distributed
    init_distributed(1)
    ps = ParallelState(tp=dist.get_world_size())
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(5, 3, 64, generator=generator, dtype=torch.float64)
    target = torch.randint(0, 64, (5, 3), generator=generator)
    local = logits.chunk(ps.tp.size, dim=-1)[ps.tp.rank].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(local, target, ps.tp)
    loss.sum().backward()
    return loss.detach(), local.grad, logits, target


@pytest.mark.parametrize("tp", [2, 4])
def test_vocab_parallel_cross_entropy_equals_full_softmax(tp):
    results = run_ranks(tp, _vocab_parallel_ce, int(torch.randint(0, 2**31, ()).item()))
    loss, _, logits, target = results[0]
    full = logits.clone().requires_grad_()
    want = F.cross_entropy(full.reshape(-1, 64), target.reshape(-1), reduction="none").reshape(5, 3)
    want.sum().backward()
    assert torch.allclose(loss, want.detach(), rtol=1e-10, atol=1e-12)
    grad = torch.cat([r[1] for r in results], dim=-1)
    assert torch.allclose(grad, full.grad, rtol=1e-10, atol=1e-12)


def test_bf16_cross_entropy_leaves_the_logits_alone():
    """The loss keeps the caller's bf16 logits for its backward (no fp32 copy of them): it must not
    change them."""
    from hybridlm.parallel.state import SINGLE
    from hybridlm.parallel.tensor_parallel import IGNORE_INDEX, vocab_parallel_cross_entropy
    generator = torch.Generator().manual_seed(3)
    logits = (3 * torch.randn(4, 5, 40, generator=generator)).bfloat16().requires_grad_()
    target = torch.randint(0, 37, (4, 5), generator=generator)
    target[0, 0] = IGNORE_INDEX
    before = logits.detach().clone()
    loss = vocab_parallel_cross_entropy(logits, target, SINGLE, vocab_size=37)
    loss.sum().backward()
    assert torch.equal(logits.detach(), before)
    full = before.float()[..., :37].requires_grad_()
    want = F.cross_entropy(full.reshape(-1, 37), target.reshape(-1), reduction="none").reshape(4, 5)
    want.sum().backward()
    assert torch.allclose(loss, want.detach(), rtol=1e-6, atol=1e-6)
    assert torch.allclose(logits.grad.float()[..., :37], full.grad, atol=1e-2) and not logits.grad[..., 37:].any()


def _full_initial_weights(flags: list[str]) -> dict:
    from hybridlm.config import parse_args
    from hybridlm.model.weights import gather_full_state_dict
    from hybridlm.training.trainer import build_run, prepare_config
    cfg, ds = prepare_config(parse_args(flags))
    run = build_run(cfg, ds)
    module = run.engine.module
    local = {name: p.detach() for name, p in module.named_parameters()}
    return gather_full_state_dict(local, module, run.ps.tp, run.ps.dp)


def test_same_seed_gives_same_full_model_at_any_tp_and_pp():
    single = run_ranks(1, _full_initial_weights, TINY + ds_config("zero0"))[0]
    split = run_ranks(4, _full_initial_weights, TINY + ["--tensor-model-parallel-size", "2",
                                                        "--pipeline-model-parallel-size", "2"] + ds_config("zero0"))[0]
    assert set(split) == set(single)
    for name, tensor in single.items():
        assert torch.equal(split[name], tensor), name
    other_seed = run_ranks(1, _full_initial_weights, TINY + ["--seed", "8"] + ds_config("zero0"))[0]
    assert not torch.equal(other_seed["1.attention.qkv.weight"], single["1.attention.qkv.weight"])


def test_full_recompute_marks_first_layers_of_each_stage():
    from hybridlm.config import ModelConfig
    from hybridlm.model.execution import apply_recompute
    from hybridlm.model.specs import build_model
    from hybridlm.parallel.plan import LayerFactory
    cfg = ModelConfig(num_layers=4, hidden_size=32, num_attention_heads=2, vocab_size=256, **LLAMA_BLOCK_SETTINGS)
    cfg.padded_vocab_size = 256
    model = build_model(cfg, LayerFactory())
    assert apply_recompute(model, 3) == 3
    flags = model.layer_steps.recomputed()
    assert flags == [True, True, True, False]


def test_recomputed_packed_layers_see_the_sample_starts_the_packer_attached_in_forward_and_in_backward():
    # DeepSpeed's checkpoint hands the recompute detached copies of its tensor inputs, and a copy of the position
    # ids loses the sample starts the packer attached to them: every recomputed layer then found them on the device
    # (a host sync, and a graph break in each compiled layer). The ids must reach the recompute as they came.
    from hybridlm.config import ModelConfig
    from hybridlm.model.attention_backends import SAMPLE_STARTS, attach_sample_starts
    from hybridlm.model.execution import apply_recompute
    from hybridlm.model.specs import build_model
    from hybridlm.parallel.plan import LayerFactory
    cfg = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=2, vocab_size=256, packed_samples=True,
                      **LLAMA_BLOCK_SETTINGS)
    cfg.padded_vocab_size = 256
    model = build_model(cfg, LayerFactory()).train()
    assert apply_recompute(model, None) == 2
    seen = []
    for layer in model.layer_steps.layers:
        def attend(q, k, v, positions=None, inner=layer.attention.attend):
            seen.append(getattr(positions, SAMPLE_STARTS, None))
            return inner(q, k, v, positions)
        layer.attention.attend = attend
    positions = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4], [0, 1, 2, 3, 4, 5, 0, 1]])
    starts = torch.tensor([0, 3, 8, 14, 16], dtype=torch.int32)
    attach_sample_starts(positions, starts)
    x = torch.randn(8, 2, 32, requires_grad=True)
    out, _ = model.layer_steps((x, positions))
    out.square().sum().backward()
    assert len(seen) == 4, "each layer attends once in forward and once in its recompute"
    assert all(found is starts for found in seen), "a recomputed layer was handed ids without their sample starts"
    assert x.grad is not None and all(p.grad is not None for p in model.layer_steps.layers[0].parameters())


def test_torch_compile_compiles_every_transformer_layer_into_one_shared_graph():
    # The oracle shows compiled layers compute the eager function (Inductor's code: test_oracle.py, test_moe.py);
    # this shows they really are compiled, into one graph that every layer shares. Which graphs dynamo captures and
    # when it recompiles is dynamo's guards', whatever backend receives them: aot_eager runs dynamo and AOTAutograd
    # (forward and backward traced) as Inductor's front half does, without Inductor's C++ compile of each kernel
    # (~20 s of a cold cache's CPU here, for code this test does not read).
    import torch._dynamo.utils as dynamo_utils

    from hybridlm.config import ModelConfig
    from hybridlm.model.execution import compile_layers
    from hybridlm.model.specs import build_model
    from hybridlm.parallel.plan import LayerFactory
    torch._dynamo.reset()
    dynamo_utils.counters.clear()
    cfg = ModelConfig(num_layers=3, hidden_size=32, num_attention_heads=2, vocab_size=256, seq_length=16, **LLAMA_BLOCK_SETTINGS)
    cfg.padded_vocab_size = 256
    model = build_model(cfg, LayerFactory())
    assert compile_layers(model, backend="aot_eager") == 3
    tokens = torch.randint(0, 256, (2, 16))
    model(tokens, tokens).backward()
    assert dynamo_utils.counters["stats"]["unique_graphs"] == 1, dict(dynamo_utils.counters["stats"])


def _graphs_of_compiled_layers_computing_the_eager_step(cfg, make_factory, inputs, labels) -> list[list[str]]:
    """One step of the model eager and one with its layers compiled (by a backend that records each graph's call
    targets), from the same weights: the same loss and gradients (asserted); the compiled run's graphs."""
    from hybridlm.model.execution import compile_layers
    from hybridlm.model.specs import build_model
    from hybridlm.model.weights import init_parameters
    from hybridlm.parallel.state import SINGLE

    results = {}
    for compiled in (False, True):
        model = build_model(cfg, make_factory())
        init_parameters(model, 5, SINGLE)
        graphs = []

        def record(gm, example_inputs):
            graphs.append([str(node.target) for node in gm.graph.nodes if node.op == "call_function"])
            return gm.forward
        if compiled:
            torch._dynamo.reset()
            compile_layers(model, backend=record)
        loss = model(inputs, labels)
        loss.backward()
        results[compiled] = (loss.item(), {n: p.grad for n, p in model.named_parameters()}, graphs)
    (loss, grads, _), (compiled_loss, compiled_grads, graphs) = results[False], results[True]
    assert compiled_loss == pytest.approx(loss, rel=1e-6)
    for name, grad in grads.items():
        assert torch.allclose(compiled_grads[name], grad, rtol=1e-5, atol=1e-7), name
    return graphs


@pytest.mark.parametrize("carried", [False, True], ids=["row_index_positions", "positions_from_the_batch"])
def test_compiled_layers_take_ropes_tables_from_one_opaque_op_and_trace_no_cos_or_sin(carried):
    # Traced, RoPE's cos/sin were inlined by Inductor into every element of the rotation reading them, forward and
    # backward (batch x heads times their work: 227 ms of the reference model's 1,197 ms FP8 step on an H200). The
    # graph Inductor receives must hold the tables as one opaque op, shared by q and k, and no cos or sin; the loss
    # and gradients stay the eager ones.
    from hybridlm.config import ModelConfig
    from hybridlm.parallel.plan import LayerFactory

    cfg = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=2, vocab_size=256, seq_length=16, **LLAMA_BLOCK_SETTINGS)
    cfg.padded_vocab_size = 256
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    inputs = (tokens, torch.arange(16).repeat(2, 1) + 3) if carried else tokens
    graphs = _graphs_of_compiled_layers_computing_the_eager_step(cfg, LayerFactory, inputs, tokens)
    assert len(graphs) == 1, graphs
    targets = graphs[0]
    assert sum("rotary_tables" in target for target in targets) == 1, targets
    assert not [target for target in targets if target.rsplit(".", 1)[-1] in ("cos", "sin", "pow")], targets


def test_with_gemms_outside_the_graphs_a_layer_compiles_only_what_lies_between_them():
    # Transformer Engine's GEMMs cannot be traced; compiling the whole layer around them would give
    # a graph per fragment (down to a lone residual add). Stand-ins: PyTorch GEMMs kept out of the graph.
    from hybridlm.config import ModelConfig
    from hybridlm.parallel.plan import LayerFactory, LocalOps

    def matmul(weight, bias):
        return torch.compiler.disable(lambda x: F.linear(x, weight, bias))

    def norm_matmul(norm, weight, bias):
        return torch.compiler.disable(lambda x: F.linear(norm(x), weight, bias))

    def norm_mlp(norm, fc1_weight, fc2_weight, activation):
        def block(x):
            gate, up = F.linear(norm(x), fc1_weight).chunk(2, dim=-1)
            return F.linear(F.silu(gate) * up, fc2_weight)
        return torch.compiler.disable(block)

    cfg = ModelConfig(num_layers=3, hidden_size=32, num_attention_heads=2, vocab_size=256, seq_length=16, **LLAMA_BLOCK_SETTINGS)
    cfg.padded_vocab_size = 256
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    graphs = _graphs_of_compiled_layers_computing_the_eager_step(
        cfg, lambda: LayerFactory(ops=LocalOps(matmul=matmul, norm_matmul=norm_matmul, norm_mlp=norm_mlp)), tokens, tokens)
    assert len(graphs) == 1, graphs  # attention's middle, shared by the three layers
    assert any("scaled_dot_product_attention" in target for target in graphs[0]), graphs[0]


def _compiled_tp_graphs(flags: list[str]) -> list[list[str]]:
    """Train one micro-batch with compiled layers under TP; return each captured graph's call targets."""
    import torch.distributed as dist

    from hybridlm.config import parse_args
    from hybridlm.model.execution import compile_layers
    from hybridlm.model.specs import build_model
    from hybridlm.parallel.plan import LayerFactory, ModelGroups
    from hybridlm.parallel.state import GroupHandle
    from hybridlm.training.trainer import prepare_config
    dist.init_process_group("gloo")
    cfg, _ = prepare_config(parse_args(flags))
    tp = GroupHandle(dist.group.WORLD, dist.get_rank(), dist.get_world_size())
    model = build_model(cfg.model, LayerFactory(ModelGroups(tp=tp), sequence_parallel=True))
    graphs = []

    def record(gm, example_inputs):
        graphs.append([str(node.target) for node in gm.graph.nodes if node.op == "call_function"])
        return gm.forward

    torch._dynamo.reset()
    compile_layers(model, backend=record)
    tokens = torch.randint(0, cfg.model.padded_vocab_size, (2, cfg.model.seq_length))
    model(tokens, tokens).backward()
    dist.destroy_process_group()
    return graphs


def test_compiled_layers_under_tp_keep_every_collective_out_of_the_graphs():
    # On NCCL, collectives traced into compiled graphs gave wrong gradients; the layers must
    # compile around them (several graphs per layer, none holding a collective).
    graphs = run_ranks(2, _compiled_tp_graphs, TINY + ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
                       + ds_config("zero0"))[0]
    assert len(graphs) >= 3, f"expected the layers to compile in pieces, got {len(graphs)} graph(s)"
    assert any("linear" in target for graph in graphs for target in graph), "no matmul was compiled"
    collectives = [t for graph in graphs for t in graph if any(word in t for word in ("all_gather", "reduce_scatter", "all_reduce", "c10d"))]
    assert not collectives, collectives


def _norm_fused_into_linears_vs_separate(flags: list[str]) -> dict:
    """Loss and gradients of one micro-batch, with the norms applied separately, with each fused
    into the column linear after it (a PyTorch stand-in for TE's LayerNormLinear), and with the
    MLP's norm fused into a whole norm + MLP block (a stand-in for TE's LayerNormMLP)."""
    import torch.distributed as dist

    from hybridlm.config import parse_args
    from hybridlm.model.specs import build_model
    from hybridlm.model.weights import init_parameters
    from hybridlm.parallel.plan import LayerFactory, LocalOps, ModelGroups
    from hybridlm.parallel.state import GroupHandle
    from hybridlm.training.trainer import prepare_config
    dist.init_process_group("gloo")
    cfg, _ = prepare_config(parse_args(flags))
    tp = GroupHandle(dist.group.WORLD, dist.get_rank(), dist.get_world_size())

    def norm_then_linear(norm, weight, bias):
        return lambda x: F.linear(norm(x), weight, bias)

    def norm_then_mlp(norm, fc1_weight, fc2_weight, activation):
        assert activation == "swiglu", activation
        def block(x):
            gate, up = F.linear(norm(x), fc1_weight).chunk(2, dim=-1)
            return F.linear(F.silu(gate) * up, fc2_weight)
        return block

    tokens = torch.randint(0, cfg.model.padded_vocab_size, (2, cfg.model.seq_length), generator=torch.Generator().manual_seed(0))
    results = {}
    variants = (("separate", {}), ("fused", dict(norm_matmul=norm_then_linear)),
                ("fused block", dict(norm_matmul=norm_then_linear, norm_mlp=norm_then_mlp)))
    for name, factories in variants:
        model = build_model(cfg.model, LayerFactory(ModelGroups(tp=tp), ops=LocalOps(**factories)))
        init_parameters(model, 1234, tp)
        loss = model(tokens, tokens)
        loss.backward()
        owners = sorted(type(m).__name__ for m in model.modules() if getattr(m, "owns_norm", False))
        results[name] = (loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}, owners)
    dist.destroy_process_group()
    return results


def test_a_norm_fused_into_the_next_linear_or_mlp_computes_the_same_loss_and_gradients_under_tp():
    # Under TP each rank back-propagates only its columns into a fused norm: its gradient must be
    # summed over TP (the un-fused norm sees the already-summed input gradient).
    results = run_ranks(2, _norm_fused_into_linears_vs_separate, TINY + ["--tensor-model-parallel-size", "2"] + ds_config("zero0"))
    owners_expected = {"fused": {"ColumnParallelLinear": 8, "MLP": 4},  # QKV and fc1 in each of 4 layers
                       "fused block": {"ColumnParallelLinear": 4, "MLP": 4}}  # QKV, and the whole MLP
    for rank, result in enumerate(results):
        loss, grads, _ = result["separate"]
        for variant, expected in owners_expected.items():
            fused_loss, fused_grads, owners = result[variant]
            assert {k: owners.count(k) for k in set(owners)} == expected, (variant, owners)
            assert abs(loss - fused_loss) < 1e-6, (variant, loss, fused_loss)
            for name, grad in grads.items():
                assert torch.allclose(fused_grads[name], grad, rtol=1e-5, atol=1e-7), (variant, rank, name)


def _padded_vocab_cross_entropy(vocab: int, padded: int) -> dict:
    import torch.distributed as dist

    from hybridlm.parallel.state import GroupHandle
    from hybridlm.parallel.tensor_parallel import vocab_parallel_cross_entropy
    dist.init_process_group("gloo")
    tp = GroupHandle(dist.group.WORLD, dist.get_rank(), dist.get_world_size())
    generator = torch.Generator().manual_seed(3)
    full = torch.randn(6, padded, generator=generator, dtype=torch.float64)
    target = torch.randint(0, vocab, (6,), generator=generator)
    per_rank = padded // tp.size
    local = full[:, tp.rank * per_rank:(tp.rank + 1) * per_rank].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(local, target, tp, vocab)
    loss.sum().backward()
    dist.destroy_process_group()
    return {"loss": loss.detach(), "grad": local.grad, "full": full, "target": target}


def test_vocab_parallel_cross_entropy_leaves_the_padding_out_even_on_a_rank_holding_only_padding():
    # vocab 300 over 4 ranks of 128 columns: rank 2 holds 44 real columns, rank 3 none.
    results = run_ranks(4, _padded_vocab_cross_entropy, 300, 512)
    full = results[0]["full"][:, :300].clone().requires_grad_()
    want = F.cross_entropy(full, results[0]["target"], reduction="none")
    want.sum().backward()
    got_grad = torch.cat([r["grad"] for r in results], dim=1)
    for rank, r in enumerate(results):
        assert torch.allclose(r["loss"], want.detach(), rtol=1e-12), f"rank {rank}: {r['loss']} vs {want}"
    assert torch.allclose(got_grad[:, :300], full.grad, rtol=1e-12, atol=1e-15)
    assert not got_grad[:, 300:].any(), "padding columns got a gradient"


def test_cross_entropy_in_chunks_of_rows_equals_the_full_softmax(monkeypatch):
    """The statistics and the gradient are computed a few rows at a time (no fp32 copy of all the
    logits): chunks of any size give the loss and gradient of the whole softmax."""
    from hybridlm.parallel import tensor_parallel
    from hybridlm.parallel.state import SINGLE
    generator = torch.Generator().manual_seed(5)
    logits = torch.randn(7, 3, 50, generator=generator, dtype=torch.float64)
    target = torch.randint(0, 45, (7, 3), generator=generator)
    target[2, 1] = tensor_parallel.IGNORE_INDEX
    full = logits.clone().requires_grad_()
    want = F.cross_entropy(full[..., :45].reshape(-1, 45), target.reshape(-1), reduction="none",
                           ignore_index=tensor_parallel.IGNORE_INDEX).reshape(7, 3)
    want.sum().backward()
    for rows_per_chunk in (1, 4, 100):
        monkeypatch.setattr(tensor_parallel, "_CHUNK_ELEMENTS", rows_per_chunk * 45)
        ours = logits.clone().requires_grad_()
        loss = tensor_parallel.vocab_parallel_cross_entropy(ours, target, SINGLE, vocab_size=45)
        loss.sum().backward()
        assert torch.allclose(loss, want.detach(), rtol=1e-10, atol=1e-12)
        assert torch.allclose(ours.grad, full.grad, rtol=1e-10, atol=1e-12)
