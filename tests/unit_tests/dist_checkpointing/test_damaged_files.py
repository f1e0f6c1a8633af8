"""A damaged torch_dist checkpoint stops every rank with the same line naming the file: a
truncated `.distcp`, a missing one (checked by every rank before any reads, so no rank is left
waiting in a collective), and a record whose bytes are garbage."""

import os

import torch

from tests.unit_tests.dist_utils import run_distributed


def _save_and_damage(ckpt):
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import CheckpointingException, ShardedTensor

    rank = torch.distributed.get_rank()
    if rank == 0:
        os.makedirs(ckpt)
    torch.distributed.barrier()
    rows = torch.arange(64 * 4, dtype=torch.float32).view(64, 4)[32 * rank : 32 * rank + 32]
    dist_checkpointing.save({'w': ShardedTensor.from_rank_offsets('w', rows, (0, rank, 2))}, ckpt)
    target = os.path.join(ckpt, '__1_0.distcp')
    original = open(target, 'rb').read()
    out = {}
    damages = {
        'truncated': lambda: open(target, 'wb').write(original[: len(original) // 2]),
        'missing': lambda: os.remove(target),
        'garbage': lambda: open(target, 'wb').write(b'\x07' * len(original)),
    }
    for name, damage in damages.items():
        torch.distributed.barrier()
        if rank == 0:
            damage()
        torch.distributed.barrier()
        full = torch.zeros(64, 4)
        try:
            sh = ShardedTensor.from_rank_offsets('w', full, replica_id=rank)
            dist_checkpointing.load({'w': sh}, ckpt)
            out[name] = None
        except CheckpointingException as exc:
            out[name] = str(exc)
        torch.distributed.barrier()
        if rank == 0:
            open(target, 'wb').write(original)
    return out


def test_damaged_distcp_names_the_file_on_every_rank(tmp_path):
    ckpt = str(tmp_path / 'ckpt')
    outs = run_distributed(_save_and_damage, world_size=2, args=(ckpt,))
    assert outs[0] == outs[1]  # the same line on every rank
    target = os.path.join(ckpt, '__1_0.distcp')
    assert outs[0]['truncated'].startswith(f'{target} is truncated: ')
    assert outs[0]['truncated'].endswith('(the save did not finish, or the file was damaged)')
    assert outs[0]['missing'] == (
        f'{ckpt} is incomplete: __1_0.distcp is missing (the files of global rank 1 of the save)'
    )
    assert outs[0]['garbage'].startswith(f'{target} is corrupt (a record cannot be read: ')
    assert all('\n' not in message for message in outs[0].values())
