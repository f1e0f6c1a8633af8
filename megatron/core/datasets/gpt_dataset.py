"""GPT dataset: fixed-length samples cut across document boundaries, in a seeded shuffled order.

Three indices are built once per (data, split, config), cached as `.npy`, and reused (as in
Megatron's megatron/core/datasets/gpt_dataset.py):

- document_index: the split's documents tiled over the epochs and shuffled (int32); with the
  separate-last-epoch rule the last epoch is shuffled on its own;
- sample_index `[n + 1, 2]`: (position in document_index, offset) where each sample starts (C++);
- shuffle_index: a permutation of the samples (uint32, or int64 when huge), again with the last
  epoch shuffled separately when separated.

Sample i reads `sequence_length + 1` tokens starting at sample_index[shuffle_index[i]].
"""

import logging
import os
import time
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import numpy
import torch

from megatron.core.datasets import index_memo
from megatron.core.datasets.blended_megatron_dataset_config import BlendedMegatronDatasetConfig
from megatron.core.datasets.index_cache import load_index, save_index, write_text
from megatron.core.datasets.indexed_dataset import IndexedDataset
from megatron.core.datasets.megatron_dataset import MegatronDataset
from megatron.core.datasets.megatron_tokenizer import MegatronTokenizer
from megatron.core.datasets.utils import Split, log_single_rank

logger = logging.getLogger(__name__)

_PAD_TOKEN_ID = -1


@dataclass
class GPTDatasetConfig(BlendedMegatronDatasetConfig):
    """Configuration object for Megatron Core GPT datasets."""

    reset_position_ids: bool = None
    """Restart position ids after every EOD token (--reset-position-ids)."""

    reset_attention_mask: bool = None
    """Stop tokens attending across an EOD token (--reset-attention-mask)."""

    eod_mask_loss: bool = None
    """Zero the loss on EOD tokens (--eod-mask-loss)."""

    create_attention_mask: bool = True
    """Return an explicit attention mask (bool [1, s, s], True = masked)."""

    drop_last_partial_validation_sequence: bool = True
    """Drop the last partial validation sample (else pad it)."""

    add_extra_token_to_sequence: bool = True
    """Read sequence_length + 1 tokens so tokens and labels both have sequence_length."""

    s3_cache_path: str = None
    """Where Megatron caches the index files of data read from S3 (--s3-cache-path). S3 data is
    not read here: the keyword is accepted (Megatron's scripts pass it) and refused when set."""

    def __post_init__(self) -> None:
        if self.s3_cache_path is not None:
            raise ValueError(
                f"GPTDatasetConfig.s3_cache_path={self.s3_cache_path!r} (--s3-cache-path): "
                "reading datasets from S3 is not supported; use a local or mounted --data-path"
            )
        super().__post_init__()
        if self.tokenizer is None:
            raise ValueError("GPTDatasetConfig.tokenizer is required (the EOD id comes from it)")
        for name in ("reset_position_ids", "reset_attention_mask", "eod_mask_loss"):
            if getattr(self, name) is None:
                raise ValueError(f"GPTDatasetConfig.{name} must be set (True or False)")


class GPTDataset(MegatronDataset):
    """The base GPT dataset.

    Args:
        indexed_dataset: the IndexedDataset the samples are cut from.
        dataset_path: its path prefix, for bookkeeping.
        indexed_indices: the sequences (documents) of this split.
        num_samples: minimum number of samples; None = one epoch.
        index_split: the split.
        config: the config.

    Raises:
        ValueError: when samples are requested from a split with no tokens.
    """

    def __init__(
        self,
        indexed_dataset: IndexedDataset,
        dataset_path: Optional[str],
        indexed_indices: numpy.ndarray,
        num_samples: Optional[int],
        index_split: Split,
        config: GPTDatasetConfig,
    ) -> None:
        # Megatron names the low-level dataset and its indices differently from the base class.
        super().__init__(
            dataset=indexed_dataset,
            indices=indexed_indices,
            dataset_path=dataset_path,
            num_samples=num_samples,
            index_split=index_split,
            config=config,
        )
        # Without per-document resets every sample has the same masks and positions: keep one.
        self.masks_and_position_ids_are_cacheable = not (
            config.reset_position_ids or config.reset_attention_mask or config.eod_mask_loss
        )
        self.masks_and_position_ids_are_cached = False
        self.cached_attention_mask = self.cached_loss_mask = self.cached_position_ids = None
        self._pad_token_id = _pad_id_of(config.tokenizer)

        self.document_index, self.sample_index, self.shuffle_index = (
            self._build_document_sample_shuffle_indices()
        )

    @staticmethod
    def numel_low_level_dataset(low_level_dataset: IndexedDataset) -> int:
        """GPT splits the IndexedDataset by sequence (one per document for document-level data)."""
        return low_level_dataset.sequence_lengths.shape[0]

    @staticmethod
    def build_low_level_dataset(dataset_path: str, config: GPTDatasetConfig) -> IndexedDataset:
        """Open the IndexedDataset of a prefix."""
        return IndexedDataset(dataset_path, multimodal=False, mmap=config.mmap_bin_files)

    def __len__(self) -> int:
        return self.sample_index.shape[0] - 1

    def __getitem__(self, idx: Optional[int]) -> Dict[str, torch.Tensor]:
        """Sample `idx` as tokens, labels, (attention_mask), loss_mask, position_ids.

        idx None returns a padding sample (sample 0 with an all-zero loss mask).
        """
        if idx is not None and not (-len(self) <= idx < len(self)):
            raise IndexError(
                f"{type(self).__name__} index {idx} out of range ({len(self)} samples)"
            )
        text, _ = self._query_document_sample_shuffle_indices(0 if idx is None else idx)
        ids = torch.from_numpy(text).long()
        if self.config.add_extra_token_to_sequence:
            # Views of one buffer: the padding fix-ups below run in this order on purpose.
            tokens, labels = ids[:-1].contiguous(), ids[1:].contiguous()
        else:
            # The sample is exactly one window; the label after its last token is unknown.
            tokens = ids
            labels = torch.cat([ids[1:], ids.new_full((1,), self._pad_token_id)])

        if self.masks_and_position_ids_are_cached:
            attention_mask = self.cached_attention_mask
            loss_mask = self.cached_loss_mask
            position_ids = self.cached_position_ids
        else:
            cfg = self.config
            masks = _get_ltor_masks_and_position_ids(
                tokens, cfg.tokenizer.eod, cfg.reset_position_ids, cfg.reset_attention_mask,
                cfg.eod_mask_loss, cfg.create_attention_mask,
            )  # fmt: skip
            attention_mask, loss_mask, position_ids = masks
            if self.masks_and_position_ids_are_cacheable:
                self.cached_attention_mask, self.cached_loss_mask, self.cached_position_ids = masks
                self.masks_and_position_ids_are_cached = True
        # Never hand out (and then mutate) the cached tensors themselves.
        loss_mask = loss_mask.clone()

        # Padded positions carry no loss and a valid embedding id.
        loss_mask[labels == self._pad_token_id] = 0.0
        tokens[tokens == self._pad_token_id] = 0
        labels[labels == self._pad_token_id] = 0
        if idx is None:
            loss_mask = torch.zeros_like(loss_mask)

        sample = {"tokens": tokens, "labels": labels}
        if self.config.create_attention_mask:
            sample["attention_mask"] = attention_mask
        sample["loss_mask"] = loss_mask
        sample["position_ids"] = position_ids
        return sample

    def _query_document_sample_shuffle_indices(
        self, idx: int
    ) -> Tuple[numpy.ndarray, numpy.ndarray]:
        """Token ids (int64, sequence_length + extra) and document ids of sample `idx`."""
        tokens, document_ids = self._query_unpadded(idx)
        target = self.config.sequence_length + int(self.config.add_extra_token_to_sequence)
        if len(tokens) < target:
            pad = numpy.full(target - len(tokens), self._pad_token_id, dtype=numpy.int64)
            tokens = numpy.concatenate((tokens, pad))
        return tokens, document_ids

    def _query_unpadded(self, idx: int) -> Tuple[numpy.ndarray, numpy.ndarray]:
        """The real tokens of sample `idx` (fewer than a sample only at the end of the data; a
        pad id equal to a real token id, e.g. pad = end of document, stays unambiguous) and its
        document ids."""
        row = self.shuffle_index[idx]
        first_doc, first_offset = (int(v) for v in self.sample_index[row])
        last_doc, last_offset = (int(v) for v in self.sample_index[row + 1])
        extra = int(self.config.add_extra_token_to_sequence)

        positions = range(first_doc, last_doc + 1)
        document_ids = [self.document_index[pos] for pos in positions]
        parts = []
        for pos in positions:
            start = first_offset if pos == first_doc else 0
            # The sample stops inside its last document (one token later with the extra token);
            # the documents before it are read to their end.
            length = last_offset + extra - start if pos == last_doc else None
            parts.append(self.dataset.get(self.document_index[pos], offset=start, length=length))

        return (
            numpy.concatenate(parts, dtype=numpy.int64),
            numpy.array(document_ids, dtype=numpy.int64),
        )

    def _cache_paths(self) -> Optional[Dict[str, str]]:
        path_to_cache = self.config.path_to_cache
        if path_to_cache is None and not self.config.mock:
            path_to_cache = os.path.join(
                self.dataset.path_prefix, "cache", f"{type(self).__name__}_indices"
            )
        if not path_to_cache:
            return None
        base = f"{self.unique_description_hash}-{type(self).__name__}-{self.index_split.name}"
        return {
            "dir": path_to_cache,
            "description": os.path.join(path_to_cache, f"{base}-description.txt"),
            "document_index": os.path.join(path_to_cache, f"{base}-document_index.npy"),
            "sample_index": os.path.join(path_to_cache, f"{base}-sample_index.npy"),
            "shuffle_index": os.path.join(path_to_cache, f"{base}-shuffle_index.npy"),
        }

    def _build_document_sample_shuffle_indices(
        self,
    ) -> Tuple[numpy.ndarray, numpy.ndarray, numpy.ndarray]:
        """Build (on rank 0, or every rank without a cache) or load the three indices."""
        paths = self._cache_paths()
        kinds = ("document_index", "sample_index", "shuffle_index")
        cache_hit = paths is not None and all(
            os.path.isfile(paths[kind]) for kind in ("description",) + kinds
        )
        writer = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
        name, split = type(self).__name__, self.index_split.name

        # Without a cache every rank builds its own copy; with one, rank 0 writes it first.
        if paths is not None and (cache_hit or not writer):
            log_single_rank(logger, logging.INFO, f"Load the {name} {split} indices")
            if not cache_hit:
                raise FileNotFoundError(
                    f"{name} {split} indices not found in "
                    f"{paths['dir']} (rank 0 builds them; was it built with the same config?)"
                )
            ndims = {"document_index": 1, "sample_index": 2, "shuffle_index": 1}
            indices = tuple(load_index(paths[kind], ndim=ndims[kind]) for kind in kinds)
        else:
            log_single_rank(logger, logging.INFO, f"Build and save the {name} {split} indices")
            self.built_anew_on_cache_miss = True
            started = time.time()
            indices = self._build_indices(memo=paths is None)
            self._save_indices(paths, dict(zip(kinds, indices)))
            elapsed = time.time() - started
            log_single_rank(logger, logging.DEBUG, f"\t> time elapsed: {elapsed:4f} seconds")
        # The sample index holds one boundary row more than there are samples.
        log_single_rank(
            logger, logging.INFO, f"> total number of samples: {indices[1].shape[0] - 1}"
        )
        return indices

    def _save_indices(self, paths: Optional[dict], arrays: dict) -> None:
        """Write the description, then each index, to the cache (a warning without one)."""
        if paths is None:
            log_single_rank(
                logger,
                logging.WARNING,
                f"Unable to save the {type(self).__name__} indexes because path_to_cache is None",
            )
            return
        os.makedirs(paths["dir"], exist_ok=True)
        write_text(paths["description"], self.unique_description)
        for kind, array in arrays.items():
            save_index(paths[kind], array)

    def _build_indices(
        self, memo: bool = False
    ) -> Tuple[numpy.ndarray, numpy.ndarray, numpy.ndarray]:
        """Build the three indices; with `memo`, reuse this process's earlier build of the same
        (see index_memo.py: only for builds that have no on-disk cache)."""
        sequence_length = self.config.sequence_length
        extra = int(self.config.add_extra_token_to_sequence)
        num_tokens_per_epoch = self._get_num_tokens_per_epoch()
        if num_tokens_per_epoch == 0 and self.num_samples:
            raise ValueError(
                f"{type(self).__name__}: the {self.index_split.name} split of {self.dataset_path} "
                f"has {len(self.indices)} documents and no tokens, but {self.num_samples} samples "
                f"are requested from it (check --split {self.config.split})"
            )
        num_epochs = self._get_num_epochs(num_tokens_per_epoch)

        separate_final_epoch, num_samples_sans_final_epoch = False, None
        if num_epochs > 1:
            samples_per_epoch = (num_tokens_per_epoch - extra) // sequence_length
            num_samples_sans_final_epoch = (
                (num_epochs - 1) * num_tokens_per_epoch - extra
            ) // sequence_length
            in_final_epoch = self.num_samples - num_samples_sans_final_epoch
            assert 0 <= in_final_epoch <= samples_per_epoch + 1, (in_final_epoch, samples_per_epoch)
            # A final epoch that is used for under 80% of its samples is shuffled on its own, so
            # that the samples it adds do not crowd out whole earlier epochs.
            separate_final_epoch = in_final_epoch < int(0.80 * samples_per_epoch)
            log_single_rank(
                logger, logging.DEBUG, f"> num_samples_from_final_epoch: {in_final_epoch}"
            )
            log_single_rank(logger, logging.DEBUG, f"> num_samples_per_epoch: {samples_per_epoch}")
        log_single_rank(logger, logging.DEBUG, f"> separate_final_epoch: {separate_final_epoch}")

        drop_last_partial_sequence = (
            self.config.drop_last_partial_validation_sequence
            if self.index_split == Split.valid
            else True
        )
        sequence_lengths = numpy.asarray(self.dataset.sequence_lengths, dtype=numpy.int32)

        def build():
            numpy_random_state = numpy.random.RandomState(self.config.random_seed)
            document_index = _build_document_index(
                self.indices, num_epochs, numpy_random_state, separate_final_epoch
            )
            from megatron.core.datasets import helpers

            assert document_index.dtype == numpy.int32
            sample_index = helpers.build_sample_idx(
                sequence_lengths,
                document_index,
                sequence_length,
                num_epochs,
                num_tokens_per_epoch,
                drop_last_partial_sequence,
                extra,
            )
            num_built = sample_index.shape[0] - 1
            first_block = num_samples_sans_final_epoch if separate_final_epoch else num_built
            shuffle_index = _build_shuffle_index(first_block, num_built, numpy_random_state)
            return document_index, sample_index, shuffle_index

        log_single_rank(logger, logging.INFO, f"> total number of epochs: {num_epochs}")
        if not memo:
            return build()
        # Everything the three indices are a function of (num_samples only through the plan).
        key = index_memo.digest(
            type(self).__name__,
            numpy.asarray(self.indices),
            sequence_lengths[self.indices],
            self.config.random_seed,
            sequence_length,
            extra,
            num_epochs,
            num_tokens_per_epoch,
            separate_final_epoch,
            num_samples_sans_final_epoch,
            drop_last_partial_sequence,
        )
        return index_memo.memoized(key, build)

    def _get_num_tokens_per_epoch(self) -> int:
        """Tokens in one epoch of this split."""
        return int(numpy.sum(self.dataset.sequence_lengths[self.indices], dtype=numpy.int64))

    def _get_num_epochs(self, num_tokens_per_epoch: int) -> int:
        """Smallest E >= 1 with E * tokens_per_epoch >= num_samples * sequence_length + extra."""
        if self.num_samples is None:
            return 1
        num_tokens_requested = self.num_samples * self.config.sequence_length + int(
            self.config.add_extra_token_to_sequence
        )
        if num_tokens_per_epoch <= 0:
            return 1
        return max(1, -(-num_tokens_requested // num_tokens_per_epoch))  # ceil division


def _build_document_index(
    documents: numpy.ndarray,
    num_epochs: int,
    numpy_random_state: numpy.random.RandomState,
    separate_final_epoch: bool,
) -> numpy.ndarray:
    """The documents tiled num_epochs times (int32) and shuffled; last epoch apart when
    separated."""
    if separate_final_epoch and num_epochs > 1:
        # The last epoch is shuffled apart, drawn from the RNG after the others.
        earlier = _build_document_index(documents, num_epochs - 1, numpy_random_state, False)
        final = _build_document_index(documents, 1, numpy_random_state, False)
        return numpy.concatenate((earlier, final))
    tiled = numpy.tile(numpy.asarray(documents), num_epochs).astype(numpy.int32)
    numpy_random_state.shuffle(tiled)
    return tiled


def _build_shuffle_index(
    num_samples: int, total_size: int, numpy_random_state: numpy.random.RandomState
) -> numpy.ndarray:
    """A shuffled arange(0, num_samples), then a shuffled arange(num_samples, total_size) if
    larger."""
    # 32-bit indices halve the file; only a sample count near 2**32 needs 64 bits.
    dtype = numpy.int64 if total_size >= numpy.iinfo(numpy.uint32).max - 1 else numpy.uint32
    blocks = [numpy.arange(num_samples, dtype=dtype)]
    if num_samples != total_size:
        blocks.append(numpy.arange(num_samples, total_size, dtype=dtype))
    for block in blocks:  # in order: the RNG draws decide the permutation
        numpy_random_state.shuffle(block)
    return blocks[0] if len(blocks) == 1 else numpy.concatenate(blocks)


def _get_ltor_masks_and_position_ids(
    data: torch.Tensor,
    eod_token: int,
    reset_position_ids: bool,
    reset_attention_mask: bool,
    eod_mask_loss: bool,
    create_attention_mask: bool,
):
    """Causal mask (bool [1, s, s], True = masked), loss mask [s] and position ids [s].

    With reset_attention_mask, tokens after an EOD cannot see tokens up to and including it; with
    reset_position_ids, positions restart after each EOD; with eod_mask_loss, EOD tokens get 0 loss.
    """
    seq_length = data.numel()
    device = data.device
    is_eod = data == eod_token
    loss_mask = torch.ones(seq_length, dtype=torch.float, device=device)
    if eod_mask_loss:
        loss_mask[is_eod] = 0.0
    position_ids = torch.arange(seq_length, dtype=torch.long, device=device)
    # 1 = may attend: the lower triangle, turned into True = blocked at the end.
    attention_mask = None
    if create_attention_mask:
        attention_mask = torch.ones((seq_length, seq_length), device=device).tril().unsqueeze(0)

    if reset_position_ids or reset_attention_mask:
        doc_start = 0
        for eod in torch.nonzero(is_eod).flatten().tolist():
            after = eod + 1
            if reset_attention_mask and attention_mask is not None:
                attention_mask[0, after:, :after] = 0  # later documents do not see this one
            if reset_position_ids:
                position_ids[after:] -= after - doc_start
                doc_start = after

    if attention_mask is not None:
        attention_mask = attention_mask < 0.5
    return attention_mask, loss_mask, position_ids


class MockGPTLowLevelDataset:
    """Synthetic documents: sequence i is `1, 2, ..., len-1, eod` with seeded random lengths.

    Class attributes `seed`, `size` and `max_sequence_length` set the shape (Megatron's defaults).
    """

    seed: int = 0
    size: int = 100000
    max_sequence_length: int = 4096

    def __init__(self, tokenizer: MegatronTokenizer) -> None:
        self.tokenizer = tokenizer
        # The ids run up to max_sequence_length - 1 whatever the vocabulary: a smaller one would
        # raise in the middle of training at TP1 and embed zeros at TP > 1 (masked as another
        # rank's rows), so it is refused before any work.
        vocab = getattr(tokenizer, 'vocab_size', None)
        if vocab is not None and vocab < self.max_sequence_length:
            raise ValueError(
                f"--mock-data writes token ids 1 .. {self.max_sequence_length - 1} (Megatron's "
                f"synthetic documents 1, 2, ..., length - 1, eod), which the tokenizer's "
                f"vocabulary of {vocab} does not hold: use --vocab-size "
                f"{self.max_sequence_length - 1} or more (NullTokenizer) or real data"
            )
        # Seeded, so every rank sees the same synthetic corpus; lengths in [1, max).
        lengths = numpy.random.default_rng(seed=self.seed)
        self.sequence_lengths = lengths.integers(
            1, self.max_sequence_length, size=self.size, dtype=numpy.int32
        )

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, idx: int) -> numpy.ndarray:
        length = self.sequence_lengths[idx]
        return numpy.int64(numpy.concatenate([numpy.arange(length - 1) + 1, [self.tokenizer.eod]]))

    def get(self, idx: int, offset: int = 0, length: Optional[int] = None) -> numpy.ndarray:
        """Tokens [offset, offset + length) of sequence idx."""
        if length is None:
            length = self.sequence_lengths[idx] - offset
        return self[idx][offset : offset + length]


class MockGPTDataset(GPTDataset):
    """GPTDataset over MockGPTLowLevelDataset (`--mock-data`).

    As in Megatron r0.8 its length is the GPTDataset's: every sample of the epochs built for
    `num_samples` (one epoch when None), so any position of `shuffle_index` can be read.
    """

    def __init__(
        self,
        dataset: MockGPTLowLevelDataset,
        dataset_path: Optional[str],
        indices: numpy.ndarray,
        num_samples: int,
        index_split: Split,
        config: GPTDatasetConfig,
    ) -> None:
        assert config.mock, "MockGPTDataset needs a config with mock=True"
        super().__init__(
            dataset,
            config=config,
            dataset_path=dataset_path,
            indexed_indices=indices,
            num_samples=num_samples,
            index_split=index_split,
        )

    @staticmethod
    def numel_low_level_dataset(low_level_dataset: MockGPTLowLevelDataset) -> int:
        return len(low_level_dataset)

    @staticmethod
    def build_low_level_dataset(
        dataset_path: Optional[str], config: GPTDatasetConfig
    ) -> MockGPTLowLevelDataset:
        return MockGPTLowLevelDataset(config.tokenizer)


def _pad_id_of(tokenizer) -> int:
    """The tokenizer's pad id, or -1 when it has none (padding then maps to id 0, no loss)."""
    try:
        pad = tokenizer.pad
    except Exception:  # tokenizers without a pad id raise from the property
        return _PAD_TOKEN_ID
    return _PAD_TOKEN_ID if pad is None else pad
