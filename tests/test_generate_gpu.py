"""The decode step replayed from CUDA graphs computes what the same step computes eagerly: greedy
rows equal transformers' ``generate`` (fp32, weights large enough that no two logits nearly tie),
sampled rows equal the eager decoder's draw for draw, and rows that stop early leave the batch
without changing the others."""
from __future__ import annotations

import pytest
import torch

from test_generate import PROMPTS, _checkpoint

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CUDA graphs)")]


def _generators(tmp_path):
    from hybridlm.interop.generate import load_for_generation
    from hybridlm.parallel.state import SINGLE
    checkpoint = _checkpoint(tmp_path, tp=1)
    graphed, _, _ = load_for_generation(checkpoint, SINGLE, "cuda")
    eager, _, _ = load_for_generation(checkpoint, SINGLE, "cuda")
    eager.graphs = False
    return checkpoint, graphed, eager


def test_graphed_greedy_decoding_equals_transformers_generate(tmp_path):
    from transformers import AutoModelForCausalLM
    from hybridlm.interop.export import export_to_hf
    checkpoint, graphed, eager = _generators(tmp_path)
    export_to_hf(checkpoint, str(tmp_path / "export"), progress=False, log=lambda line: None)
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "export"), local_files_only=True).cuda().eval()
    prompts = PROMPTS * 3  # 9 rows: a batch that is not a power of two
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device="cuda")
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device="cuda")
    theirs = model.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False, eos_token_id=None,
                            pad_token_id=0)[:, width:].tolist()
    assert all(len(set(row)) > 3 for row in theirs), "a degenerate continuation would not test much"
    assert graphed.generate_batch(prompts, 20).tokens == theirs
    assert eager.generate_batch(prompts, 20).tokens == theirs


def test_graphed_sampling_draws_what_the_eager_step_draws_and_stops_rows_alike(tmp_path):
    from hybridlm.interop.generate import Sampling
    _, graphed, eager = _generators(tmp_path)
    prompts = [PROMPTS[i % 3] + [i + 30] for i in range(12)]
    for sampling in (Sampling(greedy=False, temperature=3.0, seed=5), Sampling(greedy=False, temperature=3.0, top_p=0.9, seed=5)):
        free = eager.generate_batch(prompts, 24, sampling).tokens
        stops = sorted({row[i % 6 + 2] for i, row in enumerate(free[:8])})  # most rows stop, at different steps
        ours = graphed.generate_batch(prompts, 24, sampling, stop_ids=stops, check_every=2)
        again = eager.generate_batch(prompts, 24, sampling, stop_ids=stops, check_every=2)
        assert (ours.tokens, ours.truncated) == (again.tokens, again.truncated)
        assert not all(ours.truncated) and len({len(row) for row in ours.tokens}) > 3, "rows should stop at different steps"
