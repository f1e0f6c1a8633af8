"""The identity of a mid-level dataset: the JSON description and md5 that name its cache files.

Megatron writes `<md5>-<Class>-<split>-*.npy` next to `<md5>-...-description.txt`; an index cache
built by Megatron is reused here only if both strings come out byte for byte the same, so this
pins them for a fixed config.
"""

import hashlib

import numpy

from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
from megatron.core.datasets.megatron_tokenizer import MegatronTokenizer
from megatron.core.datasets.utils import Split


class _Tokenizer(MegatronTokenizer):
    def __init__(self):
        super().__init__('vocab.json', 'merges.txt', lowercase=True)

    def tokenize(self, text):
        return []

    def detokenize(self, ids):
        return ''

    @property
    def vocab(self):
        return {}

    @property
    def inv_vocab(self):
        return {}

    @property
    def vocab_size(self):
        return 8

    @property
    def eod(self):
        return 0


class _Identity(GPTDataset):
    """MegatronDataset's identity only: GPTDataset's index building is not under test here."""

    def __init__(self, *args):
        super(GPTDataset, self).__init__(*args)


EXPECTED = """{
    "class": "_Identity",
    "dataset_path": "/data/corpus_text_document",
    "num_samples": 12,
    "index_split": "valid",
    "random_seed": 1234,
    "sequence_length": 16,
    "split": "90,10,0",
    "split_matrix": [
        [
            0,
            0.9
        ],
        [
            0.9,
            1.0
        ],
        null
    ],
    "tokenizer": {
        "class": "_Tokenizer",
        "tokenizer_path": [
            "vocab.json",
            "merges.txt"
        ],
        "lowercase": "True"
    }
}"""


def test_description_and_hash_are_pinned():
    config = GPTDatasetConfig(
        random_seed=1234,
        sequence_length=16,
        blend=(['/data/corpus_text_document'], None),
        split='90,10,0',
        tokenizer=_Tokenizer(),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
    )
    ds = _Identity(None, '/data/corpus_text_document', numpy.arange(5), 12, Split.valid, config)
    assert ds.unique_description == EXPECTED
    assert ds.unique_description_hash == hashlib.md5(EXPECTED.encode('utf-8')).hexdigest()
    leading = ['class', 'dataset_path', 'num_samples', 'index_split']
    assert list(ds.unique_identifiers)[:4] == leading
    assert ds.built_anew_on_cache_miss is False
