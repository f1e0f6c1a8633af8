"""BlendedDataset: samples drawn from several MegatronDatasets in fixed proportions (no RNG).

Item k is `datasets[dataset_index[k]][dataset_sample_index[k]]` plus `dataset_id`; the two
indices come from the greedy C++ `build_blending_indices` (or the exhaustive variant when size is
None) and are cached as `{hash}-BlendedDataset-{split}-{dataset_index,dataset_sample_index}.npy`.
"""

import hashlib
import json
import logging
import os
import time
from collections import OrderedDict
from typing import Dict, List, Optional, Tuple, Union

import numpy
import torch

from megatron.core.datasets.blended_megatron_dataset_config import BlendedMegatronDatasetConfig
from megatron.core.datasets.index_cache import load_index, save_index, write_text
from megatron.core.datasets.megatron_dataset import MegatronDataset
from megatron.core.datasets.utils import log_single_rank, normalize

logger = logging.getLogger(__name__)

_VERBOSE = False


class BlendedDataset(torch.utils.data.Dataset):
    """Conjugating class for a set of MegatronDataset instances.

    Args:
        datasets: the datasets to blend (same class, same split).
        weights: blend weights (normalised when size is given), or the dataset lengths (ints) when
            size is None, in which case every dataset is used exactly once (exhaustive blend).
        size: number of samples, or None.
        config: the config (path_to_cache).
    """

    def __init__(
        self,
        datasets: List[MegatronDataset],
        weights: List[Union[int, float]],
        size: Optional[int],
        config: BlendedMegatronDatasetConfig,
    ) -> None:
        assert len(datasets) == len(weights), "BlendedDataset needs one weight per dataset"
        if len(datasets) >= 32767:
            raise ValueError(f"BlendedDataset supports at most 32766 datasets, got {len(datasets)}")
        assert all(type(d) is type(datasets[0]) for d in datasets)
        assert all(d.index_split == datasets[0].index_split for d in datasets)
        if not all(w > 0 for w in weights):
            raise ValueError(f"BlendedDataset weights must be > 0, got {weights}")
        if size is None and isinstance(weights[0], float):
            assert all(w == int(w) for w in weights)

        if len(datasets) == 1:
            message = "Building a BlendedDataset for a single MegatronDataset"
            log_single_rank(logger, logging.WARNING, message)

        self.datasets = datasets
        self.split = datasets[0].index_split
        # A sized blend draws in proportion to the weights; an exhaustive one counts samples.
        self.weights = weights if size is None else normalize(weights)
        self.size = size
        self.config = config
        self.built_anew_on_cache_miss = False
        self.unique_identifiers = OrderedDict(
            (
                ("class", type(self).__name__),
                ("datasets", [part.unique_identifiers for part in datasets]),
                ("split", self.split.name),
                ("weights", self.weights),
                ("size", size),
            )
        )
        # The description (and its md5, the cache file prefix) nests each part's identifiers.
        self.unique_description = json.dumps(
            self.unique_identifiers, indent=4, default=lambda obj: obj.unique_identifiers
        )
        self.unique_description_hash = _md5_hex(self.unique_description)
        indices = self._build_indices()
        self.dataset_index, self.dataset_sample_index = indices

    def __len__(self) -> int:
        return self.dataset_index.shape[0]

    def __getitem__(self, idx: int) -> Dict[str, Union[int, numpy.ndarray]]:
        source = self.dataset_index[idx]
        sample = self.datasets[source][self.dataset_sample_index[idx]]
        return {"dataset_id": source, **sample}

    def _cache_files(self) -> Tuple[str, str, str]:
        """(description, dataset index, dataset sample index) paths in the cache directory."""
        stem = os.path.join(
            self.config.path_to_cache,
            f"{self.unique_description_hash}-{type(self).__name__}-{self.split.name}",
        )
        return (
            f"{stem}-description.txt",
            f"{stem}-dataset_index.npy",
            f"{stem}-dataset_sample_index.npy",
        )

    def _build_indices(self) -> Tuple[numpy.ndarray, numpy.ndarray]:
        cache_dir = self.config.path_to_cache
        files = self._cache_files() if cache_dir else None
        cache_hit = bool(files) and all(os.path.isfile(path) for path in files)
        writer = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
        # Without a cache every rank computes its own copy; with one, rank 0 writes it first.
        if cache_dir and (cache_hit or not writer):
            log_single_rank(logger, logging.INFO, f"Load the {type(self).__name__} indices")
            if not cache_hit:
                raise FileNotFoundError(
                    f"BlendedDataset indices not found in {cache_dir} (rank 0 builds them)"
                )
            _, index_file, sample_index_file = files
            return load_index(index_file, ndim=1), load_index(sample_index_file, ndim=1)

        log_single_rank(logger, logging.INFO, f"Build and save the {type(self).__name__} indices")
        self.built_anew_on_cache_miss = True
        started = time.time()
        dataset_index, dataset_sample_index = self._compute_indices()
        if cache_dir:
            description_file, index_file, sample_index_file = files
            os.makedirs(cache_dir, exist_ok=True)
            write_text(description_file, self.unique_description)
            save_index(index_file, dataset_index)
            save_index(sample_index_file, dataset_sample_index)
        else:
            log_single_rank(
                logger,
                logging.WARNING,
                "Unable to save the blending indexes because path_to_cache is None",
            )
        elapsed = time.time() - started
        log_single_rank(logger, logging.DEBUG, f"\t> time elapsed: {elapsed:4f} seconds")
        return dataset_index, dataset_sample_index

    def _compute_indices(self) -> Tuple[numpy.ndarray, numpy.ndarray]:
        """(which dataset, which of its samples) per blended sample, from the C++ helpers.

        int16 dataset ids (hence the 32766 limit) and int64 sample ids, filled in place.
        """
        from megatron.core.datasets import helpers

        parts = len(self.datasets)
        count = self.size if self.size is not None else int(sum(self.weights))
        which = numpy.zeros(count, dtype=numpy.int16)
        row = numpy.zeros(count, dtype=numpy.int64)
        if self.size is None:
            # Exhaustive: the weights are the part lengths and every sample is used once.
            lengths = [int(w) for w in self.weights]
            helpers.build_exhaustive_blending_indices(which, row, lengths, parts)
        else:
            helpers.build_blending_indices(which, row, self.weights, parts, count, _VERBOSE)
        return which, row


def _md5_hex(text: str) -> str:
    return hashlib.md5(text.encode("utf-8")).hexdigest()
