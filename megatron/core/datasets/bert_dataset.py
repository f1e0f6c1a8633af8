"""BERT masked-LM + sentence-order samples over sentence-level WordPiece data.

Sample `idx` (as Megatron's megatron/core/datasets/bert_dataset.py builds it):

1. Row (beg, end, target) of the sample index -> sentences beg..end-1 of one document.
2. With the classification head: pivot = randint(1, n_sentences) when there are >= 3 sentences
   (else 1, no draw); segment A = sentences before the pivot, B = the rest; `random() < 0.5`
   swaps A and B (sentence-order prediction, `is_random` = 1). Without the head all is A.
3. While len(A) + len(B) > target: from the longer segment (ties -> B) drop the first token if
   `random() < 0.5` else the last one.
4. `[CLS] A [SEP] B [SEP]` (B part only when B is non-empty), types 0 for `[CLS]` A `[SEP]` and 1
   for B `[SEP]`; masking with the budget of `target`; 80 % `[MASK]`, 10 % a random id of the whole
   vocabulary, 10 % kept.
5. Padding to `sequence_length`: text, types and padding_mask are padded with the tokenizer's
   pad id, labels with -1.
"""

from dataclasses import dataclass
from typing import Dict, List, Optional, Union

import numpy

from megatron.core.datasets.indexed_dataset import IndexedDataset
from megatron.core.datasets.masked_dataset import (
    MaskedWordPieceDataset,
    MaskedWordPieceDatasetConfig,
)
from megatron.core.datasets.utils import Split


@dataclass
class BERTMaskedWordPieceDatasetConfig(MaskedWordPieceDatasetConfig):
    """Configuration object for Megatron Core BERT WordPiece datasets."""

    classification_head: bool = None
    """Two segments per sample for sentence-order prediction (not --bert-no-binary-head)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.classification_head is None:
            raise ValueError("BERTMaskedWordPieceDatasetConfig.classification_head must be set")
        if self.sequence_length < 5:
            # build_mapping needs a target length (sequence length - 3) of at least 2.
            raise ValueError(f"--seq-length must be >= 5 for BERT data, got {self.sequence_length}")


class BERTMaskedWordPieceDataset(MaskedWordPieceDataset):
    """The BERT dataset that assumes WordPiece tokenization.

    Args:
        indexed_dataset: the sentence-level IndexedDataset.
        dataset_path: its path prefix.
        indexed_indices: the documents of this split.
        num_samples: minimum number of samples (whole epochs are built).
        index_split: the split.
        config: the config.
    """

    def __init__(
        self,
        indexed_dataset: IndexedDataset,
        dataset_path: str,
        indexed_indices: numpy.ndarray,
        num_samples: Optional[int],
        index_split: Split,
        config: BERTMaskedWordPieceDatasetConfig,
    ) -> None:
        super().__init__(
            indexed_dataset,
            dataset_path,
            indexed_indices,
            num_samples=num_samples,
            index_split=index_split,
            config=config,
        )
        # Every id of the vocabulary, for the 10 % of masked positions that get a random token.
        self.token_lookup = list(config.tokenizer.inv_vocab.keys())
        # Leave room for one [CLS] and two [SEP].
        self.sample_index = self._build_sample_index(
            self.config.sequence_length - 3, 2 if self.config.classification_head else 1
        )

    @staticmethod
    def _key_config_attributes() -> List[str]:
        return super(
            BERTMaskedWordPieceDataset, BERTMaskedWordPieceDataset
        )._key_config_attributes() + ["classification_head"]

    def __getitem__(self, idx: int) -> Dict[str, Union[int, numpy.ndarray]]:
        """Sample `idx`: text, types, labels, is_random, padding_mask, loss_mask, truncated."""
        idx_beg, idx_end, target_sequence_length = (int(v) for v in self.sample_index[idx])
        sample = [self.dataset[i].tolist() for i in range(idx_beg, idx_end)]
        numpy_random_state = numpy.random.RandomState(seed=(self.config.random_seed + idx) % 2**32)
        assert target_sequence_length <= self.config.sequence_length
        tokenizer = self.config.tokenizer

        split_a, split_b, is_next_random = self._split_segments(sample, numpy_random_state)
        truncated = _truncate_segments(split_a, split_b, target_sequence_length, numpy_random_state)

        tokens = [tokenizer.cls, *split_a, tokenizer.sep]
        assignments = [0] * (1 + len(split_a) + 1)
        if split_b:
            tokens += [*split_b, tokenizer.sep]
            assignments += [1] * (len(split_b) + 1)

        tokens, masked_positions, masked_labels, _, _ = self._create_masked_lm_predictions(
            tokens, target_sequence_length, numpy_random_state
        )

        length_toks = len(tokens)
        length_pads = self.config.sequence_length - length_toks
        assert length_pads >= 0
        pad = (0, length_pads)
        # types and padding_mask are padded with the pad id too (0 for BERT vocabularies).
        text = numpy.pad(numpy.array(tokens, dtype=numpy.int64), pad, constant_values=tokenizer.pad)
        types = numpy.pad(
            numpy.array(assignments, dtype=numpy.int64), pad, constant_values=tokenizer.pad
        )
        padding_mask = numpy.pad(
            numpy.ones(length_toks, dtype=numpy.int64), pad, constant_values=tokenizer.pad
        )
        labels = numpy.full(self.config.sequence_length, -1, dtype=numpy.int64)
        labels[masked_positions] = masked_labels
        loss_mask = numpy.zeros(self.config.sequence_length, dtype=numpy.int64)
        loss_mask[masked_positions] = 1

        return {
            "text": text,
            "types": types,
            "labels": labels,
            "is_random": int(is_next_random),
            "padding_mask": padding_mask,
            "loss_mask": loss_mask,
            "truncated": int(truncated),
        }

    def _split_segments(self, sample: List[List[int]], numpy_random_state):
        """(segment A tokens, segment B tokens, swapped) with the pivot and swap draws."""
        if not self.config.classification_head:
            # No sentence-order task: everything is segment A and nothing is drawn.
            return _concat(sample), [], False
        assert len(sample) > 1, "the sample must contain at least two sentences"
        # Two sentences leave one possible cut; the pivot draw happens only with more.
        pivot = 1 if len(sample) < 3 else numpy_random_state.randint(low=1, high=len(sample))
        swapped = numpy_random_state.random() < 0.5
        first, second = _concat(sample[:pivot]), _concat(sample[pivot:])
        return (second, first, swapped) if swapped else (first, second, swapped)

    def _get_token_mask(self, numpy_random_state: numpy.random.RandomState) -> Optional[int]:
        """80 %: [MASK]; 10 %: a uniformly random id of the whole vocabulary; 10 %: None (keep)."""
        if numpy_random_state.random() < 0.8:
            return self.config.tokenizer.mask
        if numpy_random_state.random() >= 0.5:
            return self.token_lookup[numpy_random_state.randint(0, len(self.token_lookup))]
        return None


def _concat(sentences: List[List[int]]) -> List[int]:
    return [token for sentence in sentences for token in sentence]


def _truncate_segments(
    split_a: List[int], split_b: List[int], target: int, numpy_random_state
) -> bool:
    """Drop tokens in place, one random draw each, until both segments fit `target`.

    The longer segment loses a token (B on a tie): its first if `random() < 0.5`, else its last.
    Returns whether anything was dropped.
    """
    if len(split_a) + len(split_b) <= target:
        return False
    while len(split_a) + len(split_b) > target:
        split = split_a if len(split_a) > len(split_b) else split_b
        if numpy_random_state.random() < 0.5:
            del split[0]
        else:
            del split[-1]
    return True
