"""`.bin`/`.idx` reading and writing, checked against byte layouts built by hand from the byte
table of Megatron's megatron/core/datasets/indexed_dataset.py, not only against our own writer."""

import pickle
import struct

import numpy
import pytest

from megatron.core.datasets.indexed_dataset import (
    DType,
    IndexedDataset,
    IndexedDatasetBuilder,
)

DTYPE_CODES = {
    numpy.uint8: 1,
    numpy.int8: 2,
    numpy.int16: 3,
    numpy.int32: 4,
    numpy.int64: 5,
    numpy.float64: 6,
    numpy.float32: 7,
    numpy.uint16: 8,
}


def hand_built_idx(dtype, sequence_lengths, document_indices, modes=None):
    """The .idx bytes, straight from the byte table (magic, version, dtype code, ...)."""
    itemsize = numpy.dtype(dtype).itemsize
    out = b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", DTYPE_CODES[dtype])
    out += struct.pack("<Q", len(sequence_lengths)) + struct.pack("<Q", len(document_indices))
    out += b"".join(struct.pack("<i", n) for n in sequence_lengths)
    pointer = 0
    for n in sequence_lengths:
        out += struct.pack("<q", pointer)
        pointer += n * itemsize
    out += b"".join(struct.pack("<q", d) for d in document_indices)
    if modes is not None:
        out += b"".join(struct.pack("<b", m) for m in modes)
    return out


DOCS = [  # document -> its sequences
    [[1, 2, 3], [4, 5]],
    [[6]],
    [],
    [[7, 8, 9, 10], [11], [12, 13]],
]


def _write_with_add_item(prefix, dtype):
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    for doc in DOCS:
        for seq in doc:
            builder.add_item(numpy.array(seq))
        builder.end_document()
    builder.finalize(prefix + ".idx")


def _expected_layout():
    lengths = [len(s) for d in DOCS for s in d]
    doc_idx = [0]
    for d in DOCS:
        doc_idx.append(doc_idx[-1] + len(d))
    flat = [t for d in DOCS for s in d for t in s]
    return lengths, doc_idx, flat


@pytest.mark.parametrize("dtype", [numpy.uint16, numpy.int32, numpy.int64, numpy.uint8])
def test_writer_is_byte_exact(tmp_path, dtype):
    prefix = str(tmp_path / "ds")
    _write_with_add_item(prefix, dtype)
    lengths, doc_idx, flat = _expected_layout()
    assert open(prefix + ".idx", "rb").read() == hand_built_idx(dtype, lengths, doc_idx)
    assert open(prefix + ".bin", "rb").read() == numpy.array(flat, dtype=dtype).tobytes()
    # add_document writes the same bytes as add_item + end_document.
    prefix2 = str(tmp_path / "ds2")
    builder = IndexedDatasetBuilder(prefix2 + ".bin", dtype=dtype)
    for doc in DOCS:
        builder.add_document([t for s in doc for t in s], [len(s) for s in doc])
    builder.finalize(prefix2 + ".idx")
    assert open(prefix2 + ".idx", "rb").read() == open(prefix + ".idx", "rb").read()
    assert open(prefix2 + ".bin", "rb").read() == open(prefix + ".bin", "rb").read()


def test_reader_on_hand_built_files(tmp_path):
    lengths, doc_idx, flat = _expected_layout()
    prefix = str(tmp_path / "hand")
    open(prefix + ".idx", "wb").write(hand_built_idx(numpy.uint16, lengths, doc_idx))
    open(prefix + ".bin", "wb").write(numpy.array(flat, dtype=numpy.uint16).tobytes())
    ds = IndexedDataset(prefix)
    assert len(ds) == len(lengths)
    assert ds.sequence_lengths.tolist() == lengths
    assert ds.document_indices.tolist() == doc_idx
    assert ds.sizes.tolist() == lengths and ds.doc_idx.tolist() == doc_idx
    seqs = [s for d in DOCS for s in d]
    for i, seq in enumerate(seqs):
        assert ds[i].tolist() == seq
        assert ds[i].dtype == numpy.uint16
    assert [a.tolist() for a in ds[1:5]] == seqs[1:5]
    assert ds.get(3, offset=1, length=2).tolist() == [8, 9]
    assert ds.get(3, offset=2).tolist() == [9, 10]
    assert ds[-1].tolist() == seqs[-1]
    with pytest.raises(IndexError):
        ds[len(seqs)]
    # Without mmap (file reads) the answers are the same; pickling reopens from the prefix.
    ds2 = IndexedDataset(prefix, mmap=False)
    assert all(ds2[i].tolist() == s for i, s in enumerate(seqs))
    ds3 = pickle.loads(pickle.dumps(ds))
    assert ds3.get(3, 1, 3).tolist() == [8, 9, 10]
    assert IndexedDataset.exists(prefix) and not IndexedDataset.exists(prefix + "x")


def test_multimodal_modes(tmp_path):
    prefix = str(tmp_path / "mm")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=numpy.int32, multimodal=True)
    builder.add_item(numpy.array([1, 2]), mode=0)
    builder.add_item(numpy.array([3]), mode=1)
    builder.end_document()
    builder.finalize(prefix + ".idx")
    assert open(prefix + ".idx", "rb").read() == hand_built_idx(
        numpy.int32, [2, 1], [0, 2], modes=[0, 1]
    )
    ds = IndexedDataset(prefix, multimodal=True)
    seq, mode = ds[1]
    assert seq.tolist() == [3] and mode == 1


def test_add_index_merges(tmp_path):
    a, b, m = (str(tmp_path / n) for n in "abm")
    _write_with_add_item(a, numpy.uint16)
    builder = IndexedDatasetBuilder(b + ".bin", dtype=numpy.uint16)
    builder.add_document([20, 21, 22], [2, 1])
    builder.finalize(b + ".idx")
    merged = IndexedDatasetBuilder(m + ".bin", dtype=numpy.uint16)
    merged.add_index(a)
    merged.add_index(b)
    merged.finalize(m + ".idx")
    lengths, doc_idx, flat = _expected_layout()
    exp_lengths = lengths + [2, 1]
    exp_docs = doc_idx + [doc_idx[-1] + 2]
    assert open(m + ".idx", "rb").read() == hand_built_idx(numpy.uint16, exp_lengths, exp_docs)
    assert (
        open(m + ".bin", "rb").read()
        == numpy.array(flat + [20, 21, 22], dtype=numpy.uint16).tobytes()
    )
    wrong = IndexedDatasetBuilder(str(tmp_path / "w.bin"), dtype=numpy.int32)
    with pytest.raises(ValueError, match="dtype"):
        wrong.add_index(a)


def test_dtype_codes_and_optimal_dtype():
    for dtype, code in DTYPE_CODES.items():
        assert DType.code_from_dtype(dtype) == code
        assert DType.dtype_from_code(code) == dtype
    assert DType.optimal_dtype(50257) == numpy.uint16
    assert DType.optimal_dtype(65500) == numpy.int32
    assert DType.optimal_dtype(None) == numpy.int32


def test_idx_without_bin(tmp_path):
    prefix = str(tmp_path / "ds")
    _write_with_add_item(prefix, numpy.uint16)
    (tmp_path / "ds.bin").unlink()
    with pytest.raises(FileNotFoundError, match=r"missing file .*ds\.bin"):
        IndexedDataset(prefix)


def test_truncated_bin(tmp_path):
    prefix = str(tmp_path / "ds")
    _write_with_add_item(prefix, numpy.uint16)
    data = open(prefix + ".bin", "rb").read()
    open(prefix + ".bin", "wb").write(data[:-2])
    with pytest.raises(ValueError, match=r"truncated data file .*\(24 bytes, the index needs 26\)"):
        IndexedDataset(prefix)


def test_truncated_or_foreign_idx(tmp_path):
    prefix = str(tmp_path / "ds")
    _write_with_add_item(prefix, numpy.uint16)
    idx = open(prefix + ".idx", "rb").read()
    open(prefix + ".idx", "wb").write(idx[:-8])
    with pytest.raises(ValueError, match="truncated index"):
        IndexedDataset(prefix)
    open(prefix + ".idx", "wb").write(b"TNTIDX\x00\x00" + idx[8:])
    with pytest.raises(ValueError, match="not a Megatron MMIDIDX index"):
        IndexedDataset(prefix)
