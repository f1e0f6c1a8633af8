"""Strategy interfaces and Megatron's registry of default strategies.

`default_strategies[action.value][(backend, version)]` holds the strategy a `save` / `load` uses
when given a `(backend, version)` tuple. The torch_dist strategies are registered by
`defaults.py` when it is imported, which the `strategies` package does before anything here can
be used (importing the concrete strategies from this module would be a cycle).
"""

from abc import ABC, abstractmethod
from collections import defaultdict
from dataclasses import dataclass
from enum import Enum
from typing import Any, DefaultDict, Dict, List, Optional, Tuple

from megatron.core.dist_checkpointing.mapping import CheckpointingException, ShardedStateDict
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue


class StrategyAction(Enum):
    """Which registry a default strategy lives in: save or load, sharded tensors or common."""

    LOAD_COMMON = 'load_common'
    LOAD_SHARDED = 'load_sharded'
    SAVE_COMMON = 'save_common'
    SAVE_SHARDED = 'save_sharded'


default_strategies: DefaultDict[str, Dict[Tuple[str, int], Any]] = defaultdict(dict)

# The process-wide queue of pending asynchronous saves (Megatron keeps one here too).
async_calls = AsyncCallsQueue()


def register_default_strategy(action: StrategyAction, backend: str, version: int, strategy) -> None:
    """Make `strategy` the default for `action` on checkpoints of `(backend, version)`."""
    default_strategies[action.value][(backend, version)] = strategy


def get_default_strategy(action: StrategyAction, backend: str, version: int):
    """The registered strategy for `action` on `(backend, version)`.

    Raises:
        CheckpointingException: nothing is registered for that triple (only torch_dist version 1
            is implemented; zarr is deprecated in Megatron and absent here).
    """
    try:
        return default_strategies[action.value][(backend, version)]
    except KeyError:
        raise CheckpointingException(
            f'no default strategy for {(action.value, backend, version)} (only torch_dist '
            f'version 1 is implemented; zarr is deprecated in Megatron and absent here)'
        ) from None


class LoadStrategyBase(ABC):
    """A load strategy: it says whether it can read a checkpoint's backend and version."""

    def check_backend_compatibility(self, loaded_backend):
        """Raise if checkpoints written with `loaded_backend` cannot be read (all can here)."""

    def check_version_compatibility(self, loaded_version):
        """Raise if checkpoints of `loaded_version` cannot be read (all can here)."""

    @property
    def can_handle_sharded_objects(self) -> bool:
        return False


class SaveStrategyBase(ABC):
    """A save strategy writes one backend's format at one version."""

    def __init__(self, backend: str, version: int):
        self.backend = backend
        self.version = version

    @property
    def can_handle_sharded_objects(self) -> bool:
        return False

    def __str__(self):
        return f'{type(self).__name__}({self.backend}, {self.version})'


class LoadCommonStrategy(LoadStrategyBase):
    """Reads the common (unsharded) part of a checkpoint."""

    @abstractmethod
    def load_common(self, checkpoint_dir: str):
        """The common state dict stored in `checkpoint_dir`."""

    @abstractmethod
    def load_sharded_objects(self, sharded_objects_state_dict: ShardedStateDict, checkpoint_dir):
        """Fill the ShardedObjects of `sharded_objects_state_dict` from `checkpoint_dir`."""

    def load_sharded_metadata(self, checkpoint_dir: str) -> ShardedStateDict:
        if not self.can_handle_sharded_objects:
            return {}
        raise NotImplementedError(f'{type(self).__name__} cannot list sharded objects')


class SaveCommonStrategy(SaveStrategyBase):
    """Writes the common (unsharded) part of a checkpoint."""

    @abstractmethod
    def save_common(self, common_state_dict, checkpoint_dir: str):
        """Write `common_state_dict` (rank 0's copy) into `checkpoint_dir`."""

    def save_sharded_objects(self, sharded_objects_state_dict: ShardedStateDict, checkpoint_dir):
        raise NotImplementedError(f'{type(self).__name__} cannot write sharded objects')


class SaveShardedStrategy(SaveStrategyBase):
    """Writes the sharded part of a state dict into a checkpoint directory."""

    @abstractmethod
    def save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: str) -> None:
        """Collective: write every main replica of `sharded_state_dict`."""

    @property
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


class LoadShardedStrategy(LoadStrategyBase):
    """Reads the sharded part of a state dict from a checkpoint directory."""

    @abstractmethod
    def load(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: str) -> ShardedStateDict:
        """Fill every ShardedTensor / ShardedObject of `sharded_state_dict`; return it loaded."""

    @abstractmethod
    def load_tensors_metadata(self, checkpoint_dir: str) -> ShardedStateDict:
        """{key: ShardedTensor without data} describing every stored global tensor."""

    def load_sharded_metadata(self, checkpoint_dir: str) -> ShardedStateDict:
        """Metadata of every stored tensor (and object, where the strategy can list them)."""
        if not self.can_handle_sharded_objects:
            return self.load_tensors_metadata(checkpoint_dir)
        raise NotImplementedError(f'{type(self).__name__} cannot list sharded objects')

    def remove_sharded_tensors(self, checkpoint_dir: str, key_prefix: str):
        raise NotImplementedError(f'{type(self).__name__} cannot remove tensors')
