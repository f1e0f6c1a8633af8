"""BERT / T5 samples equal those of Megatron's own datasets (megatron-core 0.8.0).

golden/masked_datasets.json was written by make_masked_golden.py running megatron-core 0.8.0's
BERTMaskedWordPieceDataset / T5MaskedWordPieceDataset (and its compiled helpers) on a bundled-text
corpus that the file also holds. Here the same corpus and configs go through our classes, with the
real `_BertWordPieceTokenizer`, and everything must match exactly: number of samples, the cache
description and its md5, the sample index (dtype and rows) and every key of the first samples of
each split.
"""

import json
import os
import shutil

import numpy
import pytest

from megatron.core.datasets.bert_dataset import (
    BERTMaskedWordPieceDataset,
    BERTMaskedWordPieceDatasetConfig,
)
from megatron.core.datasets.blended_megatron_dataset_builder import (
    BlendedMegatronDatasetBuilder,
)
from megatron.core.datasets.t5_dataset import (
    T5MaskedWordPieceDataset,
    T5MaskedWordPieceDatasetConfig,
)
from megatron.training.tokenizer.tokenizer import _BertWordPieceTokenizer
from tests.unit_tests.data.sentence_corpus import BERT_VOCAB, write_sentence_dataset

GOLDEN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "golden", "masked_datasets.json")

with open(GOLDEN) as _f:
    _GOLDEN = json.load(_f)

_CLASSES = {
    "bert": (BERTMaskedWordPieceDataset, BERTMaskedWordPieceDatasetConfig),
    "t5": (T5MaskedWordPieceDataset, T5MaskedWordPieceDatasetConfig),
}


def test_golden_file_comes_from_megatron():
    assert _GOLDEN["produced_by"] == "megatron-core 0.8.0"


@pytest.mark.parametrize("case", sorted(_GOLDEN["cases"]))
def test_samples_equal_megatron(case, tmp_path, monkeypatch):
    # Relative paths, as when the golden file was written, so descriptions and hashes agree.
    monkeypatch.chdir(tmp_path)
    shutil.copy(BERT_VOCAB, "bert-vocab.txt")
    spec = _GOLDEN["cases"][case]
    tokenizer = _BertWordPieceTokenizer(
        "bert-vocab.txt", lower_case=True, vocab_extra_ids=spec["vocab_extra_ids"]
    )
    write_sentence_dataset("corpus", _GOLDEN["corpus"], tokenizer.vocab_size)
    dataset_cls, config_cls = _CLASSES[spec["kind"]]
    config = config_cls(
        tokenizer=tokenizer,
        blend=(["corpus"], None),
        path_to_cache="cache",
        **_GOLDEN["common"],
        **spec["config"],
    )
    splits = BlendedMegatronDatasetBuilder(dataset_cls, spec["sizes"], lambda: True, config).build()

    for ds, expected in zip(splits, _GOLDEN["results"][case]):
        assert len(ds) == expected["num_samples"]
        assert ds.unique_description == expected["description"]
        assert ds.unique_description_hash == expected["description_hash"]
        assert str(ds.sample_index.dtype) == expected["sample_index_dtype"]
        assert numpy.asarray(ds.sample_index).tolist() == expected["sample_index"]
        for idx, golden_sample in enumerate(expected["samples"]):
            sample = ds[idx]
            for key, value in golden_sample.items():
                got = sample[key]
                got = got.tolist() if isinstance(got, numpy.ndarray) else got
                assert got == value, f"{case} split {ds.index_split.name} sample {idx} key {key}"
            if spec["kind"] == "t5":
                _check_t5_masks(sample)


def _check_t5_masks(sample):
    """The 2-D masks follow from the token ids (a position is real iff its id >= 1)."""
    enc = sample["text_enc"] >= 1
    dec = sample["text_dec"] >= 1
    causal = numpy.tril(numpy.ones((len(dec), len(dec)), dtype=bool))
    assert numpy.array_equal(sample["enc_mask"], numpy.outer(enc, enc).astype(numpy.int64))
    assert numpy.array_equal(sample["enc_dec_mask"], numpy.outer(dec, enc).astype(numpy.int64))
    assert numpy.array_equal(
        sample["dec_mask"], (numpy.outer(dec, dec) & causal).astype(numpy.int64)
    )
    assert all(sample[k].dtype == numpy.int64 for k in ("enc_mask", "dec_mask", "enc_dec_mask"))
