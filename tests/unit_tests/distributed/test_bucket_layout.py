"""ParamAndGradBuffer's bucketing and grad sync as Megatron r0.8's: buckets close at >= bucket_size
elements in reverse parameter order, with the distributed optimizer parameters start 64-aligned,
bucket ends are padded to lcm(DP, 128) and a shared embedding weight has a bucket of its own;
finish_grad_sync forces the collective through on every call without overlap and, with overlap,
raises (an AssertionError too) until every gradient is ready. Layouts below are worked out by
hand (DP = 2), by default for three parameters of 100, 30 and 50 elements."""

import pytest
import torch

from tests.unit_tests.dist_utils import run_distributed


def _buffer(use_distributed_optimizer, bucket_size, shared, overlap=False, sizes=(100, 30, 50)):
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.distributed.param_and_grad_buffer import ParamAndGradBuffer

    params = [torch.nn.Parameter(torch.ones(n)) for n in sizes]  # forward order
    for index in shared:
        params[index].shared_embedding = True
    config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        use_distributed_optimizer=use_distributed_optimizer,
        overlap_grad_reduce=overlap,
    )
    buffer = ParamAndGradBuffer(
        config,
        param_dtype=torch.float32,
        grad_dtype=torch.float32,
        params=params,
        data_parallel_group=parallel_state.get_data_parallel_group(),
        bucket_size=bucket_size,
        param_to_name={p: f'p{i}' for i, p in enumerate(params)},
        gradient_scaling_factor=1.0,
    )
    return params, buffer


def _layout(use_distributed_optimizer, bucket_size, shared, sizes=(100, 30, 50)):
    params, buffer = _buffer(use_distributed_optimizer, bucket_size, shared, sizes=sizes)
    ids = [id(p) for p in params]
    return {
        'unpadded': [b.numel_unpadded for b in buffer.buckets],
        'padded': [b.grad_data.numel() for b in buffer.buckets],
        'starts': [buffer.param_index_map[p][:2] for p in params],
        'members': [[ids.index(id(p)) for p in b.params_list] for b in buffer.buckets],
    }


CASES = [
    # (distributed optimizer, bucket_size, shared embedding params) -> expected layout
    ((False, 60, ()), [80, 100], [80, 100], [(80, 180), (50, 80), (0, 50)], [[2, 1], [0]]),
    ((True, 60, ()), [94, 100], [128, 128], [(128, 228), (64, 94), (0, 50)], [[2, 1], [0]]),
    # The shared weight p0 starts its own bucket at 256 (Megatron r0.8 leaves it at its 64-aligned
    # start 192, inside bucket 1's padding: the one deliberate difference).
    (
        (True, None, (0, 2)),
        [50, 64, 100],
        [128, 128, 128],
        [(256, 356), (128, 158), (0, 50)],
        [[2], [1], [0]],
    ),
    # Its start already aligned: exactly Megatron r0.8's layout.
    (
        (True, None, (0,), (100, 64, 64)),
        [128, 100],
        [128, 128],
        [(128, 228), (64, 128), (0, 64)],
        [[2, 1], [0]],
    ),
    ((False, None, (0, 2)), [180], [180], [(80, 180), (50, 80), (0, 50)], [[2, 1, 0]]),
    (
        (True, 20, ()),
        [50, 30, 100],
        [128, 128, 128],
        [(256, 356), (128, 158), (0, 50)],
        [[2], [1], [0]],
    ),
]


def _layouts():
    return [_layout(*case[0]) for case in CASES]


def test_bucket_layout_matches_megatron_rule():
    layouts = run_distributed(_layouts, world_size=2)[0]  # one job for every case
    for (args, unpadded, padded, starts, members), layout in zip(CASES, layouts):
        assert layout['unpadded'] == unpadded, args
        assert layout['padded'] == padded, args
        assert layout['starts'] == starts, args
        assert layout['members'] == members, args


def _grad_sync(use_distributed_optimizer, overlap):
    params, buffer = _buffer(use_distributed_optimizer, None, (), overlap=overlap)
    rank = torch.distributed.get_rank()
    events = []
    buffer.grad_data.fill_(1.0 + rank)
    if not overlap:
        with pytest.raises(AssertionError):
            buffer.register_grad_ready(params[0])
        for _ in range(2):  # every call forces the collective through
            buffer.finish_grad_sync()
            events.append(float(buffer.grad_data[0]))
            buffer.grad_data.fill_(1.0 + rank)
        return events
    for i, param in enumerate(params[::-1]):
        buffer.register_grad_ready(param)
        if i < len(params) - 1:
            try:
                buffer.finish_grad_sync()
            except AssertionError as exc:
                events.append((type(exc).__name__, isinstance(exc, RuntimeError)))
    buffer.finish_grad_sync()
    events.append(float(buffer.grad_data[0]))
    return events


SYNC_CASES = [(False, False), (False, True), (True, False), (True, True)]


def _grad_syncs():
    return [_grad_sync(*case) for case in SYNC_CASES]


def test_grad_sync_finishes_where_megatron_does():
    outs = run_distributed(_grad_syncs, world_size=2)
    for rank, per_case in enumerate(outs):
        for (use_distributed_optimizer, overlap), events in zip(SYNC_CASES, per_case):
            # Element 0 lies in rank 0's shard: reduced there (1 + 2), untouched elsewhere under
            # the distributed optimizer (a reduce-scatter), all-reduced everywhere otherwise.
            reduced = 3.0 if (rank == 0 or not use_distributed_optimizer) else 1.0 + rank
            if overlap:
                assert events[:2] == [('GradSyncNotIssuedError', True)] * 2
                assert events[2] == reduced
            else:
                assert events == [reduced, reduced]
