"""megatron.core.dist_checkpointing save / load on PyTorch DCP (2 gloo ranks and one process).

Layout on disk, resharding of regular and flattened chunks, sharding-integrity errors, every
strictness choice, weights-only loading (planted pickles are refused), one-line errors for an
incomplete checkpoint, a padded vocabulary that grows or shrinks, plain
torch.distributed.checkpoint reading our files, and the asynchronous request (files only;
metadata.json after finalization).
"""

import io
import os
import pickle

import pytest
import torch

from tests.unit_tests.dist_utils import run_distributed

FULL = torch.arange(48, dtype=torch.float32).view(6, 8)


def _save_rows(ckpt):
    """Rank r holds rows [3r, 3r+3) of FULL; a flattened copy is split unevenly; an object grid."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor

    rank = torch.distributed.get_rank()
    rows = FULL[3 * rank : 3 * rank + 3].clone()
    flat_full = (FULL + 100).view(-1)
    cut = 17  # uneven, not on a row boundary
    start, stop = (0, cut) if rank == 0 else (cut, 48)
    sd = {
        'w': ShardedTensor.from_rank_offsets('w', rows, (0, rank, 2)),
        'opt': ShardedTensor.from_rank_offsets_flat(
            'opt.w', flat_full[start:stop].clone(), (6, 8), flattened_range=slice(start, stop)
        ),
        'obj': ShardedObject('grid', {'rank': rank}, (2,), (rank,)),
        'common': {'iteration': 7, 'rank': rank},
    }
    if rank == 0:
        os.makedirs(ckpt)
    torch.distributed.barrier()
    dist_checkpointing.save(sd, ckpt)
    return sorted(os.listdir(ckpt))


def _load_columns(ckpt, strict='assume_ok_unexpected', extra=False):
    """Load at another sharding: rank r reads columns [4r, 4r+4) and the whole 'opt.w'."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor

    rank = torch.distributed.get_rank()
    sd = {
        'w': ShardedTensor.from_rank_offsets('w', torch.zeros(6, 4), (1, rank, 2)),
        'opt': ShardedTensor.from_rank_offsets('opt.w', torch.zeros(6, 8), replica_id=rank),
        'obj': ShardedObject('grid', None, (2,), (1 - rank,)),
        'common': None,
    }
    if extra:
        sd['extra'] = ShardedTensor.from_rank_offsets('absent', torch.zeros(2), replica_id=rank)
    return dist_checkpointing.load(sd, ckpt, strict=strict)


def test_save_layout_and_reshard_on_load(tmp_path):
    ckpt = str(tmp_path / 'ckpt')
    files = run_distributed(_save_rows, world_size=2, args=(ckpt,))[0]
    assert files == [
        '.metadata',
        '__0_0.distcp',
        '__0_1.distcp',
        '__1_0.distcp',
        '__1_1.distcp',
        'common.pt',
        'metadata.json',
    ]
    with open(os.path.join(ckpt, 'metadata.json')) as f:
        assert f.read() == (
            '{"sharded_backend": "torch_dist", "sharded_backend_version": 1, '
            '"common_backend": "torch", "common_backend_version": 1}'
        )
    outs = run_distributed(_load_columns, world_size=2, args=(ckpt,))
    for rank, out in enumerate(outs):
        assert torch.equal(out['w'], FULL[:, 4 * rank : 4 * rank + 4])
        assert torch.equal(out['opt'], FULL + 100)
        assert out['obj'] == {'rank': 1 - rank}
        assert out['common'] == {'iteration': 7, 'rank': 0}  # rank 0's common state

    # Plain PyTorch DCP reads the same files (global tensors; objects as a one-element list).
    import torch.distributed.checkpoint as dcp

    from megatron.core.dist_checkpointing.strategies.torch import SafeFileSystemReader

    state = {'w': torch.zeros(6, 8), 'opt.w': torch.zeros(6, 8), 'grid/shard_1_2': io.BytesIO()}
    dcp.load(state, storage_reader=SafeFileSystemReader(ckpt), no_dist=True)
    assert torch.equal(state['w'], FULL) and torch.equal(state['opt.w'], FULL + 100)
    assert state['grid/shard_1_2'] == [{'rank': 1}]


def _strict_job(ckpt, strict):
    from megatron.core.dist_checkpointing import CheckpointingException

    try:
        out = _load_columns(ckpt, strict=strict, extra=True)
    except (CheckpointingException, KeyError) as exc:
        return 'error', str(exc)
    if isinstance(out, tuple):
        return 'returned', (out[1], out[2])
    return 'loaded', sorted(out)


@pytest.mark.parametrize(
    'strict,kind',
    [
        ('assume_ok_unexpected', 'error'),
        ('log_unexpected', 'loaded'),
        ('log_all', 'loaded'),
        ('raise_unexpected', 'error'),
        ('raise_all', 'error'),
        ('return_unexpected', 'returned'),
        ('return_all', 'returned'),
        ('ignore_all', 'loaded'),
    ],
)
def test_strictness_choices(tmp_path, strict, kind):
    ckpt = str(tmp_path / 'ckpt')
    run_distributed(_save_rows, world_size=2, args=(ckpt,))
    outs = run_distributed(_strict_job, world_size=2, args=(ckpt, strict))
    for got_kind, detail in outs:
        assert got_kind == kind
        if kind == 'error':
            assert 'absent' in detail
        if kind == 'loaded':
            assert 'extra' not in detail and 'w' in detail
        if kind == 'returned':
            missing, unexpected = detail
            assert unexpected == ['absent'] and missing == []


def _two_main_replicas(ckpt):
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import CheckpointingException, ShardedTensor
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

    if torch.distributed.get_rank() == 0:
        os.makedirs(ckpt)
    torch.distributed.barrier()
    sd = {'w': ShardedTensor.from_rank_offsets('w', torch.ones(2), replica_id=0)}
    out = {'sync': None, 'async': None}
    try:
        dist_checkpointing.save(sd, ckpt)
    except CheckpointingException as exc:
        out['sync'] = str(exc)
    # Asynchronous: the writer threads plan, so the refusal comes from the finalization, on
    # every rank, and nothing is left to finish (no metadata.json).
    async_dir = ckpt + '_async'
    if torch.distributed.get_rank() == 0:
        os.makedirs(async_dir)
    torch.distributed.barrier()
    queue = AsyncCallsQueue()
    queue.schedule_async_request(dist_checkpointing.save(sd, async_dir, async_sharded_save=True))
    try:
        queue.maybe_finalize_async_calls(blocking=True)
    except RuntimeError as exc:
        out['async'] = str(exc)
    out['async_finished'] = os.path.exists(os.path.join(async_dir, 'metadata.json'))
    return out


def test_two_main_replicas_refused_on_every_rank(tmp_path):
    outs = run_distributed(_two_main_replicas, world_size=2, args=(str(tmp_path / 'c'),))
    assert outs[0] == outs[1]
    for kind in ('sync', 'async'):
        assert 'Invalid access pattern for w' in outs[0][kind], outs[0]
        assert '2 main replicas' in outs[0][kind]
    assert not outs[0]['async_finished']


class _Planted:
    """A pickle that would run a shell command when unpickled without restrictions."""

    def __reduce__(self):
        return (os.system, ('echo PWNED > ' + os.environ.get('PLANTED_MARK', '/dev/null'),))


def _load_full(ckpt, rows=128, asm=False):
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor

    t = torch.full((rows, 4), 7.0)
    rid = torch.distributed.get_rank()
    sh = ShardedTensor.from_rank_offsets('emb', t, replica_id=rid, allow_shape_mismatch=asm)
    dist_checkpointing.load({'emb': sh}, ckpt)
    return t


def _refusal(ckpt):
    from megatron.core.dist_checkpointing import CheckpointingException

    try:
        _load_full(ckpt)
    except CheckpointingException as exc:
        return str(exc)
    return None


def _padding_and_safety(ckpt, mark):
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor

    rank = torch.distributed.get_rank()
    if rank == 0:
        os.makedirs(ckpt)
    torch.distributed.barrier()
    emb = torch.arange(128 * 4, dtype=torch.float32).view(128, 4)
    rows = emb[64 * rank : 64 * rank + 64].clone()
    sh = ShardedTensor.from_rank_offsets('emb', rows, (0, rank, 2), allow_shape_mismatch=True)
    dist_checkpointing.save({'emb': sh}, ckpt)
    out = {}
    # The padded vocabulary grew (192 rows) or shrank (64 rows): overlap read, the rest zero.
    for rows in (192, 64):
        t = _load_full(ckpt, rows, asm=True)
        n = min(rows, 128)
        out[rows] = torch.equal(t[:n], emb[:n]) and not t[n:].any()
    try:
        _load_full(ckpt, 64)
    except dist_checkpointing.CheckpointingException as exc:
        out['shape'] = str(exc)

    def planted(name, write):
        path = os.path.join(ckpt, name)
        original = open(path, 'rb').read()
        torch.distributed.barrier()
        if rank == 0:
            write(path)
        torch.distributed.barrier()
        message = _refusal(ckpt)
        torch.distributed.barrier()
        if rank == 0:
            with open(path, 'wb') as f:
                f.write(original)
        torch.distributed.barrier()
        return message

    os.environ['PLANTED_MARK'] = mark
    out['metadata'] = planted('.metadata', lambda p: pickle.dump(_Planted(), open(p, 'wb')))
    out['common'] = planted('common.pt', lambda p: torch.save({'x': _Planted()}, p))
    out['rank_file'] = planted('__1_0.distcp', os.remove)
    out['unfinished'] = planted('metadata.json', os.remove)
    return out


def test_weights_only_padding_and_incomplete_checkpoints(tmp_path):
    ckpt, mark = str(tmp_path / 'ckpt'), str(tmp_path / 'pwned')
    out = run_distributed(_padding_and_safety, world_size=2, args=(ckpt, mark))[0]
    assert out[192] and out[64]
    assert out['shape'] == (
        'Global shape mismatch for loaded ((128, 4)) and expected ((64, 4)) tensor for key emb'
    )
    assert not os.path.exists(mark)  # nothing ran
    assert 'refusing to load posix.system from checkpoint metadata' in out['metadata']
    assert 'common.pt cannot be loaded as weights only' in out['common']
    assert '__1_0.distcp is missing (the files of global rank 1 of the save)' in out['rank_file']
    assert 'is not a distributed checkpoint (no metadata.json)' in out['unfinished']
