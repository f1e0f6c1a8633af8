"""Megatron r0.8's strategy registry (`strategies.base`) and dict_utils names, as a library user
calls them: `get_default_strategy(StrategyAction.SAVE_SHARDED, 'torch_dist', 1)`, a patched
`serialization.get_default_save_sharded_strategy`, a `(backend, version)` tuple given to `save`,
and `diff` over two loaded checkpoints.
"""

import os
from unittest import mock

import pytest
import torch

from tests.unit_tests.dist_utils import run_distributed


def test_registry_returns_the_torch_dist_strategies():
    from megatron.core.dist_checkpointing.mapping import CheckpointingException
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.base import (
        LoadShardedStrategy,
        SaveShardedStrategy,
        StrategyAction,
        default_strategies,
        get_default_strategy,
        register_default_strategy,
    )

    save = get_default_strategy(StrategyAction.SAVE_SHARDED, 'torch_dist', 1)
    assert isinstance(save, SaveShardedStrategy) and (save.backend, save.version) == (
        'torch_dist',
        1,
    )
    assert save is get_default_save_sharded_strategy()
    assert save.can_handle_sharded_objects  # a property, as in Megatron
    assert str(save) == 'TorchDistSaveShardedStrategy(torch_dist, 1)'
    load = get_default_strategy(StrategyAction.LOAD_SHARDED, 'torch_dist', 1)
    assert isinstance(load, LoadShardedStrategy)
    with pytest.raises(CheckpointingException, match='zarr'):
        get_default_strategy(StrategyAction.SAVE_SHARDED, 'zarr', 1)

    class Marker:
        pass

    previous = default_strategies['save_sharded'][('torch_dist', 1)]
    register_default_strategy(StrategyAction.SAVE_SHARDED, 'torch_dist', 1, Marker)
    try:
        assert get_default_strategy(StrategyAction.SAVE_SHARDED, 'torch_dist', 1) is Marker
    finally:
        register_default_strategy(StrategyAction.SAVE_SHARDED, 'torch_dist', 1, previous)


def _save_patched_then_tuple(root):
    """Save once through a patched default (as Megatron's conftest does) and once with a tuple."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor
    from megatron.core.dist_checkpointing.dict_utils import diff
    from megatron.core.dist_checkpointing.strategies.base import (
        StrategyAction,
        get_default_strategy,
    )

    rank = torch.distributed.get_rank()
    calls = []

    def patched():
        calls.append(1)
        return get_default_strategy(StrategyAction.SAVE_SHARDED, 'torch_dist', 1)

    def state(scale):
        rows = torch.arange(8.0).view(2, 4)[rank : rank + 1] * scale
        return {
            'w': ShardedTensor.from_rank_offsets('w', rows.clone(), (0, rank, 2)),
            'o': ShardedObject('obj', {'rank': rank}, (2,), (rank,)),
            'it': 3,
        }

    dirs = [os.path.join(root, name) for name in ('a', 'b', 'c')]
    if rank == 0:
        for d in dirs:
            os.makedirs(d)
    torch.distributed.barrier()
    target = 'megatron.core.dist_checkpointing.serialization.get_default_save_sharded_strategy'
    with mock.patch(target, new=patched):
        dist_checkpointing.save(state(1.0), dirs[0])
    dist_checkpointing.save(state(1.0), dirs[1], ('torch_dist', 1))
    dist_checkpointing.save(state(2.0), dirs[2])
    plain = [dist_checkpointing.load_plain_tensors(d) for d in dirs]
    metadata = dist_checkpointing.load_sharded_metadata(dirs[0])
    objects = sorted((k, v.key, v.global_offset, v.data) for k, v in metadata.items() if k != 'w')
    return (
        len(calls),
        diff(plain[0], plain[1]),
        diff(plain[0], plain[2]),
        tuple(metadata['w'].global_shape),
        objects,
    )


def test_patched_default_and_tuple_strategy_are_used(tmp_path):
    calls, same, different, shape, objects = run_distributed(
        _save_patched_then_tuple, world_size=2, args=(str(tmp_path),)
    )[0]
    assert calls == 1
    # load_sharded_metadata lists the object shards too, by unique key, without data.
    assert objects == [
        ('obj/shard_0_2', 'obj', (0,), None),
        ('obj/shard_1_2', 'obj', (1,), None),
    ]
    assert same == ([], [], [])
    assert different == ([], [], [(('w',), torch.Tensor, torch.Tensor)])
    assert shape == (2, 4)


def test_dict_utils_diff_map_reduce_outplace():
    from megatron.core.dist_checkpointing.dict_utils import (
        dict_list_map_outplace,
        diff,
        map_reduce,
    )

    a = {'t': torch.ones(2), 'l': [1, 2, 3], 'x': 'same', 'only_a': 0}
    b = {'t': torch.ones(3), 'l': [1, 5], 'x': 'same', 'only_b': 0}
    only_left, only_right, mismatch = diff(a, b)
    assert only_left == [('only_a',), ('l', 2)]
    assert only_right == [('only_b',)]
    assert sorted(mismatch, key=str) == sorted(
        [(('t',), torch.Tensor, torch.Tensor), (('l', 1), int, int)], key=str
    )
    assert diff(a, a) == ([], [], [])

    nested = {'a': [1, {'b': 2}]}
    doubled = dict_list_map_outplace(lambda v: 2 * v, nested)
    assert doubled == {'a': [2, {'b': 4}]} and nested == {'a': [1, {'b': 2}]}

    grouped = map_reduce(['ab', 'ac', 'b'], key_fn=lambda s: s[0], value_fn=len, reduce_fn=sum)
    assert grouped == {'a': 4, 'b': 1}


def test_state_dict_splitters():
    from megatron.core.dist_checkpointing import (
        LocalNonpersistentObject,
        ShardedObject,
        ShardedTensor,
    )
    from megatron.core.dist_checkpointing.utils import (
        extract_nonpersistent,
        extract_sharded_base,
        extract_sharded_tensors,
        extract_sharded_tensors_or_nonpersistent,
    )

    ten = ShardedTensor.from_rank_offsets('t', torch.zeros(2))
    obj = ShardedObject('o', 1, (1,), (0,))
    local = LocalNonpersistentObject(5)
    sd = {'a': {'t': ten, 'o': obj}, 'n': local, 'c': 7}
    tensors, rest = extract_sharded_tensors(sd)
    assert tensors == {'a': {'t': ten}} and rest == {'a': {'o': obj}, 'n': local, 'c': 7}
    base, rest = extract_sharded_base(sd)
    assert base == {'a': {'t': ten, 'o': obj}} and rest == {'n': local, 'c': 7}
    nonpersistent, rest = extract_nonpersistent(sd)
    assert nonpersistent == {'n': local} and 'n' not in rest
    either, rest = extract_sharded_tensors_or_nonpersistent(sd)
    assert either == {'a': {'t': ten}, 'n': local} and rest == {'a': {'o': obj}, 'c': 7}
