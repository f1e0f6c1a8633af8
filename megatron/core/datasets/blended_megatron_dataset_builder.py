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
            prefixes, weights = self.config.blend
            if weights is not None:
                weights = normalize(weights)
            split = self.config.split_matrix

            if len(prefixes) == 1 and weights is None:
                return self._build_megatron_dataset_splits(prefixes[0], split, self.sizes)

            if weights is None:
                sizes_per_dataset = [[None for _ in Split] for _ in prefixes]
            else:
                sizes_per_dataset = _get_size_per_split_per_dataset(weights, self.sizes)

            megatron_datasets = self._build_megatron_datasets_parallel(
                prefixes, split, sizes_per_dataset
            )

            blended_datasets = [None] * len(Split)
            for i in range(len(Split)):
                if split[i] is None:
                    continue
                weights_i = weights
                if weights_i is not None and self.sizes[i] is not None:
                    size_per_dataset = list(zip(*sizes_per_dataset))[i]
                    size_i = sum(size_per_dataset)
                    if self.config.renormalize_blend_weights:
                        weights_i = [s / size_i for s in size_per_dataset]
                elif weights_i is None:
                    try:
                        weights_i = [
                            len(megatron_dataset) for megatron_dataset in megatron_datasets[i]
                        ]
                    except TypeError:
                        weights_i = [0 for _ in prefixes]
                    if self.sizes[i] is not None:
                        size_i = min(self.sizes[i], sum(weights_i))
                    else:
                        size_i = None
                else:
                    raise RuntimeError
                blended_datasets[i] = self.build_generic_dataset(
                    BlendedDataset,
                    self.is_built_on_rank,
                    True,
                    megatron_datasets[i],
                    weights_i,
                    size_i,
                    self.config,
                )
            return blended_datasets

        blended_datasets = [None] * len(Split)
        for i in range(len(Split)):
            split_spoof = [None] * len(Split)
            split_spoof[i] = (0.0, 1.0)
            sizes_spoof = [0] * len(Split)
            sizes_spoof[i] = self.sizes[i]

            blend = self.config.blend_per_split[i]
            if blend is None:
                continue
            prefixes, weights = blend
            if weights is not None:
                weights = normalize(weights)

            if len(prefixes) == 1:
                blended_datasets[i] = self._build_megatron_dataset_splits(
                    prefixes[0], split_spoof, sizes_spoof
                )[i]
                continue

            if weights is None:
                sizes_per_dataset = [[None for _ in Split] for _ in prefixes]
            else:
                sizes_per_dataset = _get_size_per_split_per_dataset(weights, sizes_spoof)

            megatron_datasets = self._build_megatron_datasets_parallel(
                prefixes, split_spoof, sizes_per_dataset
            )[i]

            if weights is not None and self.sizes[i] is not None:
                size_per_dataset = list(zip(*sizes_per_dataset))[i]
                size = sum(size_per_dataset)
                if self.config.renormalize_blend_weights:
                    weights = [s / size for s in size_per_dataset]
            elif weights is None:
                try:
                    weights = [len(megatron_dataset) for megatron_dataset in megatron_datasets]
                except TypeError:
                    weights = [0 for _ in prefixes]
                if self.sizes[i] is not None:
                    size = min(self.sizes[i], sum(weights))
                else:
                    size = None
            else:
                raise RuntimeError
            blended_datasets[i] = self.build_generic_dataset(
                BlendedDataset,
                self.is_built_on_rank,
                True,
                megatron_datasets,
                weights,
                size,
                self.config,
            )
        return blended_datasets

    def _build_megatron_datasets_parallel(
        self, prefixes: List[str], split: List, sizes_per_dataset: List[List[Optional[int]]]
    ) -> List[List[Optional[MegatronDataset]]]:
        """Build each prefix's split datasets with a thread pool; rank 0 first, then the others."""

        def _threading_helper(megatron_datasets, num_workers):
            with ThreadPoolExecutor(max_workers=num_workers) as executor:
                futures = [
                    executor.submit(
                        self._build_megatron_dataset_splits,
                        prefixes[i],
                        split,
                        sizes_per_dataset[i],
                        False,
                    )
                    for i in range(len(prefixes))
                ]
                for future in futures:
                    megatron_datasets_split = future.result()
                    for j in range(len(megatron_datasets_split)):
                        megatron_datasets[j].append(megatron_datasets_split[j])

        megatron_datasets = [[] for _ in range(len(Split))]
        num_workers = self.config.num_dataset_builder_threads
        if torch.distributed.is_initialized():
            rank = torch.distributed.get_rank()
            if rank == 0:
                _threading_helper(megatron_datasets, num_workers)
            torch.distributed.barrier()
            if rank != 0:
                _threading_helper(megatron_datasets, num_workers)
        else:
            _threading_helper(megatron_datasets, num_workers)
        return megatron_datasets

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
        split_indices = []
        for i, _ in enumerate(Split):
            if split[i] is not None:
                beg = int(round(split[i][0] * float(num_elements)))
                end = int(round(split[i][1] * float(num_elements)))
                split_indices.append(numpy.arange(start=beg, stop=end, step=1, dtype=numpy.int32))
            else:
                split_indices.append(None)

        for i, split_name in enumerate(Split):
            if split_indices[i] is not None and len(split_indices[i]) == 0 and sizes[i]:
                raise ValueError(
                    f"--split {self.config.split} leaves the {split_name.name} split of "
                    f"{dataset_path} with no documents ({num_elements} in total) but {sizes[i]} "
                    "samples are requested from it"
                )

        mid_level_datasets = []
        for i, _split in enumerate(Split):
            if split[i] is None:
                mid_level_datasets.append(None)
            else:
                mid_level_datasets.append(
                    self.build_generic_dataset(
                        self.cls,
                        self.is_built_on_rank,
                        synchronize_ranks,
                        low_level_dataset,
                        dataset_path,
                        split_indices[i],
                        sizes[i],
                        _split,
                        self.config,
                    )
                )
        return mid_level_datasets

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
        if torch.distributed.is_initialized():
            rank = torch.distributed.get_rank()
            dataset = None
            if rank == 0 and is_built_on_rank():
                try:
                    dataset = cls(*args)
                except OSError as err:
                    raise Exception(
                        "Failed to write dataset materials to the data cache directory. Please "
                        "supply a directory to which you have write access via the path_to_cache "
                        "attribute in BlendedMegatronDatasetConfig (--data-cache-path) and retry."
                    ) from err
            if synchronize_ranks:
                torch.distributed.barrier()
            if rank != 0 and is_built_on_rank():
                dataset = cls(*args)
            return dataset
        return cls(*args)


def _get_size_per_split_per_dataset(
    normalized_weights: List[float], target_size_per_split: List[Optional[int]]
) -> List[List[Optional[int]]]:
    """Samples to request per dataset per split: ceil(N * w * 1.005) (core_v0.8.0's 0.5 %
    margin)."""
    assert numpy.isclose(sum(normalized_weights), 1.0)
    return [
        [
            int(math.ceil(target_size * weight * 1.005)) if target_size is not None else None
            for target_size in target_size_per_split
        ]
        for weight in normalized_weights
    ]
