"""GPT samples: exact windows of the document stream, split, epochs, seeded order, cache, blending, resume."""
import os

import numpy as np
import pytest
import torch

from hybridlm.config import ConfigError
from hybridlm.data import gpt_dataset
from hybridlm.data.blending import blending_indices
from hybridlm.data.gpt_dataset import GPTDataset, build_gpt_datasets, parse_data_path, parse_split, split_ranges
from hybridlm.data.indexed import IndexedDataset, IndexedDatasetWriter
from hybridlm.data.samples import micro_batches


def write_corpus(prefix, num_docs=40, base=0, seed=0):
    """Documents whose tokens name themselves: token = base + 1000*doc + position, so any sample can be traced."""
    lengths = np.random.RandomState(seed).randint(1, 60, size=num_docs)
    with IndexedDatasetWriter(str(prefix), np.int32) as w:
        for d, n in enumerate(lengths):
            w.add_document(base + 1000 * d + np.arange(n))
    return str(prefix)


def doc_of(token):
    return (token % 1_000_000) // 1000


def test_samples_are_consecutive_overlapping_windows_of_the_shuffled_document_stream(tmp_path):
    prefix = write_corpus(tmp_path / "c")
    ds = GPTDataset(IndexedDataset(prefix), (0, 40), seq_length=16, num_samples=None, seed=1)
    stream = np.concatenate([IndexedDataset(prefix)[int(d)] for d in ds.document_index])
    assert len(ds) == (len(stream) - 1) // 16
    for i in range(len(ds)):
        j = int(ds.shuffle_index[i])
        assert ds[i].tolist() == stream[16 * j:16 * j + 17].tolist()
    assert sorted(int(x) for x in ds.shuffle_index) == list(range(len(ds)))


def test_epochs_are_added_until_the_requested_samples_exist(tmp_path):
    prefix = write_corpus(tmp_path / "c", num_docs=10)
    tokens = IndexedDataset(prefix).num_tokens
    ds = GPTDataset(IndexedDataset(prefix), (0, 10), seq_length=8, num_samples=3 * tokens // 8, seed=1)
    assert len(ds) >= 3 * tokens // 8
    assert np.bincount(ds.document_index, minlength=10).tolist() == [4] * 10  # 3 epochs' worth needs a 4th
    assert all(len(ds[i]) == 9 for i in range(len(ds)))


def test_sample_order_is_deterministic_for_a_seed_and_changes_with_it(tmp_path):
    prefix = write_corpus(tmp_path / "c")
    a, b, c = (GPTDataset(IndexedDataset(prefix), (0, 40), 16, 100, seed) for seed in (7, 7, 8))
    sample = lambda ds: np.stack([ds[i] for i in range(50)])  # noqa: E731
    assert np.array_equal(sample(a), sample(b)) and not np.array_equal(sample(a), sample(c))


def test_split_969_30_1_gives_disjoint_document_ranges_rounded_like_megatron(tmp_path):
    assert parse_split("969,30,1") == pytest.approx([0.969, 0.030, 0.001])
    assert split_ranges(parse_split("969,30,1"), 2000) == [(0, 1938), (1938, 1998), (1998, 2000)]
    assert split_ranges(parse_split("80/20"), 10) == [(0, 8), (8, 10), (10, 10)]
    prefix = write_corpus(tmp_path / "c", num_docs=100)
    train, valid, test = build_gpt_datasets([prefix], "80,15,5", 8, 1, (50, 10, 5), str(tmp_path / "cache"))
    seen = [{doc_of(t) for i in range(len(ds)) for t in ds[i]} for ds in (train, valid, test)]
    assert max(seen[0]) < 80 and seen[1] <= set(range(80, 95)) and seen[2] <= set(range(95, 100))


def test_zero_fraction_or_zero_samples_give_no_dataset(tmp_path):
    prefix = write_corpus(tmp_path / "c")
    train, valid, test = build_gpt_datasets([prefix], "100,0,0", 8, 1, (10, 10, 10), str(tmp_path / "cache"))
    assert train is not None and valid is None and test is None
    assert build_gpt_datasets([prefix], "90,10,0", 8, 1, (10, 0, 0), str(tmp_path / "cache"))[1] is None


def test_indices_are_cached_under_every_parameter_and_reloaded_without_rebuilding(tmp_path, monkeypatch):
    prefix = write_corpus(tmp_path / "c")
    cache = str(tmp_path / "cache")
    first = GPTDataset(IndexedDataset(prefix), (0, 40), 16, 100, 1, cache)
    variants = [((0, 40), 16, 100, 2), ((0, 40), 16, 101, 1), ((0, 40), 15, 100, 1), ((0, 39), 16, 100, 1)]
    for docs, seq, n, seed in variants:
        GPTDataset(IndexedDataset(prefix), docs, seq, n, seed, cache)
    assert len([f for f in os.listdir(cache) if f.endswith("description.json")]) == 5

    def no_build(*args, **kwargs):
        raise AssertionError("rebuilt although cached")
    monkeypatch.setattr(gpt_dataset, "build_indices", no_build)
    again = GPTDataset(IndexedDataset(prefix), (0, 40), 16, 100, 1, cache)
    assert all(np.array_equal(again[i], first[i]) for i in range(len(first)))


def test_rewriting_the_data_invalidates_the_cache(tmp_path):
    prefix = write_corpus(tmp_path / "c", seed=0)
    cache = str(tmp_path / "cache")
    GPTDataset(IndexedDataset(prefix), (0, 40), 16, 50, 1, cache)
    write_corpus(tmp_path / "c", num_docs=41, seed=3)
    after = GPTDataset(IndexedDataset(prefix), (0, 40), 16, 50, 1, cache)
    assert len([f for f in os.listdir(cache) if f.endswith("description.json")]) == 2
    stream = np.concatenate([after.indexed[int(d)] for d in after.document_index])
    j = int(after.shuffle_index[0])
    assert after[0].tolist() == stream[16 * j:16 * j + 17].tolist()


def test_blend_of_weighted_prefixes_has_the_exact_proportions(tmp_path):
    a = write_corpus(tmp_path / "a", base=0)
    b = write_corpus(tmp_path / "b", base=1_000_000, seed=1)
    train, _, _ = build_gpt_datasets(["0.3", a, "0.7", b], "1,0,0", 8, 1, (2000, 0, 0), str(tmp_path / "cache"))
    assert len(train) == 2000
    from_b = np.array([train[i][0] >= 1_000_000 for i in range(2000)])
    assert from_b.mean() == pytest.approx(0.7, abs=0.01)
    running = np.cumsum(from_b) - 0.7 * np.arange(1, 2001)
    assert np.abs(running).max() <= 1.0  # every prefix of the order is within one sample of 70%


def test_prefixes_without_weights_blend_by_size_and_one_epoch_repeats_nothing(tmp_path):
    a = write_corpus(tmp_path / "a", num_docs=20, base=0)
    b = write_corpus(tmp_path / "b", num_docs=60, base=1_000_000, seed=1)
    train, _, _ = build_gpt_datasets([a, b], "1,0,0", 8, 1, (None, 0, 0), str(tmp_path / "cache"))
    share_b = IndexedDataset(b).num_tokens / (IndexedDataset(a).num_tokens + IndexedDataset(b).num_tokens)
    firsts = [tuple(train[i][:2]) for i in range(len(train))]
    assert len(set(firsts)) == len(firsts)  # no sample twice
    assert np.mean([f[0] >= 1_000_000 for f in firsts]) == pytest.approx(share_b, abs=0.01)


def test_blending_index_is_megatrons_greedy_order():
    dataset_index, sample_index = blending_indices([3, 7], 10)
    assert dataset_index.tolist() == [1, 0, 1, 1, 0, 1, 1, 0, 1, 1]
    assert sample_index.tolist() == [0, 0, 1, 2, 1, 3, 4, 2, 5, 6]


def test_data_path_forms(tmp_path):
    assert parse_data_path(["data/a"]) == (["data/a"], None)
    assert parse_data_path(["0.3 a 0.7 b"]) == (["a", "b"], [0.3, 0.7])
    assert parse_data_path(["30", "a", "70", "b"]) == (["a", "b"], [30.0, 70.0])
    assert parse_data_path(["a", "b"]) == (["a", "b"], None)
    with pytest.raises(ConfigError, match="'weight prefix' pairs"):
        parse_data_path(["0.3", "a", "b"])
    with pytest.raises(ConfigError, match="--split 1,x"):
        parse_split("1,x")


def test_too_small_data_or_missing_prefix_is_one_sentence(tmp_path):
    prefix = write_corpus(tmp_path / "c", num_docs=3)
    with pytest.raises(ConfigError, match=r"the train split holds 3 document\(s\) and \d+ token\(s\), fewer than one sample of --seq-length 4096"):
        build_gpt_datasets([prefix], "1,0,0", 4096, 1, (1, 0, 0), None)
    with pytest.raises(ConfigError, match="no such file"):
        build_gpt_datasets([str(tmp_path / "missing")], "1,0,0", 8, 1, (1, 0, 0), None)


def test_a_resumed_run_continues_at_consumed_samples(tmp_path):
    prefix = write_corpus(tmp_path / "c", num_docs=60)
    gbs, iters = 8, 10
    args = ([prefix], "969,30,1", 16, 1234, (gbs * iters, 0, 0), str(tmp_path / "cache"))
    full = build_gpt_datasets(*args)[0]
    uninterrupted = [t for t, _ in zip(micro_batches(full, micro_batch_size=4, global_batch_size=gbs, dp_rank=0, dp_size=1), range(2 * iters))]
    resumed_ds = build_gpt_datasets(*args)[0]  # a new process would map the same cached indices
    consumed_samples = 6 * gbs
    assert np.array_equal(resumed_ds[consumed_samples], full[consumed_samples])
    resumed = [t for t, _ in zip(micro_batches(resumed_ds, micro_batch_size=4, global_batch_size=gbs, dp_rank=0, dp_size=1,
                                               start_iteration=consumed_samples // gbs), range(2 * (iters - 6)))]
    for (tokens_a, labels_a), (tokens_b, labels_b) in zip(uninterrupted[12:], resumed):
        assert torch.equal(tokens_a, tokens_b) and torch.equal(labels_a, labels_b)
    assert torch.equal(uninterrupted[0][1][:, :-1], uninterrupted[0][0][:, 1:])  # labels are inputs shifted by one


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_micro_batch_reaches_the_gpu_without_waiting_for_the_queued_work(tmp_path):
    prefix = write_corpus(tmp_path / "c")
    ds = build_gpt_datasets([prefix], "1,0,0", 16, 1, (64, 0, 0), str(tmp_path / "cache"))[0]
    batches = micro_batches(ds, micro_batch_size=4, global_batch_size=8, dp_rank=0, dp_size=1, device="cuda")
    next(batches)  # warm the pinned-memory pool
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # about a second of queued GPU work
    import time
    started = time.perf_counter()
    tokens, labels = next(batches)
    waited = time.perf_counter() - started
    torch.cuda.synchronize()
    assert waited < 0.2, f"fetching a micro-batch blocked the host for {waited:.2f} s behind the queued GPU work"
    want = torch.from_numpy(np.stack([ds[i] for i in range(4, 8)]).astype(np.int64))
    assert torch.equal(tokens.cpu(), want[:, :-1]) and torch.equal(labels.cpu(), want[:, 1:])


def _build_on_rank(prefix, cache):
    torch.distributed.init_process_group("gloo")
    built = []
    real = gpt_dataset.build_indices
    gpt_dataset.build_indices = lambda *a, **k: built.append(1) or real(*a, **k)
    ds = build_gpt_datasets([prefix], "1,0,0", 16, 1, (100, 0, 0), cache)[0]
    torch.distributed.destroy_process_group()
    return len(built), np.stack([ds[i] for i in range(100)])


def test_only_rank_0_builds_the_indices_and_the_other_ranks_load_them(tmp_path):
    from harness import run_ranks
    prefix = write_corpus(tmp_path / "c")
    (built0, samples0), (built1, samples1) = run_ranks(2, _build_on_rank, prefix, str(tmp_path / "cache"), timeout=120)
    assert (built0, built1) == (1, 0) and np.array_equal(samples0, samples1)
