"""The .bin/.idx format: byte-compatible with Megatron-LM, atomic to write, strict to read."""
import os
import struct

import numpy as np
import pytest

from hybridlm.config import ConfigError
from hybridlm.data.indexed import (DTYPE_CODES, IndexedDataError, IndexedDataset, IndexedDatasetWriter, optimal_dtype)

DOCS = [[5, 6, 7], [65000], [1, 2, 3, 4, 5], [9, 9]]


def write(prefix, docs=DOCS, dtype=np.uint16):
    with IndexedDatasetWriter(str(prefix), dtype) as w:
        for d in docs:
            w.add_document(np.array(d))
    return str(prefix)


def megatron_idx_bytes(lengths, code, itemsize, document_indices, modes=None) -> bytes:
    """The .idx layout spelled out from Megatron-LM's _IndexWriter, independently of our writer."""
    pointers = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64) * itemsize
    out = b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", code)
    out += struct.pack("<Q", len(lengths)) + struct.pack("<Q", len(document_indices))
    out += np.asarray(lengths, "<i4").tobytes() + pointers.astype("<i8").tobytes() + np.asarray(document_indices, "<i8").tobytes()
    return out + (np.asarray(modes, np.int8).tobytes() if modes is not None else b"")


def test_idx_and_bin_bytes_equal_the_published_megatron_layout(tmp_path):
    prefix = write(tmp_path / "d")
    lengths = [len(d) for d in DOCS]
    assert open(prefix + ".idx", "rb").read() == megatron_idx_bytes(lengths, 8, 2, [0, 1, 2, 3, 4])
    assert open(prefix + ".bin", "rb").read() == np.concatenate(DOCS).astype("<u2").tobytes()


def test_int32_tokens_use_code_4_and_four_byte_pointers(tmp_path):
    prefix = write(tmp_path / "d", [[70000, 1], [2]], np.int32)
    assert open(prefix + ".idx", "rb").read() == megatron_idx_bytes([2, 1], 4, 4, [0, 1, 2])
    assert IndexedDataset(prefix)[0].tolist() == [70000, 1]


def test_dtype_codes_and_choice_follow_megatron():
    assert {c: np.dtype(t).name for c, t in DTYPE_CODES.items()} == {
        1: "uint8", 2: "int8", 3: "int16", 4: "int32", 5: "int64", 6: "float64", 7: "float32", 8: "uint16"}
    assert optimal_dtype(257) is np.uint16 and optimal_dtype(65499) is np.uint16
    assert optimal_dtype(65500) is np.int32 and optimal_dtype(128256) is np.int32


def test_reader_returns_every_document_token_for_token(tmp_path):
    ds = IndexedDataset(write(tmp_path / "d"))
    assert len(ds) == ds.num_documents == 4 and ds.num_tokens == 11 and ds.dtype == np.uint16
    assert [ds[i].tolist() for i in range(4)] == DOCS
    assert ds.get(2, offset=1, length=3).tolist() == [2, 3, 4]


def test_reads_megatron_files_with_sequence_modes_and_multi_sequence_documents(tmp_path):
    # Megatron's multimodal writer appends int8 modes; its sentence splitter puts several sequences in a document.
    lengths, seqs = [2, 1, 3], [[1, 2], [3], [4, 5, 6]]
    (tmp_path / "m.idx").write_bytes(megatron_idx_bytes(lengths, 8, 2, [0, 2, 3], modes=[0, 1, 1]))
    (tmp_path / "m.bin").write_bytes(np.concatenate(seqs).astype("<u2").tobytes())
    ds = IndexedDataset(str(tmp_path / "m"))
    assert [ds[i].tolist() for i in range(3)] == seqs
    assert ds.num_documents == 2 and ds.sequence_modes.tolist() == [0, 1, 1]


@pytest.mark.parametrize("keep", [0, 5, 20, 40, 60])
def test_truncated_idx_is_refused_with_a_sentence(tmp_path, keep):
    prefix = write(tmp_path / "d")
    data = open(prefix + ".idx", "rb").read()
    open(prefix + ".idx", "wb").write(data[:keep])
    with pytest.raises(IndexedDataError, match=r"d\.idx is truncated"):
        IndexedDataset(prefix)


@pytest.mark.parametrize("content", [b"TNTIDX\x00\x00" + bytes(40), b"\x93NUMPY" + bytes(80), b"hello world, not an index"])
def test_foreign_idx_is_refused_with_a_sentence(tmp_path, content):
    prefix = write(tmp_path / "d")
    open(prefix + ".idx", "wb").write(content)
    with pytest.raises(IndexedDataError, match="not a Megatron indexed-dataset index"):
        IndexedDataset(prefix)


def test_idx_with_trailing_garbage_or_bad_version_or_dtype_is_refused(tmp_path):
    prefix = write(tmp_path / "d")
    good = open(prefix + ".idx", "rb").read()
    for bad, message in [(good + bytes(3), "more than its header announces"),
                         (good[:9] + struct.pack("<Q", 2) + good[17:], "version 2"),
                         (good[:17] + b"\x63" + good[18:], "unknown token dtype code 99")]:
        open(prefix + ".idx", "wb").write(bad)
        with pytest.raises(IndexedDataError, match=message):
            IndexedDataset(prefix)


def test_bin_that_does_not_match_its_idx_is_refused(tmp_path):
    prefix = write(tmp_path / "d")
    with open(prefix + ".bin", "ab") as f:
        f.write(b"\x00\x00")
    with pytest.raises(IndexedDataError, match="are not a pair"):
        IndexedDataset(prefix)


def test_missing_files_are_named(tmp_path):
    with pytest.raises(ConfigError, match=r"nope\.idx and .*nope\.bin: no such file"):
        IndexedDataset(str(tmp_path / "nope"))


def test_failed_write_leaves_no_pair_and_keeps_the_previous_one(tmp_path):
    prefix = write(tmp_path / "d")
    with pytest.raises(RuntimeError):
        with IndexedDatasetWriter(prefix, np.uint16) as w:
            w.add_document(np.array([1, 2, 3]))
            raise RuntimeError("interrupted")
    assert sorted(os.listdir(tmp_path)) == ["d.bin", "d.idx"]
    assert [x.tolist() for x in IndexedDataset(prefix)] == DOCS
    with pytest.raises(RuntimeError):
        with IndexedDatasetWriter(str(tmp_path / "new"), np.uint16) as w:
            w.add_document(np.array([1]))
            raise RuntimeError("interrupted")
    assert sorted(os.listdir(tmp_path)) == ["d.bin", "d.idx"]


def test_token_ids_that_do_not_fit_the_dtype_are_refused(tmp_path):
    with pytest.raises(ValueError, match="do not fit"):
        write(tmp_path / "d", [[70000]], np.uint16)


def test_byte_identical_to_megatron_core_when_it_is_installed(tmp_path):
    try:
        import torch
        from megatron.core.datasets.indexed_dataset import IndexedDataset as MegatronDataset, IndexedDatasetBuilder
    except Exception as e:  # noqa: BLE001 - any import failure means "not available here"
        pytest.skip(f"megatron-core is not importable ({type(e).__name__})")
    builder = IndexedDatasetBuilder(str(tmp_path / "m.bin"), dtype=np.uint16)
    for d in DOCS:
        builder.add_document(torch.tensor(d), [len(d)])
    builder.finalize(str(tmp_path / "m.idx"))
    ours = write(tmp_path / "o")
    for ext in (".bin", ".idx"):
        assert open(ours + ext, "rb").read() == open(str(tmp_path / "m") + ext, "rb").read()
    theirs = MegatronDataset(ours)  # keep a reference: its __del__ unmaps the memory its arrays view
    assert [theirs[i].tolist() for i in range(4)] == DOCS
