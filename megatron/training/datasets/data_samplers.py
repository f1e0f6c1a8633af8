"""Batch samplers and the pretraining DataLoader (`--dataloader-type single|cyclic`).

Both samplers resume from `consumed_samples` (the global number of samples already trained on).
`MegatronPretrainingSampler` walks the dataset in order: each step takes the next
micro_batch_size x data_parallel_size indices and gives rank r the slice [r*mbs, (r+1)*mbs).
`MegatronPretrainingRandomSampler` reshuffles every epoch with a generator seeded by the epoch.
"""

import random
from typing import Optional

import numpy
import torch
from torch.utils.data import Dataset

from megatron.core.utils import uses_cuda


def _check_common(
    total_samples, consumed_samples, micro_batch_size, data_parallel_rank, data_parallel_size
):
    if total_samples <= 0:
        raise ValueError(f"no sample to consume: the dataset has {total_samples} samples")
    if consumed_samples >= total_samples:
        raise ValueError(
            f"no samples left to consume: consumed_samples {consumed_samples} >= {total_samples} "
            "samples"
        )
    if micro_batch_size <= 0:
        raise ValueError(f"--micro-batch-size must be > 0, got {micro_batch_size}")
    if data_parallel_size <= 0:
        raise ValueError(f"data parallel size must be > 0, got {data_parallel_size}")
    if not 0 <= data_parallel_rank < data_parallel_size:
        raise ValueError(
            f"data_parallel_rank {data_parallel_rank} not in [0, {data_parallel_size})"
        )


class MegatronPretrainingSampler:
    """Sequential batch sampler over [consumed_samples, total_samples).

    Args:
        total_samples: dataset length.
        consumed_samples: samples already consumed (all ranks together).
        micro_batch_size: samples per rank per step.
        data_parallel_rank, data_parallel_size: this rank's place in the data-parallel group.
        drop_last: drop a final incomplete global batch.
    """

    def __init__(
        self,
        total_samples,
        consumed_samples,
        micro_batch_size,
        data_parallel_rank,
        data_parallel_size,
        drop_last=True,
    ):
        _check_common(
            total_samples,
            consumed_samples,
            micro_batch_size,
            data_parallel_rank,
            data_parallel_size,
        )
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.micro_batch_times_data_parallel_size = self.micro_batch_size * data_parallel_size
        self.drop_last = drop_last

    def __len__(self):
        return self.total_samples

    def get_start_end_idx(self):
        """This rank's slice of a global batch."""
        start_idx = self.data_parallel_rank * self.micro_batch_size
        return start_idx, start_idx + self.micro_batch_size

    def __iter__(self):
        batch = []
        for idx in range(self.consumed_samples, self.total_samples):
            batch.append(idx)
            if len(batch) == self.micro_batch_times_data_parallel_size:
                start_idx, end_idx = self.get_start_end_idx()
                yield batch[start_idx:end_idx]
                batch = []
        if len(batch) > 0 and not self.drop_last:
            start_idx, end_idx = self.get_start_end_idx()
            yield batch[start_idx:end_idx]


class RandomSeedDataset(Dataset):
    """Wraps a dataset so item idx is produced under seeds (base_seed + epoch + idx)."""

    def __init__(self, dataset, seed: int):
        self.base_seed = seed
        self.curr_seed = seed
        self.dataset = dataset

    def __len__(self):
        return len(self.dataset)

    def set_epoch(self, epoch):
        """Use seed base_seed + epoch from now on."""
        self.curr_seed = self.base_seed + epoch

    def __getitem__(self, idx):
        seed = idx + self.curr_seed
        torch.manual_seed(seed)
        random.seed(seed)
        numpy.random.seed(seed)
        return self.dataset[idx]


class MegatronPretrainingRandomSampler:
    """Shuffling batch sampler (`--dataloader-type cyclic`), resumable mid-epoch.

    Each epoch uses `torch.randperm` with a generator seeded by the epoch number. With
    data_sharding each rank shuffles inside its own contiguous bucket; otherwise one global
    permutation is dealt round-robin over the ranks. The last incomplete global batch is dropped.
    """

    def __init__(
        self,
        dataset,
        total_samples,
        consumed_samples,
        micro_batch_size,
        data_parallel_rank,
        data_parallel_size,
        data_sharding,
    ):
        _check_common(
            total_samples,
            consumed_samples,
            micro_batch_size,
            data_parallel_rank,
            data_parallel_size,
        )
        self.dataset = dataset
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.data_parallel_size = data_parallel_size
        self.data_sharding = data_sharding
        self.micro_batch_times_data_parallel_size = self.micro_batch_size * data_parallel_size
        self.last_batch_size = self.total_samples % self.micro_batch_times_data_parallel_size
        if self.total_samples - self.last_batch_size <= 0:
            raise ValueError(
                f"dataset of {total_samples} samples is smaller than one global batch "
                f"({self.micro_batch_times_data_parallel_size})"
            )

    def __len__(self):
        return self.total_samples

    def __iter__(self):
        active_total_samples = self.total_samples - self.last_batch_size
        self.epoch = self.consumed_samples // active_total_samples
        current_epoch_samples = self.consumed_samples % active_total_samples
        assert current_epoch_samples % self.micro_batch_times_data_parallel_size == 0

        if isinstance(self.dataset, RandomSeedDataset):
            self.dataset.set_epoch(self.epoch)

        g = torch.Generator()
        g.manual_seed(self.epoch)
        if self.data_sharding:
            bucket_size = (
                self.total_samples // self.micro_batch_times_data_parallel_size
            ) * self.micro_batch_size
            bucket_offset = current_epoch_samples // self.data_parallel_size
            start_idx = self.data_parallel_rank * bucket_size
            random_idx = torch.randperm(bucket_size, generator=g).tolist()
            idx_range = [start_idx + x for x in random_idx[bucket_offset:]]
        else:
            full_bucket_size = (self.total_samples // self.micro_batch_size) * self.micro_batch_size
            full_bucket_offset = current_epoch_samples
            idx_range_total = torch.randperm(full_bucket_size, generator=g).tolist()
            idx_range_active = idx_range_total[full_bucket_offset:]
            idx_range = idx_range_active[self.data_parallel_rank :: self.data_parallel_size]

        batch = []
        for idx in idx_range:
            batch.append(idx)
            if len(batch) == self.micro_batch_size:
                self.consumed_samples += self.micro_batch_times_data_parallel_size
                yield batch
                batch = []


def build_data_loader(
    dataset,
    consumed_samples: int,
    dataloader_type: str,
    micro_batch_size: int,
    data_parallel_rank: int,
    data_parallel_size: int,
    num_workers: int = 2,
    data_sharding: bool = True,
    pin_memory: Optional[bool] = None,
):
    """The DataLoader for `dataset`, with everything passed explicitly (no global args).

    Raises:
        ValueError: unknown dataloader_type.
    """
    if dataset is None:
        return None
    if dataloader_type == "single":
        batch_sampler = MegatronPretrainingSampler(
            total_samples=len(dataset),
            consumed_samples=consumed_samples,
            micro_batch_size=micro_batch_size,
            data_parallel_rank=data_parallel_rank,
            data_parallel_size=data_parallel_size,
        )
    elif dataloader_type == "cyclic":
        batch_sampler = MegatronPretrainingRandomSampler(
            dataset,
            total_samples=len(dataset),
            consumed_samples=consumed_samples,
            micro_batch_size=micro_batch_size,
            data_parallel_rank=data_parallel_rank,
            data_parallel_size=data_parallel_size,
            data_sharding=data_sharding,
        )
    elif dataloader_type == "external":
        return dataset
    else:
        raise ValueError(
            f"--dataloader-type {dataloader_type} is not supported (single, cyclic, external)"
        )
    if pin_memory is None:
        pin_memory = uses_cuda()
    return torch.utils.data.DataLoader(
        dataset,
        batch_sampler=batch_sampler,
        num_workers=num_workers,
        pin_memory=pin_memory,
        persistent_workers=num_workers > 0,
        # A private generator: creating the iterator must not draw from the global torch RNG,
        # or a resumed run (whose RNG state was just restored) would see different dropout masks.
        generator=torch.Generator(),
    )


def build_pretraining_data_loader(dataset, consumed_samples):
    """Megatron's entry point: the DataLoader built from the global args and parallel state.

    Reads args.dataloader_type (None -> 'single'), micro_batch_size, num_workers, data_sharding.
    """
    if dataset is None:
        return None
    from megatron.core import parallel_state
    from megatron.training.global_vars import get_args

    args = get_args()
    if getattr(args, "dataloader_type", None) == "external":
        # The provider's object is the loader (any iterable, or anything the user's forward step
        # knows how to read): passed through untouched, unsized ones included, as Megatron does.
        return dataset
    if len(dataset) == 0:
        # A split nobody asked samples from (--eval-iters 0, --train-iters 0): no loader.
        return None
    if parallel_state.model_parallel_is_initialized():
        dp_rank = parallel_state.get_data_parallel_rank()
        dp_size = parallel_state.get_data_parallel_world_size()
    else:  # a single process without model-parallel state
        dp_rank, dp_size = 0, 1
    return build_data_loader(
        dataset,
        consumed_samples,
        dataloader_type=getattr(args, "dataloader_type", None) or "single",
        micro_batch_size=args.micro_batch_size,
        data_parallel_rank=dp_rank,
        data_parallel_size=dp_size,
        num_workers=args.num_workers,
        data_sharding=getattr(args, "data_sharding", True),
    )
