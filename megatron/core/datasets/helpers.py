"""Python face of the C++ index builders (`helpers_cpp`), built on first use when missing.

The functions keep Megatron's names and argument orders (megatron/core/datasets/helpers.cpp).
`build_sample_idx` picks the int32 or int64 kernel from the size of its inputs.
"""

import importlib

import numpy

_helpers_cpp = None


def _lib():
    global _helpers_cpp
    if _helpers_cpp is None:
        try:
            _helpers_cpp = importlib.import_module("megatron.core.datasets.helpers_cpp")
        except ImportError:
            from megatron.core.datasets.utils import compile_helpers

            compile_helpers()
            importlib.invalidate_caches()
            _helpers_cpp = importlib.import_module("megatron.core.datasets.helpers_cpp")
    return _helpers_cpp


def build_sample_idx(
    sizes: numpy.ndarray,
    document_indices: numpy.ndarray,
    sequence_length: int,
    num_epochs: int,
    tokens_per_epoch: int,
    drop_last_partial_sequence: bool = True,
    add_extra_token_to_sequence: bool = True,
) -> numpy.ndarray:
    """Sample index `[num_samples + 1, 2]`: (position in document_indices, token offset) per
    sample start.

    Args:
        sizes: int32 tokens per sequence of the low-level dataset.
        document_indices: int32 document order (epochs tiled and shuffled).
        sequence_length: tokens per sample (before the extra label token).
        num_epochs: epochs covered by document_indices.
        tokens_per_epoch: tokens in one epoch of the split.
        drop_last_partial_sequence: drop a trailing sample with fewer tokens.
        add_extra_token_to_sequence: samples hold sequence_length + 1 tokens (labels shift).
    """
    sizes = numpy.ascontiguousarray(sizes, dtype=numpy.int32)
    document_indices = numpy.ascontiguousarray(document_indices, dtype=numpy.int32)
    int32_max = numpy.iinfo(numpy.int32).max
    biggest = max(len(document_indices), int(sizes.max()) if len(sizes) else 0)
    fn = _lib().build_sample_idx_int32 if biggest <= int32_max else _lib().build_sample_idx_int64
    return fn(
        sizes,
        document_indices,
        int(sequence_length),
        int(num_epochs),
        int(tokens_per_epoch),
        bool(drop_last_partial_sequence),
        int(add_extra_token_to_sequence),
    )


def build_blending_indices(
    dataset_index, dataset_sample_index, weights, num_datasets, size, verbose
):
    """Fill int16 `dataset_index` and int64 `dataset_sample_index` (length `size`) in place."""
    _lib().build_blending_indices(
        dataset_index,
        dataset_sample_index,
        numpy.asarray(weights, dtype=numpy.float64),
        int(num_datasets),
        int(size),
        bool(verbose),
    )


def build_exhaustive_blending_indices(dataset_index, dataset_sample_index, sizes, num_datasets):
    """Fill the blending outputs (length sum(sizes)) until every dataset is spent."""
    _lib().build_exhaustive_blending_indices(
        dataset_index,
        dataset_sample_index,
        numpy.asarray(sizes, dtype=numpy.int64),
        int(num_datasets),
    )


def build_mapping(
    docs,
    sizes,
    num_epochs,
    max_num_samples,
    max_seq_length,
    short_seq_prob,
    seed,
    verbose,
    min_num_sent,
):
    """BERT/T5 sample map `[n, 3]` (first sentence, last sentence + 1, target length), shuffled."""
    return _lib().build_mapping(
        numpy.asarray(docs, dtype=numpy.int64),
        numpy.asarray(sizes, dtype=numpy.int32),
        int(num_epochs),
        int(max_num_samples),
        int(max_seq_length),
        float(short_seq_prob),
        int(seed),
        bool(verbose),
        int(min_num_sent),
    )


def build_blocks_mapping(
    docs,
    sizes,
    titles_sizes,
    num_epochs,
    max_num_samples,
    max_seq_length,
    seed,
    verbose,
    use_one_sent_blocks,
):
    """ICT/REALM block map `[n, 4]` (first sentence, last sentence + 1, doc, block id), shuffled."""
    return _lib().build_blocks_mapping(
        numpy.asarray(docs, dtype=numpy.int64),
        numpy.asarray(sizes, dtype=numpy.int32),
        numpy.asarray(titles_sizes, dtype=numpy.int32),
        int(num_epochs),
        int(max_num_samples),
        int(max_seq_length),
        int(seed),
        bool(verbose),
        bool(use_one_sent_blocks),
    )
