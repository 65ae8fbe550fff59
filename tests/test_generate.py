"""Generation: the KV-cache decoder computes what the full forward computes, greedy decoding of
a checkpoint under TP=2 (scripts/generate.py through torchrun) equals transformers' ``generate``
on its export token for token, and sampling is seeded and identical on every TP rank."""
from __future__ import annotations

import json
import os
import sys

import pytest
import torch

from harness import run_command, run_ranks
from oracle import ROOT

PROMPT = [5, 77, 140, 3, 299, 18, 64]


def _checkpoint(tmp_path, kind: str = "llama", tp: int = 2) -> str:
    """A random Hugging Face model (large init, so tokens are not near-ties), imported at TP=``tp``."""
    import transformers
    from hybridlm.interop.import_ import import_from_hf
    torch.manual_seed(0)
    common = dict(vocab_size=300, initializer_range=0.3)
    config = {
        "llama": lambda: transformers.LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                                  num_key_value_heads=2, max_position_embeddings=64, **common),
        "mixtral": lambda: transformers.MixtralConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                                      num_key_value_heads=2, max_position_embeddings=64, num_local_experts=4,
                                                      num_experts_per_tok=2, **common),
        "gpt2": lambda: transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=64, **common),
        "qwen2_moe": lambda: transformers.Qwen2MoeConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                                         num_key_value_heads=2, max_position_embeddings=64, moe_intermediate_size=32,
                                                         shared_expert_intermediate_size=48, num_experts=8, num_experts_per_tok=2,
                                                         mlp_only_layers=[1], **common),
    }[kind]()
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(str(tmp_path / f"hf_{kind}"))
    directory = str(tmp_path / f"ckpt_{kind}")
    import_from_hf(str(tmp_path / f"hf_{kind}"), directory, tp=tp, progress=False, log=lambda line: None)
    return directory


def test_filter_logits_keeps_the_top_k_then_the_smallest_nucleus():
    from hybridlm.interop.generate import filter_logits
    logits = torch.log(torch.tensor([[0.5, 0.05, 0.3, 0.15]]))
    assert torch.isfinite(filter_logits(logits, 2, 1.0)).tolist() == [[True, False, True, False]]
    assert torch.isfinite(filter_logits(logits, 0, 0.8)).tolist() == [[True, False, True, False]]  # 0.5 + 0.3 reaches 0.8
    assert torch.isfinite(filter_logits(logits, 0, 0.81)).tolist() == [[True, False, True, True]]
    assert torch.isfinite(filter_logits(logits, 1, 0.99)).tolist() == [[True, False, False, False]]


@pytest.mark.parametrize("kind", ["llama", "mixtral", "qwen2_moe", "gpt2"])
def test_kv_cache_decoding_equals_the_full_forward(tmp_path, kind):
    from hybridlm.interop.generate import KVCache, load_for_generation
    from hybridlm.parallel.state import SINGLE
    generator, cfg, _ = load_for_generation(_checkpoint(tmp_path, kind, tp=1), SINGLE, "cpu")
    new = generator.generate(PROMPT, 12)
    sequence = torch.tensor([PROMPT + new])
    with torch.no_grad():
        full = generator.model(sequence)[:, 0, : cfg.vocab_size]  # [positions, vocab]
    attention = generator.layers[0].attention
    cache = KVCache(len(generator.layers), 1, attention.qkv.local_sizes[1] // attention.head_dim, sequence.shape[1],
                    attention.head_dim, "cpu", torch.float32)
    stepped = [generator.forward_step(sequence[:, : len(PROMPT)], cache, 0)]
    for position in range(len(PROMPT), sequence.shape[1] - 1):
        stepped.append(generator.forward_step(sequence[:, position: position + 1], cache, position))
    assert (torch.cat(stepped) - full[len(PROMPT) - 1: -1]).abs().max().item() < 1e-4  # logits of size ~5, fp32
    assert new == full[len(PROMPT) - 1: -1].argmax(-1).tolist()


def test_greedy_generation_under_tp2_equals_transformers_generate_on_the_export(tmp_path):
    from transformers import AutoModelForCausalLM
    from hybridlm.interop.export import export_to_hf
    checkpoint = _checkpoint(tmp_path)
    export_to_hf(checkpoint, str(tmp_path / "export"), progress=False, log=lambda line: None)
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "export"), local_files_only=True).eval()
    theirs = model.generate(torch.tensor([PROMPT]), max_new_tokens=24, do_sample=False, eos_token_id=None,
                            pad_token_id=0)[0, len(PROMPT):].tolist()
    assert len(set(theirs)) > 3, "a degenerate continuation would not test much"
    output = tmp_path / "generated.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               os.path.join(ROOT, "scripts", "generate.py"), "--checkpoint", checkpoint, "--prompt-ids", " ".join(map(str, PROMPT)),
               "--max-new-tokens", "24", "--ignore-eos", "--output-json", str(output)]
    done = run_command(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(output.read_text())[0]["generated_ids"] == theirs


def _greedy_on_rank(checkpoint: str) -> list[int]:
    import torch.distributed as dist
    from hybridlm.interop.generate import load_for_generation
    from hybridlm.parallel.state import ParallelState
    from hybridlm.training.distributed import init_distributed
    init_distributed(timeout_minutes=2)
    generator, _, _ = load_for_generation(checkpoint, ParallelState(tp=dist.get_world_size()).tp, "cpu")
    return generator.generate(PROMPT, 24)


def test_greedy_generation_of_qwen2_moe_under_tp2_equals_transformers_generate_on_the_export(tmp_path):
    from transformers import AutoModelForCausalLM
    from hybridlm.interop.export import export_to_hf
    checkpoint = _checkpoint(tmp_path, "qwen2_moe")
    export_to_hf(checkpoint, str(tmp_path / "export"), progress=False, log=lambda line: None)
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "export"), local_files_only=True).eval()
    assert type(model).__name__ == "Qwen2MoeForCausalLM"
    theirs = model.generate(torch.tensor([PROMPT]), max_new_tokens=24, do_sample=False, eos_token_id=None,
                            pad_token_id=0)[0, len(PROMPT):].tolist()
    assert len(set(theirs)) > 3, "a degenerate continuation would not test much"
    assert run_ranks(2, _greedy_on_rank, checkpoint) == [theirs, theirs]


def _sample_on_rank(checkpoint: str) -> dict:
    import torch.distributed as dist
    from hybridlm.interop.generate import Sampling, load_for_generation
    from hybridlm.parallel.state import ParallelState
    from hybridlm.training.distributed import init_distributed
    init_distributed(timeout_minutes=2)
    ps = ParallelState(tp=dist.get_world_size())
    generator, _, _ = load_for_generation(checkpoint, ps.tp, "cpu")

    def sample(**kw):
        return generator.generate(PROMPT, 16, Sampling(greedy=False, **kw))

    return {"greedy": generator.generate(PROMPT, 16), "top1": sample(top_k=1, seed=3),
            "a": sample(temperature=1.5, top_p=0.95, seed=1), "again": sample(temperature=1.5, top_p=0.95, seed=1),
            "b": sample(temperature=1.5, top_p=0.95, seed=2)}


def test_sampling_is_seeded_and_the_same_on_every_tp_rank(tmp_path):
    first, second = run_ranks(2, _sample_on_rank, _checkpoint(tmp_path))
    assert first == second
    assert first["top1"] == first["greedy"]
    assert first["a"] == first["again"] and first["a"] != first["b"]


PROMPTS = [[5, 77, 140], [9, 12, 250, 3, 299, 18, 64], [200, 41, 7, 7, 150]]  # unequal lengths: left padding


def _batch_on_rank(checkpoint: str, seeds: tuple = ()) -> dict:
    import torch.distributed as dist
    from hybridlm.interop.generate import Sampling, load_for_generation
    from hybridlm.parallel.state import ParallelState
    from hybridlm.training.distributed import init_distributed
    init_distributed(timeout_minutes=2)
    generator, _, _ = load_for_generation(checkpoint, ParallelState(tp=dist.get_world_size()).tp, "cpu")
    result = {"greedy": generator.generate_batch(PROMPTS, 12).tokens,
              "alone": [generator.generate(p, 12) for p in PROMPTS]}
    result["sampled"] = []
    for seed in seeds:
        sampled = generator.generate_batch(PROMPTS * 2, 10, Sampling(greedy=False, temperature=1.3, top_p=0.9, seed=seed),
                                           stop_ids=(7, 18), pad_id=0)
        result["sampled"].append((sampled.tokens, sampled.truncated))
    return result


def test_greedy_batch_of_unequal_prompts_under_tp2_equals_transformers_generate(tmp_path):
    from transformers import AutoModelForCausalLM
    from hybridlm.interop.export import export_to_hf
    checkpoint = _checkpoint(tmp_path)
    export_to_hf(checkpoint, str(tmp_path / "export"), progress=False, log=lambda line: None)
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "export"), local_files_only=True).eval()
    width = max(map(len, PROMPTS))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in PROMPTS])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in PROMPTS])
    theirs = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, eos_token_id=None,
                            pad_token_id=0)[:, width:].tolist()
    assert all(len(set(row)) > 3 for row in theirs), "a degenerate continuation would not test much"
    first, second = run_ranks(2, _batch_on_rank, checkpoint)
    assert first == second
    assert first["greedy"] == theirs
    assert first["alone"] == theirs  # each row decodes as it would alone


def test_seeded_batch_sampling_repeats_exactly_and_stops_each_row_at_its_stop_token(tmp_path):
    first, second = run_ranks(2, _batch_on_rank, _checkpoint(tmp_path), (1, 1, 2))
    assert first == second  # every TP rank sampled the same tokens
    (tokens, truncated), again, (other, _) = first["sampled"]
    assert (tokens, truncated) == again and tokens != other
    for row, cut in zip(tokens, truncated):
        stops = [i for i, t in enumerate(row) if t in (7, 18)]
        assert stops == ([] if cut else [len(row) - 1]) and (len(row) == 10 if cut else len(row) <= 10)
    assert not all(truncated) and any(truncated), "the stop tokens should end some rows and not others"


@pytest.mark.parametrize("flags, world, message", [
    pytest.param(["--prompt-ids", "5 999"], "1", "token ids outside the vocabulary 0..299", id="id_outside_vocabulary"),
    pytest.param(["--prompt-ids", "5 6"], "3", "3 ranks (TP) do not divide the model's 4 attention heads", id="tp_not_dividing_heads"),
])
def test_bad_generate_input_is_one_sentence_before_any_process_group(tmp_path, capsys, monkeypatch, flags, world, message):
    import importlib.util
    import torch.distributed as dist
    checkpoint = _checkpoint(tmp_path, tp=1)
    spec = importlib.util.spec_from_file_location("generate_script", os.path.join(ROOT, "scripts", "generate.py"))
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    monkeypatch.setenv("WORLD_SIZE", world)
    capsys.readouterr()
    assert script.main(["--checkpoint", checkpoint, *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and message in err, err
    assert not dist.is_initialized()


def test_rows_that_stop_early_leave_the_batch_and_the_others_decode_as_they_would_alone(tmp_path, monkeypatch):
    """Once few enough rows still decode, they move to the front of a smaller batch (their caches too):
    the tokens do not change, and each row still stops at its own stop token."""
    from hybridlm.interop.generate import load_for_generation
    from hybridlm.model.decode_state import DecodeState
    from hybridlm.parallel.state import SINGLE
    generator, _, _ = load_for_generation(_checkpoint(tmp_path, tp=1), SINGLE, "cpu")
    prompts = [PROMPTS[i % 3][: 2 + i % 4] + [i + 20] for i in range(8)]
    alone = [generator.generate(p, 12) for p in prompts]
    # stop tokens that end most rows early, at different steps: each row's token at step (row % 5) + 1
    stops = {row[(i % 5) + 1] for i, row in enumerate(alone[:6])}
    expected = []
    for row in alone:
        first = next((i for i, t in enumerate(row) if t in stops), None)
        expected.append(row if first is None else row[: first + 1])
    compactions = []
    compact = DecodeState.compact
    monkeypatch.setattr(DecodeState, "compact", lambda self, batch, smaller: (compactions.append((batch, smaller)),
                                                                             compact(self, batch, smaller))[1])
    out = generator.generate_batch(prompts, 12, stop_ids=sorted(stops), check_every=1)
    assert out.tokens == expected
    assert out.truncated == [len(row) == 12 and row[-1] not in stops for row in expected]
    assert compactions and all(smaller < batch for batch, smaller in compactions), "no row left the batch"
