"""The fast paths of torch_dist saves and loads: direct reads of DCP tensor records
(strategies/direct_reader.py), the reused save plan, and asynchronous snapshots that copy each
byte once.

Direct reads: records written by plain PyTorch DCP load bit-exactly; row-major records are read
straight into their targets (whole chunks, row ranges, column blocks through one span, into
non-contiguous targets), while a record holding a strided tensor and byte objects take DCP's
own per-item path.

Cached plan: a second save with the same structure skips the planning exchange
(`--ckpt-assume-constant-structure`) or rank 0's checks (default) and writes the same
metadata; a save whose structure changed is checked again (an invalid one is refused on every
rank).

Snapshots: tensors that view another written tensor's memory (the distributed optimizer's fp32
main parameters are views of the fp32 model parameters) are views of its snapshot, and every
snapshot keeps the values of the moment of the save.
"""

import io
import os

import pytest
import torch

from tests.unit_tests.dist_utils import run_distributed

FULL = torch.arange(48, dtype=torch.float32).view(6, 8)


def _plain_dcp_checkpoint(path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    base = torch.arange(48, dtype=torch.int64).view(6, 8)
    state = {
        'a': FULL.clone(),
        'b': torch.linspace(-1, 1, 15).to(torch.bfloat16).view(3, 5),
        'c': torch.tensor(7, dtype=torch.int64),
        't': base.t(),  # strided (column-major) record: not read directly
        'o': io.BytesIO(b'object bytes'),
    }
    dcp.save(state, storage_writer=FileSystemWriter(path), no_dist=True)
    return state


def test_direct_reads_equal_dcp_and_fall_back_for_strided_records(tmp_path, monkeypatch):
    import torch.distributed.checkpoint as dcp

    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.strategies import direct_reader
    from megatron.core.dist_checkpointing.strategies.torch import (
        SafeFileSystemReader,
        TorchDistLoadShardedStrategy,
    )

    path = str(tmp_path / 'plain')
    saved = _plain_dcp_checkpoint(path)
    via_dcp = []
    original = direct_reader.DirectFileSystemReader._read_item_dcp

    def counted(self, stream, item, planner):
        via_dcp.append(item.storage_index.fqn)
        return original(self, stream, item, planner)

    monkeypatch.setattr(direct_reader.DirectFileSystemReader, '_read_item_dcp', counted)
    state = {k: torch.zeros_like(v) for k, v in saved.items() if isinstance(v, torch.Tensor)}
    state['o'] = io.BytesIO()
    dcp.load(state, storage_reader=SafeFileSystemReader(path), no_dist=True)
    for key in ('a', 'b', 'c', 't'):
        assert torch.equal(state[key], saved[key]), key
    assert state['o'].getvalue() == b'object bytes'
    assert sorted(via_dcp) == ['o', 't']

    # Sub-boxes of the stored [6, 8] chunk: rows (one contiguous range, read in place), a
    # column block (one span, then a strided copy), into a non-contiguous target.
    via_dcp.clear()
    rows = torch.zeros(2, 8)
    cols = torch.zeros(6, 3)
    transposed_target = torch.zeros(8, 6).t()  # [6, 8], not contiguous
    request = {
        'rows': ShardedTensor('a', rows, torch.float32, (2, 8), (6, 8), (3, 0), (3, 1), 1),
        'cols': ShardedTensor('a', cols, torch.float32, (6, 3), (6, 8), (0, 5), None, 1),
        'whole': ShardedTensor('a', transposed_target, torch.float32, (6, 8), (6, 8), (0, 0), None),
    }
    TorchDistLoadShardedStrategy().load(request, path)
    assert torch.equal(rows, FULL[3:5]) and torch.equal(cols, FULL[:, 5:])
    assert torch.equal(transposed_target, FULL)
    assert via_dcp == []


def _save_twice_then_change(ckpt, cached):
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import CheckpointingException, ShardedTensor
    from megatron.core.dist_checkpointing.strategies import torch as torch_strategy
    from megatron.core.dist_checkpointing.strategies.torch import (
        TorchDistSaveShardedStrategy,
        read_metadata,
    )

    rank = torch.distributed.get_rank()
    exchanges, checks = [], []
    gather, verdict = torch_strategy._gather_to_0, torch_strategy._global_verdict
    torch_strategy._gather_to_0 = lambda obj, group=None: exchanges.append(1) or gather(obj, group)
    torch_strategy._global_verdict = lambda gathered: checks.append(1) or verdict(gathered)
    strategy = TorchDistSaveShardedStrategy(cached_metadata=cached)
    out = {}
    try:
        for name, value in (('first', 1.0), ('second', 2.0)):
            path = os.path.join(ckpt, name)
            if rank == 0:
                os.makedirs(path)
            torch.distributed.barrier()
            rows = FULL[3 * rank : 3 * rank + 3] * value
            sd = {'w': ShardedTensor.from_rank_offsets('w', rows.clone(), (0, rank, 2))}
            dist_checkpointing.save(sd, path, strategy)
            out[name] = (len(exchanges), len(checks))
        out['loaded'] = dist_checkpointing.load_plain_tensors(os.path.join(ckpt, 'second'))['w']
        out['same_metadata'] = (
            read_metadata(os.path.join(ckpt, 'first')).state_dict_metadata
            == read_metadata(os.path.join(ckpt, 'second')).state_dict_metadata
        )
        path = os.path.join(ckpt, 'changed')
        if rank == 0:
            os.makedirs(path)
        torch.distributed.barrier()
        sd = {'w': ShardedTensor.from_rank_offsets('w', FULL.clone(), replica_id=0)}
        try:
            dist_checkpointing.save(sd, path, strategy)
        except CheckpointingException as exc:
            out['changed'] = str(exc)
    finally:
        torch_strategy._gather_to_0 = gather
        torch_strategy._global_verdict = verdict
    return out


@pytest.mark.parametrize('cached', [True, False])
def test_unchanged_structure_reuses_the_plan_and_a_changed_one_is_checked(tmp_path, cached):
    """--ckpt-assume-constant-structure (cached): the second save skips the exchange; without
    it the exchange runs but rank 0 reuses its verdict. Either way an invalid change is refused."""
    outs = run_distributed(_save_twice_then_change, world_size=2, args=(str(tmp_path), cached))
    for rank, out in enumerate(outs):
        if cached:
            assert out['first'] == out['second'] == (1, int(rank == 0))
        else:
            assert out['first'] == (1, int(rank == 0)) and out['second'] == (2, int(rank == 0))
        assert torch.equal(out['loaded'], FULL * 2.0) and out['same_metadata']
        assert 'Invalid access pattern for w' in out['changed'], out.get('changed')


def test_snapshot_copies_shared_bytes_once_and_keeps_the_saved_values():
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.strategies.torch import build_write_items

    buffer = torch.arange(100, dtype=torch.float32)  # a contiguous parameter buffer
    weight = buffer[10:70].view(6, 10)
    main = weight.view(-1)  # fp32 main parameter: a view of the same memory
    sd = {
        'w': ShardedTensor.from_rank_offsets('w', weight),
        'main': ShardedTensor.from_rank_offsets_flat(
            'opt.w', main[5:40], (6, 10), flattened_range=slice(5, 40)
        ),
        'b': ShardedTensor.from_rank_offsets('b', buffer[70:80]),
        'half': ShardedTensor.from_rank_offsets('half', torch.arange(4, dtype=torch.bfloat16)),
    }
    staging = {}
    for step in range(2):  # the second save reuses the buffers
        expected = [(item.index, data.clone()) for item, data in build_write_items(sd)]
        items = build_write_items(sd, stage=True, staging=staging)
        assert sorted(staging) == [('b', (0,)), ('half', (0,)), ('w', (0, 0))]
        buffers = {buf.untyped_storage().data_ptr() for buf in staging.values()}
        assert all(data.untyped_storage().data_ptr() in buffers for _, data in items)
        buffer.add_(1000.0)  # training goes on
        for (index, value), (item, data) in zip(expected, items):
            assert item.index == index and torch.equal(data, value), index
