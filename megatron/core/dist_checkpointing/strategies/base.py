"""Strategy interfaces (the default strategies per backend are in `defaults.py`)."""

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import List, Optional

from megatron.core.dist_checkpointing.mapping import ShardedStateDict


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


@dataclass
class SavePreflight:
    """Checks of a save that a strategy with `save_request` runs inside its planning exchange
    (instead of a collective each).

    Args:
        sharding: this rank's `validation.local_sharding_records` (before any fully parallel
            redistribution), or None to skip the sharding-integrity check.
        problem: rank 0's own finding (e.g. the target directory is not empty), or None.
    """

    sharding: Optional[List] = None
    problem: Optional[str] = None


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
