"""Base class of the mid-level datasets (GPTDataset & co.): identity, cache key, split indices."""

import hashlib
import json
from abc import ABC, abstractmethod
from collections import OrderedDict
from typing import Dict, Iterable, List, Optional, Union

import numpy
import torch

from megatron.core.datasets.blended_megatron_dataset_config import BlendedMegatronDatasetConfig
from megatron.core.datasets.indexed_dataset import IndexedDataset
from megatron.core.datasets.utils import Split

LowLevelDataset = Union[IndexedDataset, Iterable]


class MegatronDataset(ABC, torch.utils.data.Dataset):
    """The highest-level wrapper class all dataset classes inherit from.

    `unique_description` is `json.dumps` (indent 4) of: class, dataset_path, num_samples,
    index_split, then the config attributes of `_key_config_attributes()`; its md5 names the cache.

    Args:
        dataset: the low-level dataset.
        dataset_path: its path prefix (None for mock data).
        indices: the low-level elements this split exposes.
        num_samples: minimum number of samples to build; None = one epoch.
        index_split: the split.
        config: the config.
    """

    def __init__(
        self,
        dataset: LowLevelDataset,
        dataset_path: Optional[str],
        indices: numpy.ndarray,
        num_samples: Optional[int],
        index_split: Split,
        config: BlendedMegatronDatasetConfig,
    ) -> None:
        self.dataset, self.indices = dataset, indices
        self.dataset_path = dataset_path
        self.index_split, self.num_samples = index_split, num_samples
        self.config = config

        # Key order is part of the cache name: these four first, then the config's attributes.
        identity = OrderedDict(
            [
                ("class", type(self).__name__),
                ("dataset_path", dataset_path),
                ("num_samples", num_samples),
                ("index_split", index_split.name),
            ]
        )
        identity.update((name, getattr(config, name)) for name in self._key_config_attributes())
        self.unique_identifiers = identity
        # Nested objects (the tokenizer) serialize as their own identity dicts.
        self.unique_description = json.dumps(
            identity, indent=4, default=lambda nested: nested.unique_identifiers
        )
        self.unique_description_hash = hashlib.md5(self.unique_description.encode()).hexdigest()
        self.built_anew_on_cache_miss = False

    @staticmethod
    def numel_low_level_dataset(low_level_dataset: LowLevelDataset) -> int:
        """Number of elements of the low-level dataset the split fractions apply to."""
        raise NotImplementedError

    @staticmethod
    def build_low_level_dataset(
        dataset_path: str, config: BlendedMegatronDatasetConfig
    ) -> LowLevelDataset:
        """Open the low-level dataset of a path prefix."""
        raise NotImplementedError

    @staticmethod
    def _key_config_attributes() -> List[str]:
        """Config attributes that identify the dataset (and its cache)."""
        return ["random_seed", "sequence_length", "split", "split_matrix", "tokenizer"]

    @abstractmethod
    def __len__(self) -> int:
        pass

    @abstractmethod
    def __getitem__(self, idx: int) -> Dict[str, Union[torch.Tensor, numpy.ndarray]]:
        pass
