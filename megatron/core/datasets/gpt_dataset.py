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
        super().__init__(
            indexed_dataset, dataset_path, indexed_indices, num_samples, index_split, config
        )
        self.masks_and_position_ids_are_cacheable = not any(
            [
                self.config.reset_position_ids,
                self.config.reset_attention_mask,
                self.config.eod_mask_loss,
            ]
        )
        self.masks_and_position_ids_are_cached = False
        self.cached_attention_mask = None
        self.cached_loss_mask = None
        self.cached_position_ids = None
        try:
            self._pad_token_id = self.config.tokenizer.pad
        except Exception:
            self._pad_token_id = _PAD_TOKEN_ID
        if self._pad_token_id is None:
            self._pad_token_id = _PAD_TOKEN_ID

        (self.document_index, self.sample_index, self.shuffle_index) = (
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

        text = torch.from_numpy(text).long()
        if self.config.add_extra_token_to_sequence:
            tokens = text[:-1].contiguous()
            labels = text[1:].contiguous()
        else:
            tokens = text
            labels = torch.roll(text, shifts=-1, dims=0)
            labels[-1] = self._pad_token_id

        if (
            not self.masks_and_position_ids_are_cacheable
            or not self.masks_and_position_ids_are_cached
        ):
            attention_mask, loss_mask, position_ids = _get_ltor_masks_and_position_ids(
                tokens,
                self.config.tokenizer.eod,
                self.config.reset_position_ids,
                self.config.reset_attention_mask,
                self.config.eod_mask_loss,
                self.config.create_attention_mask,
            )
            if self.masks_and_position_ids_are_cacheable:
                self.cached_attention_mask = attention_mask
                self.cached_loss_mask = loss_mask
                self.cached_position_ids = position_ids
                self.masks_and_position_ids_are_cached = True
        else:
            attention_mask = self.cached_attention_mask
            loss_mask = self.cached_loss_mask
            position_ids = self.cached_position_ids
        # Never hand out (and then mutate) the cached tensors themselves.
        loss_mask = loss_mask.clone()

        # Padded positions carry no loss and a valid embedding id.
        loss_mask[labels == self._pad_token_id] = 0.0
        tokens[tokens == self._pad_token_id] = 0
        labels[labels == self._pad_token_id] = 0

        if idx is None:
            loss_mask = torch.zeros_like(loss_mask)

        if self.config.create_attention_mask:
            return {
                "tokens": tokens,
                "labels": labels,
                "attention_mask": attention_mask,
                "loss_mask": loss_mask,
                "position_ids": position_ids,
            }
        return {
            "tokens": tokens,
            "labels": labels,
            "loss_mask": loss_mask,
            "position_ids": position_ids,
        }

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
        idx = self.shuffle_index[idx]
        doc_index_beg, doc_index_beg_offset = self.sample_index[idx]
        doc_index_end, doc_index_end_offset = self.sample_index[idx + 1]
        extra = int(self.config.add_extra_token_to_sequence)

        document_ids = []
        sample_parts = []
        if doc_index_beg == doc_index_end:
            document_ids.append(self.document_index[doc_index_beg])
            sample_parts.append(
                self.dataset.get(
                    self.document_index[doc_index_beg],
                    offset=int(doc_index_beg_offset),
                    length=int(doc_index_end_offset - doc_index_beg_offset) + extra,
                )
            )
        else:
            for i in range(doc_index_beg, doc_index_end + 1):
                document_ids.append(self.document_index[i])
                offset = 0 if i > doc_index_beg else int(doc_index_beg_offset)
                length = None if i < doc_index_end else int(doc_index_end_offset) + extra
                sample_parts.append(
                    self.dataset.get(self.document_index[i], offset=offset, length=length)
                )

        return (
            numpy.concatenate(sample_parts, dtype=numpy.int64),
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
        if paths is not None:
            cache_hit = all(
                os.path.isfile(paths[k])
                for k in ("description", "document_index", "sample_index", "shuffle_index")
            )
        else:
            cache_hit = False

        if paths is None or (
            not cache_hit
            and (not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0)
        ):
            log_single_rank(
                logger,
                logging.INFO,
                f"Build and save the {type(self).__name__} {self.index_split.name} indices",
            )
            self.built_anew_on_cache_miss = True
            t_beg = time.time()
            document_index, sample_index, shuffle_index = self._build_indices()
            if paths is not None:
                os.makedirs(paths["dir"], exist_ok=True)
                write_text(paths["description"], self.unique_description)
                save_index(paths["document_index"], document_index)
                save_index(paths["sample_index"], sample_index)
                save_index(paths["shuffle_index"], shuffle_index)
            else:
                log_single_rank(
                    logger,
                    logging.WARNING,
                    f"Unable to save the {type(self).__name__} indexes because path_to_cache is "
                    "None",
                )
            log_single_rank(
                logger, logging.DEBUG, f"\t> time elapsed: {time.time() - t_beg:4f} seconds"
            )
            log_single_rank(
                logger, logging.INFO, f"> total number of samples: {sample_index.shape[0] - 1}"
            )
            return document_index, sample_index, shuffle_index

        log_single_rank(
            logger, logging.INFO, f"Load the {type(self).__name__} {self.index_split.name} indices"
        )
        if not cache_hit:
            raise FileNotFoundError(
                f"{type(self).__name__} {self.index_split.name} indices not found in "
                f"{paths['dir']} (rank 0 builds them; was it built with the same config?)"
            )
        document_index = load_index(paths["document_index"], ndim=1)
        sample_index = load_index(paths["sample_index"], ndim=2)
        shuffle_index = load_index(paths["shuffle_index"], ndim=1)
        log_single_rank(
            logger, logging.INFO, f"> total number of samples: {sample_index.shape[0] - 1}"
        )
        return document_index, sample_index, shuffle_index

    def _build_indices(self) -> Tuple[numpy.ndarray, numpy.ndarray, numpy.ndarray]:
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

        separate_final_epoch = False
        num_samples_sans_final_epoch = None
        if num_epochs > 1:
            num_samples_sans_final_epoch = (
                (num_epochs - 1) * num_tokens_per_epoch - extra
            ) // sequence_length
            num_samples_from_final_epoch = self.num_samples - num_samples_sans_final_epoch
            num_samples_per_epoch = (num_tokens_per_epoch - extra) // sequence_length
            assert num_samples_from_final_epoch >= 0
            assert num_samples_from_final_epoch <= num_samples_per_epoch + 1
            threshold = 0.80
            separate_final_epoch = num_samples_from_final_epoch < int(
                threshold * num_samples_per_epoch
            )
            log_single_rank(
                logger,
                logging.DEBUG,
                f"> num_samples_from_final_epoch: {num_samples_from_final_epoch}",
            )
            log_single_rank(
                logger, logging.DEBUG, f"> num_samples_per_epoch: {num_samples_per_epoch}"
            )
        log_single_rank(logger, logging.DEBUG, f"> separate_final_epoch: {separate_final_epoch}")

        numpy_random_state = numpy.random.RandomState(self.config.random_seed)
        document_index = _build_document_index(
            self.indices, num_epochs, numpy_random_state, separate_final_epoch
        )

        if self.index_split == Split.valid:
            drop_last_partial_sequence = self.config.drop_last_partial_validation_sequence
        else:
            drop_last_partial_sequence = True

        from megatron.core.datasets import helpers

        assert document_index.dtype == numpy.int32
        sequence_lengths = numpy.asarray(self.dataset.sequence_lengths, dtype=numpy.int32)
        sample_index = helpers.build_sample_idx(
            sequence_lengths,
            document_index,
            sequence_length,
            num_epochs,
            num_tokens_per_epoch,
            drop_last_partial_sequence,
            extra,
        )

        if separate_final_epoch:
            shuffle_index = _build_shuffle_index(
                num_samples_sans_final_epoch, sample_index.shape[0] - 1, numpy_random_state
            )
        else:
            shuffle_index = _build_shuffle_index(
                sample_index.shape[0] - 1, sample_index.shape[0] - 1, numpy_random_state
            )
        log_single_rank(logger, logging.INFO, f"> total number of epochs: {num_epochs}")
        return document_index, sample_index, shuffle_index

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
        num_epochs = 1
        num_tokens = num_tokens_per_epoch
        while num_tokens < num_tokens_requested:
            num_epochs += 1
            num_tokens += num_tokens_per_epoch
        return num_epochs


def _build_document_index(
    documents: numpy.ndarray,
    num_epochs: int,
    numpy_random_state: numpy.random.RandomState,
    separate_final_epoch: bool,
) -> numpy.ndarray:
    """The documents tiled num_epochs times (int32) and shuffled; last epoch apart when
    separated."""
    if not separate_final_epoch or num_epochs == 1:
        document_index = numpy.tile(numpy.asarray(documents), num_epochs).astype(numpy.int32)
        numpy_random_state.shuffle(document_index)
        return document_index
    doc_idx_first = _build_document_index(documents, num_epochs - 1, numpy_random_state, False)
    doc_idx_last = _build_document_index(documents, 1, numpy_random_state, False)
    return numpy.concatenate((doc_idx_first, doc_idx_last))


def _build_shuffle_index(
    num_samples: int, total_size: int, numpy_random_state: numpy.random.RandomState
) -> numpy.ndarray:
    """A shuffled arange(0, num_samples), then a shuffled arange(num_samples, total_size) if
    larger."""
    dtype_ = numpy.uint32
    if total_size >= (numpy.iinfo(numpy.uint32).max - 1):
        dtype_ = numpy.int64
    shuffle_idx_first = numpy.arange(start=0, stop=num_samples, step=1, dtype=dtype_)
    numpy_random_state.shuffle(shuffle_idx_first)
    if num_samples == total_size:
        return shuffle_idx_first
    shuffle_idx_last = numpy.arange(start=num_samples, stop=total_size, step=1, dtype=dtype_)
    numpy_random_state.shuffle(shuffle_idx_last)
    return numpy.concatenate((shuffle_idx_first, shuffle_idx_last))


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
    if create_attention_mask:
        attention_mask = torch.tril(
            torch.ones((seq_length, seq_length), device=data.device)
        ).unsqueeze(0)
    else:
        attention_mask = None

    loss_mask = torch.ones(seq_length, dtype=torch.float, device=data.device)
    if eod_mask_loss:
        loss_mask[data == eod_token] = 0.0

    position_ids = torch.arange(seq_length, dtype=torch.long, device=data.device)
    if reset_position_ids:
        position_ids = position_ids.clone()

    if reset_position_ids or reset_attention_mask:
        eod_index = position_ids[data == eod_token]
        if reset_position_ids:
            eod_index = eod_index.clone()
        prev_index = 0
        for j in range(eod_index.numel()):
            i = eod_index[j]
            if reset_attention_mask and attention_mask is not None:
                attention_mask[0, (i + 1) :, : (i + 1)] = 0
            if reset_position_ids:
                position_ids[(i + 1) :] -= i + 1 - prev_index
                prev_index = i + 1

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
        rng = numpy.random.default_rng(seed=self.seed)
        self.sequence_lengths = rng.integers(
            low=1, high=self.max_sequence_length, size=self.size, dtype=numpy.int32
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
    """GPTDataset over MockGPTLowLevelDataset (`--mock-data`); length = num_samples."""

    def __init__(
        self,
        dataset: MockGPTLowLevelDataset,
        dataset_path: Optional[str],
        indices: numpy.ndarray,
        num_samples: int,
        index_split: Split,
        config: GPTDatasetConfig,
    ) -> None:
        assert config.mock
        if num_samples is None:
            num_samples = len(indices)
        super().__init__(dataset, dataset_path, indices, num_samples, index_split, config)

    @staticmethod
    def numel_low_level_dataset(low_level_dataset: MockGPTLowLevelDataset) -> int:
        return len(low_level_dataset)

    @staticmethod
    def build_low_level_dataset(
        dataset_path: Optional[str], config: GPTDatasetConfig
    ) -> MockGPTLowLevelDataset:
        return MockGPTLowLevelDataset(config.tokenizer)

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, idx: int) -> Dict[str, torch.Tensor]:
        if idx is not None and idx >= self.num_samples:
            raise IndexError(
                f"The index {idx} exceeds the available number of samples ({self.num_samples})"
            )
        return super().__getitem__(idx)
