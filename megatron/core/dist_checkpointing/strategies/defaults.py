"""The default strategy per (backend, version): Megatron's `get_default_*_sharded_strategy`.

Kept apart from `base.py` (the interfaces the strategies implement) so that the concrete torch_dist
strategy can import its base classes without a cycle.
"""

from megatron.core.dist_checkpointing.core import maybe_load_config
from megatron.core.dist_checkpointing.mapping import CheckpointingException
from megatron.core.dist_checkpointing.strategies.base import (
    LoadShardedStrategy,
    SaveShardedStrategy,
    StrategyAction,
    default_strategies,
    get_default_strategy,
    register_default_strategy,
)
from megatron.core.dist_checkpointing.strategies.torch import (
    TorchDistLoadShardedStrategy,
    TorchDistSaveShardedStrategy,
)


def register_default_torch_strategies() -> None:
    """Register the torch_dist (version 1) save and load strategies, once per process."""
    key = ('torch_dist', 1)
    if key not in default_strategies[StrategyAction.SAVE_SHARDED.value]:
        register_default_strategy(
            StrategyAction.SAVE_SHARDED, *key, TorchDistSaveShardedStrategy(*key)
        )
    if key not in default_strategies[StrategyAction.LOAD_SHARDED.value]:
        register_default_strategy(StrategyAction.LOAD_SHARDED, *key, TorchDistLoadShardedStrategy())


register_default_torch_strategies()


def get_default_save_sharded_strategy(
    backend: str = 'torch_dist', version: int = 1
) -> SaveShardedStrategy:
    """The default save strategy of a backend (Megatron's registry, torch_dist only here)."""
    if backend != 'torch_dist':
        raise CheckpointingException(
            f'distributed checkpoint format {backend!r} is not supported (only torch_dist; '
            f'zarr is deprecated in Megatron and not implemented here)'
        )
    return get_default_strategy(StrategyAction.SAVE_SHARDED, backend, version)


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
    return get_default_strategy(
        StrategyAction.LOAD_SHARDED, config.sharded_backend, config.sharded_backend_version
    )
