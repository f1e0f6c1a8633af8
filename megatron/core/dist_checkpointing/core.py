"""`metadata.json`: the marker and backend description of a distributed checkpoint directory.

A directory is a distributed checkpoint iff it holds `metadata.json`. It is written last, so a
directory a save did not finish is never taken for a checkpoint. Its bytes are Megatron's:
`{"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch",
"common_backend_version": 1}`.
"""

import json
import os
from dataclasses import asdict, dataclass
from typing import Optional

from megatron.core.dist_checkpointing.mapping import CheckpointingException

CONFIG_FNAME = 'metadata.json'


@dataclass
class CheckpointingConfig:
    """Backends a checkpoint was written with (they pick the load strategies)."""

    sharded_backend: str
    sharded_backend_version: int = 1
    common_backend: str = 'torch'
    common_backend_version: int = 1


def check_is_distributed_checkpoint(checkpoint_dir: str) -> bool:
    """Whether `checkpoint_dir` is a complete distributed checkpoint (holds metadata.json)."""
    return os.path.isfile(os.path.join(checkpoint_dir, CONFIG_FNAME))


def maybe_load_config(checkpoint_dir: str) -> Optional[CheckpointingConfig]:
    """The CheckpointingConfig of `checkpoint_dir`, or None if it is not a dist checkpoint."""
    path = os.path.join(checkpoint_dir, CONFIG_FNAME)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            raw = json.load(f)
        return CheckpointingConfig(**raw)
    except (ValueError, TypeError) as exc:
        raise CheckpointingException(f'{path} is not a valid checkpoint metadata file: {exc}')


def save_config(config: CheckpointingConfig, checkpoint_dir: str) -> None:
    """Write metadata.json (temporary name, flush, rename: readers never see a partial file)."""
    path = os.path.join(checkpoint_dir, CONFIG_FNAME)
    tmp = path + '.tmp'
    with open(tmp, 'w') as f:
        json.dump(asdict(config), f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
