"""`apply_factories` / `apply_factory_merges` live in dist_checkpointing.mapping (where Megatron's
test_mapping.py imports them from): a factory is replaced by the sub-dict it builds and merged
back into one tensor after load."""

import torch

from megatron.core.dist_checkpointing import serialization
from megatron.core.dist_checkpointing.mapping import (
    ShardedTensor,
    ShardedTensorFactory,
    apply_factories,
    apply_factory_merges,
)


def _halves(key, data, replica_id, flattened_range):
    first, second = data.chunk(2)
    return {
        'a': ShardedTensor.from_rank_offsets(f'{key}.a', first, replica_id=replica_id),
        'b': ShardedTensor.from_rank_offsets(f'{key}.b', second, replica_id=replica_id),
    }


def test_factories_build_and_merge_back():
    data = torch.arange(6.0)
    state = {
        'w': ShardedTensorFactory('w', data, _halves, lambda sub: torch.cat([sub['a'], sub['b']]))
    }
    apply_factories(state)
    assert sorted(state['w']) == ['a', 'b']
    assert state['w']['a'].key == 'w.a' and torch.equal(state['w']['b'].data, data[3:])
    loaded = {'w': state['w']}
    for name in ('a', 'b'):
        loaded['w'][name] = loaded['w'][name].data.clone()
    merged = apply_factory_merges(loaded)
    assert torch.equal(merged['w'], data)
    assert serialization.apply_factories is apply_factories
    assert serialization.apply_factory_merges is apply_factory_merges
