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

# The masking fields, in the order they enter the dataset description (and so its cache hash).
_MASKING_FIELDS = (
    "masking_probability",
    "short_sequence_probability",
    "masking_max_ngram",
    "masking_do_full_word",
    "masking_do_permutation",
    "masking_use_longer_ngrams",
    "masking_use_geometric_distribution",
)


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
        unset = [name for name in _MASKING_FIELDS if getattr(self, name) is None]
        if unset:
            raise ValueError(f"{type(self).__name__}.{unset[0]} must be set")
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
        if self.masking_use_longer_ngrams and self.masking_use_geometric_distribution:
            # Not an error: the geometric draw simply ignores the N weights.
            message = "The use of a geometric distribution overrides the default distribution"
            log_single_rank(logger, logging.WARNING, message)


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
        # Megatron's parameter names here differ from the base class's; map them across.
        super().__init__(
            dataset=indexed_dataset,
            indices=indexed_indices,
            dataset_path=dataset_path,
            num_samples=num_samples,
            index_split=index_split,
            config=config,
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
        base = super(MaskedWordPieceDataset, MaskedWordPieceDataset)._key_config_attributes()
        return base + list(_MASKING_FIELDS)

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
        cache_hit = os.path.isfile(path_to_description) and os.path.isfile(path_to_sample_index)
        builds_here = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
        name, split = type(self).__name__, self.index_split.name
        index_file = os.path.basename(path_to_sample_index)
        started = time.time()

        if cache_hit or not builds_here:
            _info(f"Load the {name} {split} indices")
            if not cache_hit:
                raise FileNotFoundError(
                    f"{name} {split} sample index not found in "
                    f"{path_to_cache} (global rank 0 builds it first; is --data-cache-path shared?)"
                )
            _info(f"\tLoad the sample index from {index_file}")
            started = time.time()
            sample_index = load_index(path_to_sample_index, ndim=2)
            _debug_elapsed(started)
            return sample_index

        _info(f"Build and save the {name} {split} indices")
        self.built_anew_on_cache_miss = True
        os.makedirs(path_to_cache, exist_ok=True)
        # The description goes first: a reader that finds both files knows what they index.
        write_text(path_to_description, self.unique_description)
        _info(f"\tBuild and save the sample index to {index_file}")
        started = time.time()
        sample_index, num_epochs = self._build_mapping(sequence_length, min_sentences_per_sample)
        save_index(path_to_sample_index, sample_index)
        _debug_elapsed(started)
        _info(f"> total number of samples: {sample_index.shape[0]}")
        _info(f"> total number of epochs: {num_epochs}")
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
        for position, token_id in enumerate(token_ids):
            if token_id in special:
                boundaries.append(1)  # a boundary, but never masked
                continue
            continues_word = tokenizer.inv_vocab[token_id].startswith("##")
            boundaries.append(0 if continues_word else 1)
            joins_previous = continues_word and self.config.masking_do_full_word and candidates
            if joins_previous:
                candidates[-1].append(position)
            else:
                candidates.append([position])

        p = self.config.masking_probability
        n_maskings = min(p * target_sequence_length, max(1, int(round(len(token_ids) * p))))

        ngram_nvals = numpy.arange(self.config.masking_max_ngram, dtype=numpy.int64) + 1
        nprobs = 1.0 / ngram_nvals
        nprobs = nprobs / nprobs.sum(keepdims=True)
        if self.config.masking_use_longer_ngrams:
            nprobs = nprobs[::-1]
        # Megatron renormalises the weights per candidate (p = w / w.sum()) before choice(p=p).
        ngram_cdf = _choice_cdf(nprobs / nprobs.sum(keepdims=True))

        candidate_ngrams = _ngrams_per_candidate(candidates, self.config.masking_max_ngram)
        numpy_random_state.shuffle(candidate_ngrams)
        masked_token_ids, masked_positions_and_labels, masked_spans, masked_indices = (
            self._mask_ngrams(
                token_ids, candidate_ngrams, ngram_cdf, ngram_nvals, n_maskings, numpy_random_state
            )
        )
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

    def _mask_ngrams(
        self,
        token_ids: List[int],
        candidate_ngrams: List[List[List[List[int]]]],
        ngram_cdf: numpy.ndarray,
        ngram_nvals: numpy.ndarray,
        n_maskings: float,
        numpy_random_state: numpy.random.RandomState,
    ) -> Tuple[List[int], List[Tuple[int, int]], List[MaskedSpan], set]:
        """Walk the shuffled candidates, masking N-grams until the budget is spent.

        Returns (masked token ids, (position, original id) pairs in masking order, spans, the set
        of masked positions).
        """
        masked_indices = set()
        picked = []
        spans = []
        out = list(token_ids)
        for ngrams in candidate_ngrams:
            if len(picked) >= n_maskings:
                break
            # N is drawn for every visited candidate, even one that is then skipped.
            ngram_indices = self._draw_fitting_ngram(
                ngrams,
                ngram_cdf,
                ngram_nvals,
                n_maskings,
                len(picked),
                numpy_random_state,
                geometric=self.config.masking_use_geometric_distribution,
            )
            if ngram_indices is None or not masked_indices.isdisjoint(ngram_indices):
                continue
            originals = [token_ids[position] for position in ngram_indices]
            for position, original in zip(ngram_indices, originals):
                masked_indices.add(position)
                replacement = self._get_token_mask(numpy_random_state)
                out[position] = original if replacement is None else replacement
                picked.append((position, original))
            spans.append((ngram_indices, originals))
        return out, picked, spans, masked_indices

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
        return _fit_ngram(ngrams, n, budget, used)

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
        permuted = set()
        for ngrams in candidate_ngrams:
            if len(permuted) >= n_swappings:
                break
            allowed = len(ngrams)
            weights = nprobs[:allowed]
            n = numpy_random_state.choice(
                ngram_nvals[:allowed], p=weights / weights.sum(keepdims=True)
            )
            ngram_indices = _fit_ngram(ngrams, n, n_swappings, len(permuted))
            if ngram_indices is None:
                continue
            if masked_indices.isdisjoint(ngram_indices) and permuted.isdisjoint(ngram_indices):
                permuted.update(ngram_indices)
        assert len(permuted) <= n_swappings

        # Each permuted position takes the token of a shuffled partner position.
        targets = sorted(permuted)
        sources = list(targets)
        numpy_random_state.shuffle(sources)
        before = list(masked_token_ids)
        for target, source in zip(targets, sources):
            masked_token_ids[target] = before[source]
            masked_positions_and_labels.append((target, before[target]))

    @abstractmethod
    def _get_token_mask(self, numpy_random_state: numpy.random.RandomState) -> Optional[int]:
        """The replacement id for one masked position, or None to keep the original."""


def _info(message: str) -> None:
    log_single_rank(logger, logging.INFO, message)


def _debug_elapsed(started: float) -> None:
    log_single_rank(logger, logging.DEBUG, f"\t> time elapsed: {time.time() - started:4f} seconds")


def _ngrams_per_candidate(
    candidates: List[List[int]], max_ngram: int
) -> List[List[List[List[int]]]]:
    """For each candidate word, its N-grams for N = 1..max_ngram (each a list of words).

    Near the end of the sequence the slices run short, so the last N-grams repeat shorter ones;
    every candidate still lists exactly max_ngram of them.
    """
    return [
        [candidates[start : start + n] for n in range(1, max_ngram + 1)]
        for start in range(len(candidates))
    ]


def _fit_ngram(ngrams: List[List[List[int]]], n, budget: float, used: int) -> Optional[List[int]]:
    """Positions of the N-gram of size n, shrinking n until they fit in `budget - used`.

    None when even the 1-gram does not fit.
    """
    for size in range(int(n), 0, -1):
        positions = [position for word in ngrams[size - 1] for position in word]
        if used + len(positions) <= budget:
            return positions
    return None


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
