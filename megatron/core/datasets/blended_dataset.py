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
        assert len(datasets) == len(weights)
        if len(datasets) >= 32767:
            raise ValueError(f"BlendedDataset supports at most 32766 datasets, got {len(datasets)}")
        assert all(type(d) is type(datasets[0]) for d in datasets)
        assert all(d.index_split == datasets[0].index_split for d in datasets)
        if not all(w > 0 for w in weights):
            raise ValueError(f"BlendedDataset weights must be > 0, got {weights}")
        if size is None and isinstance(weights[0], float):
            assert all(w == int(w) for w in weights)

        if len(datasets) == 1:
            log_single_rank(
                logger, logging.WARNING, "Building a BlendedDataset for a single MegatronDataset"
            )

        if size is not None:
            weights = normalize(weights)

        self.datasets = datasets
        self.split = self.datasets[0].index_split
        self.weights = weights
        self.size = size
        self.config = config

        unique_identifiers = OrderedDict()
        unique_identifiers["class"] = type(self).__name__
        unique_identifiers["datasets"] = [dataset.unique_identifiers for dataset in self.datasets]
        unique_identifiers["split"] = self.split.name
        unique_identifiers["weights"] = self.weights
        unique_identifiers["size"] = self.size
        self.unique_identifiers = unique_identifiers
        self.unique_description = json.dumps(
            unique_identifiers, indent=4, default=lambda obj: obj.unique_identifiers
        )
        self.unique_description_hash = hashlib.md5(
            self.unique_description.encode("utf-8")
        ).hexdigest()
        self.built_anew_on_cache_miss = False

        self.dataset_index, self.dataset_sample_index = self._build_indices()

    def __len__(self) -> int:
        return self.dataset_index.shape[0]

    def __getitem__(self, idx: int) -> Dict[str, Union[int, numpy.ndarray]]:
        dataset_id = self.dataset_index[idx]
        dataset_sample_id = self.dataset_sample_index[idx]
        return {"dataset_id": dataset_id, **self.datasets[dataset_id][dataset_sample_id]}

    def _build_indices(self) -> Tuple[numpy.ndarray, numpy.ndarray]:
        path_to_cache = self.config.path_to_cache
        if path_to_cache:
            base = f"{self.unique_description_hash}-{type(self).__name__}-{self.split.name}"
            path_to_description = os.path.join(path_to_cache, f"{base}-description.txt")
            path_to_dataset_index = os.path.join(path_to_cache, f"{base}-dataset_index.npy")
            path_to_dataset_sample_index = os.path.join(
                path_to_cache, f"{base}-dataset_sample_index.npy"
            )
            cache_hit = all(
                map(
                    os.path.isfile,
                    [path_to_description, path_to_dataset_index, path_to_dataset_sample_index],
                )
            )
        else:
            cache_hit = False

        if not path_to_cache or (
            not cache_hit
            and (not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0)
        ):
            log_single_rank(
                logger, logging.INFO, f"Build and save the {type(self).__name__} indices"
            )
            self.built_anew_on_cache_miss = True
            t_beg = time.time()
            from megatron.core.datasets import helpers

            if self.size is not None:
                dataset_index = numpy.zeros(self.size, dtype=numpy.int16)
                dataset_sample_index = numpy.zeros(self.size, dtype=numpy.int64)
                helpers.build_blending_indices(
                    dataset_index,
                    dataset_sample_index,
                    self.weights,
                    len(self.datasets),
                    self.size,
                    _VERBOSE,
                )
            else:
                size = int(sum(self.weights))
                dataset_index = numpy.zeros(size, dtype=numpy.int16)
                dataset_sample_index = numpy.zeros(size, dtype=numpy.int64)
                helpers.build_exhaustive_blending_indices(
                    dataset_index,
                    dataset_sample_index,
                    [int(w) for w in self.weights],
                    len(self.datasets),
                )

            if path_to_cache:
                os.makedirs(path_to_cache, exist_ok=True)
                write_text(path_to_description, self.unique_description)
                save_index(path_to_dataset_index, dataset_index)
                save_index(path_to_dataset_sample_index, dataset_sample_index)
            else:
                log_single_rank(
                    logger,
                    logging.WARNING,
                    "Unable to save the blending indexes because path_to_cache is None",
                )
            log_single_rank(
                logger, logging.DEBUG, f"\t> time elapsed: {time.time() - t_beg:4f} seconds"
            )
            return dataset_index, dataset_sample_index

        log_single_rank(logger, logging.INFO, f"Load the {type(self).__name__} indices")
        if not cache_hit:
            raise FileNotFoundError(
                f"BlendedDataset indices not found in {path_to_cache} (rank 0 builds them)"
            )
        dataset_index = load_index(path_to_dataset_index, ndim=1)
        dataset_sample_index = load_index(path_to_dataset_sample_index, ndim=1)
        return dataset_index, dataset_sample_index
