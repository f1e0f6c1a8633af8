"""Fine-tuning machinery shared by the tasks, as in Megatron's tasks/finetune_utils.py."""

import torch

from megatron.core import parallel_state as mpu


def build_data_loader(dataset, micro_batch_size, num_workers, drop_last, task_collate_fn=None):
    """A loader over this data-parallel rank's share of the dataset.

    The sampler is torch's DistributedSampler over the data-parallel group (shuffle on, seed 0,
    the index list padded to a multiple of the DP size), as in Megatron.
    """
    world_size = mpu.get_data_parallel_world_size()
    rank = mpu.get_data_parallel_rank()
    sampler = torch.utils.data.distributed.DistributedSampler(
        dataset, num_replicas=world_size, rank=rank
    )
    return torch.utils.data.DataLoader(
        dataset,
        batch_size=micro_batch_size,
        sampler=sampler,
        shuffle=False,
        num_workers=num_workers,
        drop_last=drop_last,
        pin_memory=torch.cuda.is_available(),
        collate_fn=task_collate_fn,
    )
