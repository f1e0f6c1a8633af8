"""Masked-language-model datasets over sentence-level WordPiece data (the BERT and T5 base).

A sample is a run of whole sentences of one document, chosen by `helpers.build_mapping` (rows of
first sentence, last sentence + 1, target length; shuffled) and cached as one `.npy` file. Sample
`idx` draws every random choice from its own `numpy.random.RandomState(random_seed + idx)`, so a
sample depends only on (data, config, idx), as in Megatron's
megatron/core/datasets/masked_dataset.py.

Masking (`_create_masked_lm_predictions`) picks N-grams of whole words: `[CLS]`/`[SEP]` are never
candidates, a `##` WordPiece joins the preceding word when `masking_do_full_word`; the budget is
`min(p * target_length, max(1, round(p * len(tokens))))`; N is drawn from weights proportional to
1/N (or a clipped geometric(0.2) for SpanBERT-style spans) and backed off until the N-gram fits.
"""

import logging
import os
import time
from abc import abstractmethod
from dataclasses import dataclass
from typing import List, Optional, Tuple

import numpy
import torch

from megatron.core.datasets.blended_megatron_dataset_config import (
    BlendedMegatronDatasetConfig,
)
from megatron.core.datasets.index_cache import load_index, save_index, write_text
from megatron.core.datasets.indexed_dataset import IndexedDataset
from megatron.core.datasets.megatron_dataset import MegatronDataset
from megatron.core.datasets.utils import Split, log_single_rank

logger = logging.getLogger(__name__)

# build_mapping drops multi-sentence documents holding a sentence longer than this (helpers.cpp).
LONG_SENTENCE_LEN = 512

# The span-length distribution of SpanBERT (https://arxiv.org/abs/1907.10529, section 3.1).
_GEOMETRIC_P = 0.2

MaskedSpan = Tuple[List[int], List[int]]


@dataclass
class MaskedWordPieceDatasetConfig(BlendedMegatronDatasetConfig):
    """Configuration object for Megatron Core masked WordPiece datasets.

    Every masking field is required (Megatron gives them no usable default); pretrain_bert.py and
    pretrain_t5.py fill them from `--mask-prob`, `--short-seq-prob` and fixed N-gram settings.
    """

    masking_probability: float = None
    """The probability we mask a candidate N-gram (--mask-prob)."""

    short_sequence_probability: float = None
    """The probability we return a sequence shorter than the target length (--short-seq-prob)."""

    masking_max_ngram: int = None
    """The maximum length N-gram to consider masking or permuting."""

    masking_do_full_word: bool = None
    """Whether we mask whole words (a `##` piece joins its word) rather than single pieces."""

    masking_do_permutation: bool = None
    """Whether we shuffle a subset of candidate N-grams in addition."""

    masking_use_longer_ngrams: bool = None
    """Whether to favour longer N-grams (weights proportional to N instead of 1/N)."""

    masking_use_geometric_distribution: bool = None
    """Whether to draw N from a geometric distribution (p = 0.2, clipped to masking_max_ngram)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.tokenizer is None:
            raise ValueError(f"{type(self).__name__}.tokenizer is required (masking needs its ids)")
        for name in (
            "masking_probability",
            "short_sequence_probability",
            "masking_max_ngram",
            "masking_do_full_word",
            "masking_do_permutation",
            "masking_use_longer_ngrams",
            "masking_use_geometric_distribution",
        ):
            if getattr(self, name) is None:
                raise ValueError(f"{type(self).__name__}.{name} must be set")
        if not 0.0 < self.masking_probability < 1.0:
            raise ValueError(f"--mask-prob must be in (0, 1), got {self.masking_probability}")
        if not 0.0 <= self.short_sequence_probability <= 1.0:
            raise ValueError(
                f"--short-seq-prob must be in [0, 1], got {self.short_sequence_probability}"
            )
        if self.masking_max_ngram <= 0:
            raise ValueError(f"masking_max_ngram must be > 0, got {self.masking_max_ngram}")
        if self.masking_use_geometric_distribution and self.masking_do_permutation:
            raise ValueError(
                "masking_use_geometric_distribution and masking_do_permutation are incompatible"
            )
        if self.masking_use_geometric_distribution and self.masking_use_longer_ngrams:
            log_single_rank(
                logger,
                logging.WARNING,
                "The use of a geometric distribution overrides the default distribution",
            )


class MaskedWordPieceDataset(MegatronDataset):
    """The semi-abstract base class for masked WordPiece datasets.

    Built on an IndexedDataset whose sequences are sentences and whose document_indices delimit
    documents (`tools/preprocess_data.py --split-sentences`). The train/valid/test splits are
    contiguous document ranges.

    Args:
        indexed_dataset: the sentence-level IndexedDataset.
        dataset_path: its path prefix, for bookkeeping and the default cache location.
        indexed_indices: the documents of this split (contiguous, ascending).
        num_samples: minimum number of samples; whole epochs are built, so usually more. None
            builds one epoch.
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
        config: MaskedWordPieceDatasetConfig,
    ) -> None:
        super().__init__(
            indexed_dataset, dataset_path, indexed_indices, num_samples, index_split, config
        )

    @staticmethod
    def numel_low_level_dataset(low_level_dataset: IndexedDataset) -> int:
        """The split fractions apply to documents, not sentences."""
        return low_level_dataset.document_indices.shape[0] - 1

    @staticmethod
    def build_low_level_dataset(
        dataset_path: str, config: MaskedWordPieceDatasetConfig
    ) -> IndexedDataset:
        """Open the sentence-level IndexedDataset of a prefix."""
        return IndexedDataset(dataset_path, multimodal=False, mmap=config.mmap_bin_files)

    @staticmethod
    def _key_config_attributes() -> List[str]:
        return super(MaskedWordPieceDataset, MaskedWordPieceDataset)._key_config_attributes() + [
            "masking_probability",
            "short_sequence_probability",
            "masking_max_ngram",
            "masking_do_full_word",
            "masking_do_permutation",
            "masking_use_longer_ngrams",
            "masking_use_geometric_distribution",
        ]

    def __len__(self) -> int:
        return self.sample_index.shape[0]

    def _cache_paths(self) -> Tuple[str, str, str]:
        """(cache dir, description path, sample index path), named as Megatron names them."""
        path_to_cache = self.config.path_to_cache
        if path_to_cache is None:
            path_to_cache = os.path.join(
                self.dataset.path_prefix, "cache", f"{type(self).__name__}_indices"
            )
        base = os.path.join(path_to_cache, f"{self.unique_description_hash}-{type(self).__name__}")
        return path_to_cache, f"{base}-description.txt", f"{base}-sample_index.npy"

    def _build_sample_index(
        self, sequence_length: int, min_sentences_per_sample: int
    ) -> numpy.ndarray:
        """Build (global rank 0, or without torch.distributed) and cache, or load, the sample index.

        Args:
            sequence_length: the longest target length (tokens without the special tokens).
            min_sentences_per_sample: 2 for BERT with its sentence-order head, else 1.

        Returns:
            `[n, 3]` uint32 rows (first sentence, last sentence + 1, target length), shuffled.
        """
        path_to_cache, path_to_description, path_to_sample_index = self._cache_paths()
        cache_hit = all(map(os.path.isfile, [path_to_description, path_to_sample_index]))
        builds_here = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0

        if not cache_hit and builds_here:
            log_single_rank(
                logger,
                logging.INFO,
                f"Build and save the {type(self).__name__} {self.index_split.name} indices",
            )
            self.built_anew_on_cache_miss = True
            os.makedirs(path_to_cache, exist_ok=True)
            write_text(path_to_description, self.unique_description)
            log_single_rank(
                logger,
                logging.INFO,
                f"\tBuild and save the sample index to {os.path.basename(path_to_sample_index)}",
            )
            t_beg = time.time()
            sample_index, num_epochs = self._build_mapping(
                sequence_length, min_sentences_per_sample
            )
            save_index(path_to_sample_index, sample_index)
            log_single_rank(
                logger, logging.DEBUG, f"\t> time elapsed: {time.time() - t_beg:4f} seconds"
            )
            log_single_rank(
                logger, logging.INFO, f"> total number of samples: {sample_index.shape[0]}"
            )
            log_single_rank(logger, logging.INFO, f"> total number of epochs: {num_epochs}")
            return sample_index

        log_single_rank(
            logger, logging.INFO, f"Load the {type(self).__name__} {self.index_split.name} indices"
        )
        if not cache_hit:
            raise FileNotFoundError(
                f"{type(self).__name__} {self.index_split.name} sample index not found in "
                f"{path_to_cache} (global rank 0 builds it first; is --data-cache-path shared?)"
            )
        log_single_rank(
            logger,
            logging.INFO,
            f"\tLoad the sample index from {os.path.basename(path_to_sample_index)}",
        )
        t_beg = time.time()
        sample_index = load_index(path_to_sample_index, ndim=2)
        log_single_rank(
            logger, logging.DEBUG, f"\t> time elapsed: {time.time() - t_beg:4f} seconds"
        )
        return sample_index

    def _build_mapping(
        self, sequence_length: int, min_sentences_per_sample: int
    ) -> Tuple[numpy.ndarray, int]:
        """Call helpers.build_mapping on this split's documents; returns (index, epochs allowed).

        With num_samples set, build_mapping may run up to int32_max - 1 epochs and stops at the
        first epoch boundary past num_samples. A split where no document can make a sample would
        loop over all those epochs, so that case is refused up front.

        Raises:
            ValueError: samples are requested but no document of the split can produce one.
        """
        from megatron.core.datasets import helpers

        if self.num_samples is not None:
            num_epochs = numpy.iinfo(numpy.int32).max - 1
            max_num_samples = self.num_samples
        else:
            num_epochs = 1
            max_num_samples = numpy.iinfo(numpy.uint64).max
        if len(self.indices) == 0:
            return numpy.zeros((0, 3), dtype=numpy.uint32), num_epochs

        # The document upper bound sits one past the last document of the split.
        indices = numpy.append(self.indices, self.indices[-1] + 1)
        docs = numpy.asarray(self.dataset.document_indices[indices], dtype=numpy.int64)
        sizes = self.dataset.sequence_lengths
        if max_num_samples > 0 and not _any_document_makes_a_sample(
            docs, sizes, min_sentences_per_sample
        ):
            hint = " or pass --bert-no-binary-head" if min_sentences_per_sample > 1 else ""
            raise ValueError(
                f"{type(self).__name__}: no document of the {self.index_split.name} split of "
                f"{self.dataset_path} has >= {min_sentences_per_sample} sentence(s) "
                f"(multi-sentence documents with a sentence over {LONG_SENTENCE_LEN} tokens are "
                f"skipped), but {self.num_samples} samples are requested; preprocess with "
                f"tools/preprocess_data.py --split-sentences{hint}"
            )
        sample_index = helpers.build_mapping(
            docs,
            sizes,
            num_epochs,
            max_num_samples,
            sequence_length,
            self.config.short_sequence_probability,
            self.config.random_seed,
            False,
            min_sentences_per_sample,
        )
        return sample_index, num_epochs

    def _create_masked_lm_predictions(
        self,
        token_ids: List[int],
        target_sequence_length: int,
        numpy_random_state: numpy.random.RandomState,
    ) -> Tuple[List[int], List[int], List[int], List[int], List[MaskedSpan]]:
        """Mask N-grams of whole words, drawing from `numpy_random_state` in Megatron's order.

        Draw order: shuffle the candidate list; per candidate until the budget is met, one draw
        of N (even when the candidate is then skipped as already masked) and, per masked position,
        the draws of `_get_token_mask`; then a second shuffle of the candidate list that is always
        made; then, only with masking_do_permutation, the permutation draws.

        Args:
            token_ids: the sequence, special tokens included.
            target_sequence_length: the sample's target length (sets the masking budget).
            numpy_random_state: the per-sample random state.

        Returns:
            (masked token ids, masked positions ascending, original ids at those positions,
            word/sentence boundaries (1 at `[CLS]`, `[SEP]` and word starts), masked spans as
            (positions, original ids) sorted by first position).
        """
        tokenizer = self.config.tokenizer
        special = (tokenizer.cls, tokenizer.sep)
        # e.g. [cls, id, ##id, ##id, id, ##id, sep] -> boundaries [1, 1, 0, 0, 1, 0, 1] and
        # whole-word candidates [[1, 2, 3], [4, 5]] (without full words: [[1], [2], ...]).
        boundaries = []
        candidates = []
        for i, token_id in enumerate(token_ids):
            if token_id in special:
                boundaries.append(1)
            elif not tokenizer.inv_vocab[token_id].startswith("##"):
                boundaries.append(1)
                candidates.append([i])
            else:
                boundaries.append(0)
                if self.config.masking_do_full_word and len(candidates) > 0:
                    candidates[-1].append(i)
                else:
                    candidates.append([i])

        p = self.config.masking_probability
        n_maskings = min(p * target_sequence_length, max(1, int(round(len(token_ids) * p))))

        ngram_nvals = numpy.arange(self.config.masking_max_ngram, dtype=numpy.int64) + 1
        nprobs = 1.0 / ngram_nvals
        nprobs = nprobs / nprobs.sum(keepdims=True)
        if self.config.masking_use_longer_ngrams:
            nprobs = nprobs[::-1]
        # Megatron renormalises the weights per candidate (p = w / w.sum()) before choice(p=p).
        ngram_cdf = _choice_cdf(nprobs / nprobs.sum(keepdims=True))

        # candidate -> its N-grams for N = 1..max (shorter near the end) -> word -> positions
        candidate_ngrams = [
            [candidates[idx : idx + n] for n in ngram_nvals] for idx in range(len(candidates))
        ]
        numpy_random_state.shuffle(candidate_ngrams)

        masked_token_ids = list(token_ids)
        masked_positions_and_labels = []
        masked_spans = []
        masked_indices = set()
        for ngrams in candidate_ngrams:
            if len(masked_positions_and_labels) >= n_maskings:
                break
            ngram_indices = self._draw_fitting_ngram(
                ngrams,
                ngram_cdf,
                ngram_nvals,
                n_maskings,
                len(masked_positions_and_labels),
                numpy_random_state,
                geometric=self.config.masking_use_geometric_distribution,
            )
            if ngram_indices is None or any(idx in masked_indices for idx in ngram_indices):
                continue
            for index in ngram_indices:
                masked_indices.add(index)
                mask = self._get_token_mask(numpy_random_state)
                masked_token_ids[index] = token_ids[index] if mask is None else mask
                masked_positions_and_labels.append((index, token_ids[index]))
            masked_spans.append((ngram_indices, [token_ids[index] for index in ngram_indices]))
        assert len(masked_positions_and_labels) <= n_maskings

        # Consumes random draws even when nothing follows; kept for Megatron's stream.
        numpy_random_state.shuffle(candidate_ngrams)

        if self.config.masking_do_permutation:
            self._permute_ngrams(
                candidate_ngrams,
                nprobs,
                ngram_nvals,
                n_maskings,
                masked_indices,
                masked_token_ids,
                masked_positions_and_labels,
                numpy_random_state,
            )

        masked_positions_and_labels = sorted(masked_positions_and_labels, key=lambda x: x[0])
        masked_positions = [position for position, _ in masked_positions_and_labels]
        masked_labels = [label for _, label in masked_positions_and_labels]
        masked_spans = sorted(masked_spans, key=lambda x: x[0][0])
        return masked_token_ids, masked_positions, masked_labels, boundaries, masked_spans

    def _draw_fitting_ngram(
        self,
        ngrams: List[List[List[int]]],
        ngram_cdf: numpy.ndarray,
        ngram_nvals: numpy.ndarray,
        budget: float,
        used: int,
        numpy_random_state: numpy.random.RandomState,
        geometric: bool,
    ) -> Optional[List[int]]:
        """Draw N, then back off N until the N-gram's positions fit the budget (None: none fits)."""
        # Every candidate lists one N-gram per N (shorter ones near the end), so Megatron's
        # per-candidate renormalisation of the N weights over len(ngrams) is the identity.
        assert len(ngrams) == len(ngram_nvals)
        if geometric:
            n = min(numpy_random_state.geometric(_GEOMETRIC_P), self.config.masking_max_ngram)
        else:
            n = _weighted_choice(numpy_random_state, ngram_nvals, ngram_cdf)
        while True:
            ngram_indices = sum(ngrams[n - 1], [])
            n = n - 1
            if budget >= used + len(ngram_indices):
                return ngram_indices
            if n == 0:
                return None

    def _permute_ngrams(
        self,
        candidate_ngrams: List[List[List[List[int]]]],
        nprobs: numpy.ndarray,
        ngram_nvals: numpy.ndarray,
        n_swappings: float,
        masked_indices: set,
        masked_token_ids: List[int],
        masked_positions_and_labels: List[Tuple[int, int]],
        numpy_random_state: numpy.random.RandomState,
    ) -> None:
        """Shuffle the tokens of further unmasked N-grams among themselves (in place).

        Megatron draws N here from the global `numpy.random` state, which makes the sample depend
        on whatever else seeded or used it; we draw from the per-sample state so the sample stays a
        function of (config, idx). Neither pretrain_bert.py nor pretrain_t5.py enables this branch.
        """
        permuted_indices = set()
        for ngrams in candidate_ngrams:
            if len(permuted_indices) >= n_swappings:
                break
            probs = nprobs[: len(ngrams)] / nprobs[: len(ngrams)].sum(keepdims=True)
            n = numpy_random_state.choice(ngram_nvals[: len(ngrams)], p=probs)
            while True:
                ngram_indices = sum(ngrams[n - 1], [])
                n = n - 1
                if n_swappings >= len(permuted_indices) + len(ngram_indices):
                    break
                if n == 0:
                    ngram_indices = None
                    break
            if ngram_indices is None or any(
                idx in masked_indices or idx in permuted_indices for idx in ngram_indices
            ):
                continue
            permuted_indices.update(ngram_indices)
        assert len(permuted_indices) <= n_swappings

        permuted_indices = sorted(permuted_indices)
        permuted_indices_copy = list(permuted_indices)
        numpy_random_state.shuffle(permuted_indices_copy)
        masked_token_ids_copy = list(masked_token_ids)
        for idx, idx_copy in zip(permuted_indices, permuted_indices_copy):
            masked_token_ids[idx] = masked_token_ids_copy[idx_copy]
            masked_positions_and_labels.append((idx, masked_token_ids_copy[idx]))

    @abstractmethod
    def _get_token_mask(self, numpy_random_state: numpy.random.RandomState) -> Optional[int]:
        """The replacement id for one masked position, or None to keep the original."""


def _choice_cdf(probs: numpy.ndarray) -> numpy.ndarray:
    """The cumulative table `RandomState.choice(a, p=probs)` builds: p.cumsum() / its last entry."""
    cdf = probs.cumsum()
    cdf /= cdf[-1]
    return cdf


def _weighted_choice(
    numpy_random_state: numpy.random.RandomState, values: numpy.ndarray, cdf: numpy.ndarray
) -> numpy.int64:
    """`numpy_random_state.choice(values, p=probs)` with its cdf precomputed (`_choice_cdf`).

    RandomState.choice(a, p) draws exactly one random_sample() and returns
    a[cdf.searchsorted(u, side='right')]; legacy RandomState streams are frozen, so this gives the
    same value and leaves the state where choice would, without re-validating p on every call.
    """
    return values[cdf.searchsorted(numpy_random_state.random_sample(), side="right")]


def _any_document_makes_a_sample(
    docs: numpy.ndarray, sizes: numpy.ndarray, min_num_sent: int
) -> bool:
    """Whether build_mapping keeps at least one document of `docs` (sentence-boundary array).

    A document is kept when it has >= min_num_sent sentences and, if it has more than one, none of
    them is longer than LONG_SENTENCE_LEN; every kept document yields at least one sample.
    """
    counts = numpy.diff(docs)
    first = int(docs[0])
    too_long = numpy.asarray(sizes[first : int(docs[-1])]) > LONG_SENTENCE_LEN
    eligible = counts >= max(min_num_sent, 1)
    if too_long.any():
        doc_of_sentence = numpy.repeat(numpy.arange(len(counts)), counts)
        long_per_doc = numpy.bincount(doc_of_sentence[too_long], minlength=len(counts))
        eligible &= (counts <= 1) | (long_per_doc == 0)
    return bool(eligible.any())
