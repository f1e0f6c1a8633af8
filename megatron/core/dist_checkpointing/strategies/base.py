"""Strategy interfaces and the registry of default strategies per (backend, version)."""

from abc import ABC, abstractmethod
from typing import Dict, Tuple

from megatron.core.dist_checkpointing.mapping import CheckpointingException, ShardedStateDict


class SaveShardedStrategy(ABC):
    """Writes the sharded part of a state dict into a checkpoint directory."""

    def __init__(self, backend: str, version: int):
        self.backend = backend
        self.version = version

    @abstractmethod
    def save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: str) -> None:
        """Collective: write every main replica of `sharded_state_dict`."""

    def can_handle_sharded_objects(self) -> bool:
        return True


class AsyncSaveShardedStrategy(SaveShardedStrategy):
    """A save strategy that can return the writing as an AsyncRequest."""

    @abstractmethod
    def async_save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: str):
        """Collective planning now; returns an AsyncRequest whose function writes the files."""

    def save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: str) -> None:
        request = self.async_save(sharded_state_dict, checkpoint_dir)
        request.execute_sync()


class LoadShardedStrategy(ABC):
    """Reads the sharded part of a state dict from a checkpoint directory."""

    @abstractmethod
    def load(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: str) -> ShardedStateDict:
        """Fill every ShardedTensor / ShardedObject of `sharded_state_dict`; return it loaded."""

    @abstractmethod
    def load_tensors_metadata(self, checkpoint_dir: str) -> ShardedStateDict:
        """{key: ShardedTensor without data} describing every stored global tensor."""

    def check_backend_compatibility(self, loaded_version):
        pass

    def check_version_compatibility(self, loaded_version):
        pass


_DEFAULT_SAVE: Dict[Tuple[str, int], SaveShardedStrategy] = {}
_DEFAULT_LOAD: Dict[Tuple[str, int], LoadShardedStrategy] = {}


def get_default_save_sharded_strategy(
    backend: str = 'torch_dist', version: int = 1
) -> SaveShardedStrategy:
    """The default save strategy of a backend (Megatron's registry, torch_dist only here)."""
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

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
    from megatron.core.dist_checkpointing.core import maybe_load_config
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy

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
