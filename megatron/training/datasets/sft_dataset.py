"""SFTDataset (`--sft`): chat JSONL read at run time, packed into `--seq-length` samples with
per-conversation positions and attention boundaries, loss on assistant tokens only.

Each data file is a low-level dataset of rows (`JSONLRows`); `--split` cuts its rows into
contiguous ranges and `--data-path w1 a.jsonl w2 b.jsonl` blends files, as for GPT data. When a
split is built, every row is checked and every conversation tokenized once (any bad row stops the
run there, naming the file and line, before the first training step) and a packing plan is made:

- default: conversations from any rows share a sample (online best fit in data order,
  `megatron.core.datasets.sft_packing.plan_packs`);
- `--sft-one-row-per-sample`: Megatron's packing, one row per sample (its conversations packed
  in order, never combined with other rows).

A conversation (or, one row per sample, a row) longer than `--seq-length` + 1 tokens is cut to
that length with a warning and a count (`--sft-long-conversations truncate`, the default) or
refused (`error`). The plan (two integer arrays) is cached like the GPT indices; its key includes
the file's size and modification time, so editing the data rebuilds it.

Sample i is pack i mod (number of packs): data order, no shuffle (as Megatron, whose sample i is
row i mod n), so a sample depends on its index only, whatever the workers or access order.
Conversations are tokenized again when a sample is read (only the plan is kept).
"""

import hashlib
import json
import logging
import os
import time
from dataclasses import dataclass
from typing import Dict, List, Optional

import numpy
import torch

from megatron.core.datasets.blended_megatron_dataset_config import BlendedMegatronDatasetConfig
from megatron.core.datasets.index_cache import load_index, save_index, write_text
from megatron.core.datasets.jsonl_rows import JSONLRows
from megatron.core.datasets.megatron_dataset import MegatronDataset
from megatron.core.datasets.sft_packing import (
    build_packed_sample,
    check_row,
    padded_length,
    plan_packs,
)
from megatron.core.datasets.utils import Split, log_single_rank
from megatron.training.utils import print_rank_0

logger = logging.getLogger(__name__)

LONG_CONVERSATION_POLICIES = ("truncate", "error")


@dataclass
class SFTDatasetConfig(BlendedMegatronDatasetConfig):
    """Configuration of SFTDataset (the tokenizer must have `tokenize_conversation` and `pad`)."""

    context_parallel_size: int = 1
    """cp: each conversation is padded to a multiple of 2 * cp when cp > 1."""

    one_row_per_sample: bool = False
    """Megatron's packing: one JSONL row per sample (--sft-one-row-per-sample)."""

    long_conversations: str = "truncate"
    """What to do with data longer than a sample: 'truncate' (warn, count) or 'error'."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.mock:
            raise ValueError("--sft reads chat JSONL files: give --data-path (no mock SFT data)")
        if not hasattr(self.tokenizer, "tokenize_conversation"):
            raise ValueError(
                f"--sft needs --tokenizer-type SFTTokenizer (got {type(self.tokenizer).__name__})"
            )
        if self.long_conversations not in LONG_CONVERSATION_POLICIES:
            raise ValueError(
                f"--sft-long-conversations must be one of {LONG_CONVERSATION_POLICIES}, got "
                f"{self.long_conversations!r}"
            )
        if self.context_parallel_size > 1 and self.sequence_length % (
            2 * self.context_parallel_size
        ):
            raise ValueError(
                f"--seq-length ({self.sequence_length}) must be a multiple of 2 x "
                f"--context-parallel-size ({2 * self.context_parallel_size}) for packed sequences"
            )


class SFTDataset(MegatronDataset):
    """Packed chat samples: tokens, labels, loss_mask, position_ids (each [L]), cu_seqlens (int32
    [L + 1], right-filled with L), cu_seqlens_unpadded (int32 [L + 1], the segments' real tokens)
    and max_seqlen (int32 scalar); no attention mask.

    Args:
        dataset: the rows of one JSONL file.
        dataset_path: its path.
        indices: the rows of this split.
        num_samples: samples wanted (None: one pass over the packs).
        index_split: the split.
        config: the config.
    """

    def __init__(
        self,
        dataset: JSONLRows,
        dataset_path: str,
        indices: numpy.ndarray,
        num_samples: Optional[int],
        index_split: Split,
        config: SFTDatasetConfig,
    ) -> None:
        super().__init__(dataset, dataset_path, indices, num_samples, index_split, config)
        # Rows are read at run time: an edited file must not reuse the old plan.
        stat = os.stat(dataset_path)
        self.unique_identifiers["file_size"] = stat.st_size
        self.unique_identifiers["file_mtime_ns"] = stat.st_mtime_ns
        self.unique_description = json.dumps(
            self.unique_identifiers, indent=4, default=lambda obj: obj.unique_identifiers
        )
        self.unique_description_hash = hashlib.md5(
            self.unique_description.encode("utf-8")
        ).hexdigest()
        self.pack_offsets, self.pack_items = self._build_or_load_plan()
        self.num_packs = len(self.pack_offsets) - 1

    @staticmethod
    def numel_low_level_dataset(low_level_dataset: JSONLRows) -> int:
        """The split fractions apply to rows."""
        return len(low_level_dataset)

    @staticmethod
    def build_low_level_dataset(dataset_path: str, config: SFTDatasetConfig) -> JSONLRows:
        """Index the rows of a JSONL file."""
        return JSONLRows(dataset_path)

    @staticmethod
    def _key_config_attributes() -> List[str]:
        return MegatronDataset._key_config_attributes() + [
            "context_parallel_size",
            "one_row_per_sample",
            "long_conversations",
        ]

    def __len__(self) -> int:
        if self.num_packs == 0:
            return 0
        return max(self.num_samples or 0, self.num_packs)

    def __getitem__(self, idx: int) -> Dict[str, torch.Tensor]:
        if not 0 <= idx < len(self):
            raise IndexError(f"SFTDataset index {idx} out of range ({len(self)} samples)")
        pack = idx % self.num_packs
        items = self.pack_items[self.pack_offsets[pack] : self.pack_offsets[pack + 1]]
        rows = {}
        conversations = []
        for row, conversation in items.tolist():
            if row not in rows:
                rows[row] = check_row(self.dataset[row])
            ids, targets = self.config.tokenizer.tokenize_conversation(rows[row][conversation])
            conversations.append((ids, targets != -100))
        sample = build_packed_sample(
            conversations,
            self.config.sequence_length,
            self.config.tokenizer.pad,
            self.config.context_parallel_size,
        )
        return {
            "tokens": torch.from_numpy(sample["tokens"]),
            "labels": torch.from_numpy(sample["labels"]),
            "loss_mask": torch.from_numpy(sample["loss_mask"]),
            "position_ids": torch.from_numpy(sample["position_ids"]),
            "cu_seqlens": torch.from_numpy(sample["cu_seqlens"]),
            "cu_seqlens_unpadded": torch.from_numpy(sample["cu_seqlens_unpadded"]),
            "max_seqlen": torch.tensor(int(sample["max_seqlen"]), dtype=torch.int32),
        }

    # -----------------------------------------------------------------------------------------
    # the packing plan

    def _where(self, row: int) -> str:
        return f"{self.dataset_path} line {self.dataset.line_number(row)}"

    def _scan(self):
        """Check every row of the split and tokenize its conversations.

        Returns:
            (items int64 [n, 2] of (row, conversation), lengths in the pack int64 [n], the number
            of answer tokens).
        """
        tokenizer = self.config.tokenizer
        cp = self.config.context_parallel_size
        items, lengths = [], []
        answer_tokens = 0
        for row in self.indices.tolist():
            try:
                conversations = check_row(self.dataset[row])
                for c, conversation in enumerate(conversations):
                    ids, targets = tokenizer.tokenize_conversation(conversation)
                    items.append((row, c))
                    lengths.append(padded_length(len(ids), cp))
                    answer_tokens += int((targets != -100).sum())
            except ValueError as exc:
                message = str(exc)
                if message.startswith(self.dataset_path):
                    raise
                raise ValueError(f"{self._where(row)}: {message}") from None
        items = numpy.asarray(items, dtype=numpy.int64).reshape(-1, 2)
        lengths = numpy.asarray(lengths, dtype=numpy.int64)
        return items, lengths, answer_tokens

    def _plan(self):
        """(pack_offsets, pack_items) of this split, with a rank-0 summary and warnings."""
        capacity = self.config.sequence_length + 1
        items, lengths, answer_tokens = self._scan()
        if self.config.one_row_per_sample:
            rows, first = numpy.unique(items[:, 0], return_index=True)
            offsets = numpy.append(numpy.sort(first), len(items)).astype(numpy.int64)
            pack_items = items
            pack_lengths = numpy.add.reduceat(lengths, offsets[:-1]) if len(items) else lengths
            unit = "row"
        else:
            offsets, order = plan_packs(lengths, capacity)
            pack_items = items[order]
            pack_lengths = (
                numpy.add.reduceat(lengths[order], offsets[:-1]) if len(items) else lengths
            )
            unit = "conversation"
        too_long = numpy.flatnonzero(pack_lengths > capacity)
        if len(too_long) and self.config.long_conversations == "error":
            first = int(too_long[0])
            row = int(pack_items[offsets[first], 0])
            raise ValueError(
                f"{self._where(row)}: a {unit} of {int(pack_lengths[first])} tokens does not fit "
                f"--seq-length {self.config.sequence_length} + 1 ({len(too_long)} such in "
                f"{self.dataset_path}); raise --seq-length, shorten the data, or pass "
                "--sft-long-conversations truncate"
            )
        dropped, removed = 0, 0
        if len(too_long):
            offsets, pack_items, dropped, removed = self._settle_truncated(
                offsets, pack_items, too_long
            )
        answer_tokens -= removed
        num_tokens = int(lengths.sum())
        num_packs = len(offsets) - 1
        efficiency = min(num_tokens, num_packs * capacity) / max(1, num_packs * capacity)
        print_rank_0(
            f"> SFT {self.index_split.name} split of {self.dataset_path}: {len(items)} "
            f"conversations from {len(self.indices)} rows in {num_packs} samples of "
            f"{self.config.sequence_length} tokens ({100 * efficiency:.1f} % non-padding, "
            f"{answer_tokens} answer tokens)",
        )
        if len(too_long):
            cut = int((pack_lengths[too_long] - capacity).sum())
            print_rank_0(
                f"WARNING: {len(too_long)} {unit}(s) of {self.dataset_path} "
                f"({self.index_split.name} split) are longer than --seq-length "
                f"{self.config.sequence_length} + 1 and were truncated ({cut} tokens dropped, "
                f"longest {int(pack_lengths.max())}); --sft-long-conversations error refuses them",
            )
        if dropped:
            print_rank_0(
                f"WARNING: {dropped} {unit}(s) of {self.dataset_path} "
                f"({self.index_split.name} split) keep no answer token within --seq-length "
                f"{self.config.sequence_length} + 1 once truncated (the prompt alone is longer) "
                "and were left out: nothing of them would train",
            )
        return offsets, pack_items

    def _settle_truncated(self, offsets, pack_items, too_long):
        """Build the truncated packs to count the answer tokens they keep; leave out those that
        keep none (a micro-batch of them would divide the loss by zero tokens).

        Returns:
            (offsets, pack_items) without the empty packs, how many were left out, and the answer
            tokens truncation removed.
        """
        tokenizer = self.config.tokenizer
        removed = 0
        empty = []
        for pack in too_long.tolist():
            kept, total = 0, 0
            conversations = []
            for row, conversation in pack_items[offsets[pack] : offsets[pack + 1]].tolist():
                ids, targets = tokenizer.tokenize_conversation(
                    check_row(self.dataset[row])[conversation]
                )
                conversations.append((ids, targets != -100))
                total += int((targets != -100).sum())
            sample = build_packed_sample(
                conversations,
                self.config.sequence_length,
                tokenizer.pad,
                self.config.context_parallel_size,
            )
            kept = int(sample["loss_mask"].sum())
            removed += total - kept
            if kept == 0:
                empty.append(pack)
        if not empty:
            return offsets, pack_items, 0, removed
        sizes = numpy.diff(offsets)
        keep = numpy.ones(len(sizes), dtype=bool)
        keep[empty] = False
        item_keep = numpy.repeat(keep, sizes)
        new_offsets = numpy.concatenate(([0], numpy.cumsum(sizes[keep]))).astype(numpy.int64)
        return new_offsets, pack_items[item_keep], len(empty), removed

    def _cache_paths(self) -> Optional[Dict[str, str]]:
        directory = self.config.path_to_cache or os.path.join(
            os.path.dirname(os.path.abspath(self.dataset_path)), "cache", "SFTDataset_indices"
        )
        base = f"{self.unique_description_hash}-SFTDataset-{self.index_split.name}"
        return {
            "dir": directory,
            "description": os.path.join(directory, f"{base}-description.txt"),
            "pack_offsets": os.path.join(directory, f"{base}-pack_offsets.npy"),
            "pack_items": os.path.join(directory, f"{base}-pack_items.npy"),
        }

    def _build_or_load_plan(self):
        """Build the plan (rank 0, or every rank without torch.distributed) and cache it; the
        other ranks load it after the builder's barrier."""
        paths = self._cache_paths()
        cached = all(
            os.path.isfile(paths[k]) for k in ("description", "pack_offsets", "pack_items")
        )
        builder = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
        if cached:
            return load_index(paths["pack_offsets"], ndim=1), load_index(
                paths["pack_items"], ndim=2
            )
        if not builder:
            raise FileNotFoundError(
                f"SFTDataset {self.index_split.name} plan not found in {paths['dir']} (rank 0 "
                "builds it; is --data-cache-path shared by all ranks?)"
            )
        start = time.time()
        offsets, items = self._plan()
        try:
            os.makedirs(paths["dir"], exist_ok=True)
            write_text(paths["description"], self.unique_description)
            save_index(paths["pack_offsets"], offsets)
            save_index(paths["pack_items"], items)
        except OSError as exc:
            log_single_rank(
                logger, logging.WARNING, f"WARNING: SFT plan not cached in {paths['dir']}: {exc}"
            )
        log_single_rank(
            logger, logging.INFO, f"> SFT plan built in {time.time() - start:.2f} seconds"
        )
        return offsets, items
