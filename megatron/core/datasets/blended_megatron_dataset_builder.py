"""Builds the train/valid/test datasets (mid-level MegatronDatasets and top-level BlendedDatasets).

Blend sizing matches core_v0.8.0: with weights, dataset d of a blend is asked for
`ceil(N * w_d * 1.005)` samples of split N and the BlendedDataset has `sum_d` of those samples;
without weights, mid-level datasets are one epoch and the blend is sized `min(N, sum of lengths)`
(or exhaustive when N is None). Rank 0 builds each dataset first (writing the index cache),
the other ranks wait on a barrier and then load it.
"""

import logging
import math
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterable, List, Optional, Type, Union

import numpy
import torch

from megatron.core.datasets.blended_dataset import BlendedDataset
from megatron.core.datasets.blended_megatron_dataset_config import BlendedMegatronDatasetConfig
from megatron.core.datasets.megatron_dataset import LowLevelDataset, MegatronDataset
from megatron.core.datasets.utils import Split, log_single_rank, normalize

logger = logging.getLogger(__name__)

MidLevelDataset = MegatronDataset

TopLevelDataset = Union[BlendedDataset, MidLevelDataset]

DistributedDataset = Union[
    TopLevelDataset, MidLevelDataset, LowLevelDataset, torch.utils.data.Dataset
]


def _virtual_pipeline_rank() -> Optional[int]:
    try:
        from megatron.core import parallel_state

        return parallel_state.get_virtual_pipeline_model_parallel_rank()
    except Exception:  # parallel state not set up: no virtual pipeline
        return None


class MissingBlendSizeError(ValueError, AssertionError):
    """A weighted blend was given no requested size.

    A ValueError (a user error, reported as one line); also an AssertionError because Megatron
    r0.8 asserts here and library code (its own unit tests among it) catches AssertionError.
    """


class BlendedMegatronDatasetBuilder(object):
    """Builder for the BlendedDataset and MegatronDataset classes.

    Args:
        cls: the mid-level class, e.g. GPTDataset or MockGPTDataset.
        sizes: minimum number of samples per split (train, valid, test); an entry may be None.
        is_built_on_rank: no-argument callable, True where this rank needs the datasets.
        config: the config.

    Raises:
        ValueError: a split without a size given a weighted blend.
    """

    def __init__(
        self,
        cls: Type[MidLevelDataset],
        sizes: List[Optional[int]],
        is_built_on_rank: Callable,
        config: BlendedMegatronDatasetConfig,
    ):
        self.cls = cls
        self.sizes = list(sizes)
        self.is_built_on_rank = is_built_on_rank
        self.config = config

        if len(self.sizes) != len(Split):
            raise ValueError(
                f"sizes must have {len(Split)} entries (train, valid, test), got {self.sizes}"
            )
        log_single_rank(
            logger,
            logging.INFO,
            f"Building dataset splits with cls={cls.__name__}, sizes={self.sizes}, and "
            f"config={self.config}",
        )

        if not self.config.mock:
            for split in Split:
                size_is_none = self.sizes[split.value] is None
                if self.config.blend_per_split is None:
                    if self.config.split_matrix[split.value] is None:
                        continue  # a zero-width split is never built
                    weights_are_none = self.config.blend[1] is None
                else:
                    if self.config.blend_per_split[split.value] is None:
                        continue
                    weights_are_none = self.config.blend_per_split[split.value][1] is None
                if size_is_none and not weights_are_none:
                    raise MissingBlendSizeError(
                        f"the {split.name} split has blend weights but no requested size"
                    )

        if torch.distributed.is_initialized():
            gb_rank = torch.distributed.get_rank()
            vp_rank = _virtual_pipeline_rank()
            if gb_rank == 0 and (vp_rank == 0 or vp_rank is None):
                assert self.is_built_on_rank(), (
                    "is_built_on_rank must return True when global rank = 0 and vp rank = 0"
                )

    def build(self) -> List[Optional[TopLevelDataset]]:
        """Build all dataset splits (call on all ranks).

        Returns [train, valid, test] (None where absent).

        Raises:
            IndexError: when a blend asks a component for more samples than it has.
        """
        datasets = self._build_blended_dataset_splits()
        for dataset in datasets:
            if dataset is not None and len(dataset) > 0 and isinstance(dataset, BlendedDataset):
                assert dataset.size is None or dataset.size == dataset.dataset_index.shape[0]
                counts = numpy.bincount(
                    numpy.asarray(dataset.dataset_index), minlength=len(dataset.datasets)
                )
                for i, (component, count) in enumerate(zip(dataset.datasets, counts)):
                    if len(component) < count:
                        raise IndexError(
                            f"{type(dataset).__name__} blend goes out of bounds for "
                            f"{type(component).__name__} {i} for {dataset.split.name} split "
                            f"({count} samples drawn, {len(component)} available)"
                        )
        return datasets

    def _build_blended_dataset_splits(self) -> List[Optional[TopLevelDataset]]:
        if self.config.mock:
            return self._build_megatron_dataset_splits(None, self.config.split_matrix, self.sizes)
        if self.config.blend:
            return self._build_from_one_blend()
        return self._build_from_blend_per_split()

    def _build_from_one_blend(self) -> List[Optional[TopLevelDataset]]:
        """One blend for all splits: every prefix is cut by --split, then blended per split."""
        prefixes, weights = self.config.blend
        weights = None if weights is None else normalize(weights)
        ranges = self.config.split_matrix
        if weights is None and len(prefixes) == 1:
            # A lone unweighted prefix needs no BlendedDataset on top.
            return self._build_megatron_dataset_splits(prefixes[0], ranges, self.sizes)

        requests = _requests_per_prefix(weights, self.sizes, len(prefixes))
        parts = self._build_megatron_datasets_parallel(prefixes, ranges, requests)
        out: List[Optional[TopLevelDataset]] = [None] * len(Split)
        for i, split_range in enumerate(ranges):
            if split_range is not None:
                column = [row[i] for row in requests]
                out[i] = self._blend(parts[i], weights, column, self.sizes[i])
        return out

    def _build_from_blend_per_split(self) -> List[Optional[TopLevelDataset]]:
        """A blend per split: each prefix of split i is used whole, as split i only."""
        out: List[Optional[TopLevelDataset]] = [None] * len(Split)
        for i, blend in enumerate(self.config.blend_per_split):
            if blend is None:
                continue
            # Only split i is built: its range is the whole file, the other splits ask for 0.
            ranges = [(0.0, 1.0) if j == i else None for j in range(len(Split))]
            sizes = [self.sizes[i] if j == i else 0 for j in range(len(Split))]
            prefixes, weights = blend
            weights = None if weights is None else normalize(weights)
            if len(prefixes) == 1:
                out[i] = self._build_megatron_dataset_splits(prefixes[0], ranges, sizes)[i]
                continue
            requests = _requests_per_prefix(weights, sizes, len(prefixes))
            parts = self._build_megatron_datasets_parallel(prefixes, ranges, requests)[i]
            column = [row[i] for row in requests]
            out[i] = self._blend(parts, weights, column, self.sizes[i])
        return out

    def _blend(
        self,
        parts: List[Optional[MidLevelDataset]],
        weights: Optional[List[float]],
        requested_per_part: List[Optional[int]],
        requested: Optional[int],
    ) -> Optional[BlendedDataset]:
        """The BlendedDataset of one split over its mid-level `parts`.

        Weighted: sized by the sum of what each part was asked for (weights optionally
        re-derived from those counts). Unweighted: each part weighs its length and the blend
        takes at most `requested` samples (all of them when `requested` is None).
        """
        if weights is None:
            try:
                weights = [len(part) for part in parts]
            except TypeError:  # a part is None on ranks that do not build it
                weights = [0] * len(parts)
            size = None if requested is None else min(requested, sum(weights))
        elif requested is None:
            raise RuntimeError
        else:
            size = sum(requested_per_part)
            if self.config.renormalize_blend_weights:
                weights = [count / size for count in requested_per_part]
        return self.build_generic_dataset(
            BlendedDataset, self.is_built_on_rank, True, parts, weights, size, self.config
        )

    def _build_megatron_datasets_parallel(
        self, prefixes: List[str], split: List, sizes_per_dataset: List[List[Optional[int]]]
    ) -> List[List[Optional[MegatronDataset]]]:
        """Build each prefix's split datasets with a thread pool; rank 0 first, then the others.

        Returns one list per split, holding that split's dataset of every prefix in order.
        """

        def build_every_prefix():
            workers = self.config.num_dataset_builder_threads
            with ThreadPoolExecutor(max_workers=workers) as pool:
                # No per-dataset barrier inside: the ranks meet once, around the whole pool.
                pending = [
                    pool.submit(self._build_megatron_dataset_splits, prefix, split, sizes, False)
                    for prefix, sizes in zip(prefixes, sizes_per_dataset)
                ]
                per_prefix = [job.result() for job in pending]
            return [[splits[j] for splits in per_prefix] for j in range(len(Split))]

        if not torch.distributed.is_initialized():
            return build_every_prefix()
        first = torch.distributed.get_rank() == 0
        built = build_every_prefix() if first else None
        # Rank 0 has written the index caches by now; the others only read them.
        torch.distributed.barrier()
        return built if first else build_every_prefix()

    def _build_megatron_dataset_splits(
        self,
        dataset_path: Optional[str],
        split: List,
        sizes: List[Optional[int]],
        synchronize_ranks: bool = True,
    ) -> List[Optional[MidLevelDataset]]:
        """Build the split datasets of one low-level dataset.

        Raises:
            ValueError: when a non-empty split fraction rounds to zero documents while samples are
                requested from it.
        """
        low_level_dataset = self.cls.build_low_level_dataset(dataset_path, self.config)
        num_elements = self.cls.numel_low_level_dataset(low_level_dataset)
        indices = [_document_range(bounds, num_elements) for bounds in split]
        for split_name, docs, wanted in zip(Split, indices, sizes):
            if docs is not None and len(docs) == 0 and wanted:
                raise ValueError(
                    f"--split {self.config.split} leaves the {split_name.name} split of "
                    f"{dataset_path} with no documents ({num_elements} in total) but {wanted} "
                    "samples are requested from it"
                )
        return [
            None
            if bounds is None
            else self.build_generic_dataset(
                self.cls,
                self.is_built_on_rank,
                synchronize_ranks,
                low_level_dataset,
                dataset_path,
                docs,
                wanted,
                split_name,
                self.config,
            )
            for split_name, bounds, docs, wanted in zip(Split, split, indices, sizes)
        ]

    @staticmethod
    def build_generic_dataset(
        cls: Union[Type[DistributedDataset], Callable],
        is_built_on_rank: Callable,
        synchronize_ranks: bool,
        *args: Any,
    ) -> Optional[Union[DistributedDataset, Iterable]]:
        """Build on rank 0 first (it writes the cache), barrier, then on the other ranks.

        Returns None where torch.distributed is initialised and is_built_on_rank() is False.
        """
        if not torch.distributed.is_initialized():
            return cls(*args)
        first = torch.distributed.get_rank() == 0
        dataset = None
        if first and is_built_on_rank():
            dataset = _build_writing_cache(cls, args)
        if synchronize_ranks:
            torch.distributed.barrier()
        if not first and is_built_on_rank():
            dataset = cls(*args)
        return dataset


def _build_writing_cache(cls, args):
    """`cls(*args)` on the rank that writes the cache; an unwritable cache is reported as such."""
    try:
        return cls(*args)
    except OSError as err:
        raise Exception(
            "Failed to write dataset materials to the data cache directory. Please "
            "supply a directory to which you have write access via the path_to_cache "
            "attribute in BlendedMegatronDatasetConfig (--data-cache-path) and retry."
        ) from err


def _document_range(bounds: Optional[tuple], num_elements: int) -> Optional[numpy.ndarray]:
    """Indices of the documents in the [start, end) fraction `bounds` (None: split absent)."""
    if bounds is None:
        return None
    first, stop = (int(round(edge * float(num_elements))) for edge in bounds)
    return numpy.arange(start=first, stop=stop, step=1, dtype=numpy.int32)


def _requests_per_prefix(
    weights: Optional[List[float]], sizes: List[Optional[int]], num_prefixes: int
) -> List[List[Optional[int]]]:
    """Samples asked of each prefix per split; all None (one epoch each) without weights."""
    if weights is None:
        return [[None] * len(Split) for _ in range(num_prefixes)]
    return _get_size_per_split_per_dataset(weights, sizes)


def _get_size_per_split_per_dataset(
    normalized_weights: List[float], target_size_per_split: List[Optional[int]]
) -> List[List[Optional[int]]]:
    """Samples to request per dataset per split: ceil(N * w * 1.005) (core_v0.8.0's 0.5 %
    margin)."""
    assert numpy.isclose(sum(normalized_weights), 1.0)

    def with_margin(target: Optional[int], weight: float) -> Optional[int]:
        # A half-percent surplus so rounding in the blend never runs a component dry.
        return None if target is None else int(math.ceil(target * weight * 1.005))

    return [[with_margin(n, w) for n in target_size_per_split] for w in normalized_weights]
