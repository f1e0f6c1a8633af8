"""Moving the tracker file (`latest_checkpointed_iteration.txt`) forward, crash-safely.

The tracker names the latest complete checkpoint of a save directory; it is written last, after
every rank's files are on disk, to a temporary name that is flushed and renamed into place, so a
reader sees the previous iteration or the new one. Reading it is in checkpoint_layout.py
(`read_metadata`, `_parse_tracker`). Both checkpoint formats (checkpointing.py, torch;
checkpointing_dist.py, torch_dist) write it through this module.
"""

import os

from megatron.training.checkpoint.checkpoint_layout import (
    _parse_tracker,
    get_checkpoint_tracker_filename,
)


def fsync_path(path: str) -> None:
    """Flush a file (or a directory entry) to disk."""
    flags = os.O_RDONLY
    if os.path.isdir(path):
        flags |= getattr(os, 'O_DIRECTORY', 0)
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_tracker_atomically(checkpoints_path: str, iteration: int) -> None:
    """Name `iteration` in the tracker of `checkpoints_path` (temp file, fsync, rename)."""
    tracker_filename = get_checkpoint_tracker_filename(checkpoints_path)
    tmp = f'{tracker_filename}.tmp.{os.getpid()}'
    with open(tmp, 'w') as f:
        f.write(str(iteration))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, tracker_filename)
    fsync_path(checkpoints_path)


def check_tracker_moves_forward(checkpoints_path: str, iteration: int) -> None:
    """Refuse a save that would move the tracker below the checkpoint it already names."""
    tracker_filename = get_checkpoint_tracker_filename(checkpoints_path)
    if not os.path.isfile(tracker_filename):
        return
    latest, release = _parse_tracker(tracker_filename)
    if not release and latest > iteration:
        raise ValueError(
            f'{tracker_filename} names iteration {latest}; saving iteration {iteration} would move '
            f'it backwards (and replace newer checkpoints): save into another directory'
        )


# Names this module had in checkpointing.py.
_fsync_path = fsync_path
_write_tracker_atomically = write_tracker_atomically
_check_tracker_moves_forward = check_tracker_moves_forward
