"""Distributed checkpoints (Megatron's `dist_checkpointing`, torch_dist backend on PyTorch DCP).

Every rank describes its part of the model and optimizer state as a *sharded state dict*
(mapping.py): tensors carry their global name, global shape and offset, so a checkpoint written
at one parallel layout (TP, PP, VP, DP, distributed optimizer or not) is read at any other with
no conversion step. `save` / `load` (serialization.py) write and read Megatron's layout:
`common.pt` + PyTorch DCP files + `metadata.json`. See docs/dist_checkpointing.md.
"""

from megatron.core.dist_checkpointing.core import check_is_distributed_checkpoint  # noqa: F401
from megatron.core.dist_checkpointing.mapping import (  # noqa: F401
    CheckpointingException,
    LocalNonpersistentObject,
    LocalNonpersitentObject,
    ShardedObject,
    ShardedStateDict,
    ShardedTensor,
    ShardedTensorFactory,
)
from megatron.core.dist_checkpointing.serialization import (  # noqa: F401
    load,
    load_common_state_dict,
    load_plain_tensors,
    load_sharded_metadata,
    load_tensors_metadata,
    save,
)
