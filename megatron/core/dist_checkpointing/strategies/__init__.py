"""Save and load strategies of distributed checkpoints (torch_dist on PyTorch DCP)."""

from megatron.core.dist_checkpointing.strategies.base import (  # noqa: F401
    AsyncSaveShardedStrategy,
    LoadShardedStrategy,
    SaveShardedStrategy,
)
from megatron.core.dist_checkpointing.strategies.defaults import (  # noqa: F401
    get_default_load_sharded_strategy,
    get_default_save_sharded_strategy,
)
