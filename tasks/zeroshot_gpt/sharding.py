"""The zero-shot evaluation loader: every sample counted once, whatever the data-parallel size.

Megatron's task loader (tasks/finetune_utils.build_data_loader) uses torch's DistributedSampler,
which pads the index list to a multiple of the DP size by repeating its first indices, so with
DP > 1 and a sample count that DP does not divide, the repeated samples are scored twice and
the perplexity / accuracy drifts. Here the loader keeps that sampler's order and batch count
(every rank runs the same number of forward steps, which the per-batch all-reduce needs) but
flags each position: `batch['weight']` is 1 for a real sample and 0 for a padding repeat, and
the metrics multiply by it.
"""

import numpy as np
import torch

from megatron.core import parallel_state as mpu


class PaddingFlagSampler(torch.utils.data.Sampler):
    """DistributedSampler's indices for one rank, each paired with "is this a real sample".

    The sampler lays the (shuffled) indices out in a list of length ceil(N / W) * W, the last
    entries repeating the first, and rank r takes positions r, r + W, ...: position p is a
    repeat exactly when p >= N.
    """

    def __init__(self, dataset, num_replicas: int, rank: int):
        self._inner = torch.utils.data.distributed.DistributedSampler(
            dataset, num_replicas=num_replicas, rank=rank
        )
        self._size = len(dataset)
        self._replicas = num_replicas
        self._rank = rank

    def __len__(self):
        return len(self._inner)

    def __iter__(self):
        for step, index in enumerate(self._inner):
            yield index, self._rank + step * self._replicas < self._size


class WeightedSamples(torch.utils.data.Dataset):
    """Items of `dataset` with a 'weight' entry; indexed by (index, is_real) pairs.

    Attribute reads fall through to the wrapped dataset (num_tokenized_tokens, ...).
    """

    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self):
        return len(self.dataset)

    def __getattr__(self, name):
        if name == 'dataset':  # not set yet (unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.dataset, name)

    def __getitem__(self, key):
        index, is_real = key
        item = dict(self.dataset[index])
        item["weight"] = np.float32(1.0 if is_real else 0.0)
        return item


def build_eval_data_loader(dataset, micro_batch_size, num_workers, num_replicas=None, rank=None):
    """A loader over this data-parallel rank's share; `num_replicas` / `rank` default to the
    data-parallel group's."""
    if num_replicas is None:
        num_replicas = mpu.get_data_parallel_world_size()
        rank = mpu.get_data_parallel_rank()
    return torch.utils.data.DataLoader(
        WeightedSamples(dataset),
        batch_size=micro_batch_size,
        sampler=PaddingFlagSampler(dataset, num_replicas, rank),
        shuffle=False,
        num_workers=num_workers,
        drop_last=False,
        pin_memory=torch.cuda.is_available(),
    )
