"""The default strategy per (backend, version): Megatron's `get_default_*_sharded_strategy`.

Kept apart from `base.py` (the interfaces the strategies implement) so that the concrete torch_dist
strategy can import its base classes without a cycle.
"""

from typing import Dict, Tuple

from megatron.core.dist_checkpointing.core import maybe_load_config
from megatron.core.dist_checkpointing.mapping import CheckpointingException
from megatron.core.dist_checkpointing.strategies.base import (
    LoadShardedStrategy,
    SaveShardedStrategy,
)
from megatron.core.dist_checkpointing.strategies.torch import (
    TorchDistLoadShardedStrategy,
    TorchDistSaveShardedStrategy,
)

_DEFAULT_SAVE: Dict[Tuple[str, int], SaveShardedStrategy] = {}
_DEFAULT_LOAD: Dict[Tuple[str, int], LoadShardedStrategy] = {}


def get_default_save_sharded_strategy(
    backend: str = 'torch_dist', version: int = 1
) -> SaveShardedStrategy:
    """The default save strategy of a backend (Megatron's registry, torch_dist only here)."""
    if backend != 'torch_dist':
        raise CheckpointingException(
            f'distributed checkpoint format {backend!r} is not supported (only torch_dist; '
            f'zarr is deprecated in Megatron and not implemented here)'
        )
    key = (backend, version)
    if key not in _DEFAULT_SAVE:
        _DEFAULT_SAVE[key] = TorchDistSaveShardedStrategy(backend, version)
    return _DEFAULT_SAVE[key]


def get_default_load_sharded_strategy(checkpoint_dir: str) -> LoadShardedStrategy:
    """The load strategy for the backend named in the checkpoint's metadata.json."""
    config = maybe_load_config(checkpoint_dir)
    if config is None:
        raise CheckpointingException(f'{checkpoint_dir} is not a distributed checkpoint')
    if config.sharded_backend != 'torch_dist':
        raise CheckpointingException(
            f'{checkpoint_dir} was written with the {config.sharded_backend!r} backend; only '
            f'torch_dist checkpoints can be read here'
        )
    key = (config.sharded_backend, config.sharded_backend_version)
    if key not in _DEFAULT_LOAD:
        _DEFAULT_LOAD[key] = TorchDistLoadShardedStrategy()
    return _DEFAULT_LOAD[key]
