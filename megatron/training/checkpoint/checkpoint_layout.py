"""Names in a checkpoint directory (Megatron's "torch" layout) and the tracker file.

`get_checkpoint_name` gives a rank's `iter_XXXXXXX/mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt`,
`get_checkpoint_tracker_filename` the `latest_checkpointed_iteration.txt` that names the latest
complete checkpoint, and `read_metadata` reads it. The layout and the crash-safe writes are
described in checkpointing.py, which re-exports every name defined here.
"""

import os
import re
import shutil
from typing import Optional, Tuple

import torch

from megatron.core import parallel_state as mpu
from megatron.core.utils import get_current_device

TRACKER_FILENAME = 'latest_checkpointed_iteration.txt'
MODEL_CHECKPOINT_BASENAME = 'model_optim_rng.pt'
DISTRIB_OPTIM_BASENAME = 'distrib_optim.pt'


def ensure_directory_exists(filename: str, check_parent: bool = True) -> None:
    """Create the directory of `filename` (or `filename` itself if check_parent is False)."""
    dirname = os.path.dirname(filename) if check_parent else filename
    os.makedirs(dirname, exist_ok=True)


def get_checkpoint_name(
    checkpoints_path: str,
    iteration: int,
    release: bool = False,
    pipeline_parallel: Optional[bool] = None,
    tensor_rank: Optional[int] = None,
    pipeline_rank: Optional[int] = None,
    expert_parallel: Optional[bool] = None,
    expert_rank: Optional[int] = None,
    return_base_dir: bool = False,
) -> str:
    """Path of this rank's `model_optim_rng.pt` (or of the iteration directory).

    Args:
        checkpoints_path: the `--save` / `--load` directory.
        iteration: training iteration; ignored for release checkpoints.
        release: use the `release/` directory instead of `iter_XXXXXXX/`.
        pipeline_parallel, tensor_rank, pipeline_rank, expert_parallel, expert_rank: override the
            values taken from parallel_state (tools that read checkpoints without a process group).
        return_base_dir: return `<checkpoints_path>/iter_XXXXXXX` only.
    """
    directory = 'release' if release else 'iter_{:07d}'.format(iteration)
    if return_base_dir:
        return os.path.join(checkpoints_path, directory)
    if pipeline_parallel is None:
        pipeline_parallel = mpu.get_pipeline_model_parallel_world_size() > 1
    if tensor_rank is None:
        tensor_rank = mpu.get_tensor_model_parallel_rank()
    if pipeline_rank is None:
        pipeline_rank = mpu.get_pipeline_model_parallel_rank()
    if expert_parallel is None:
        expert_parallel = mpu.get_expert_model_parallel_world_size() > 1
    if expert_rank is None:
        expert_rank = mpu.get_expert_model_parallel_rank()

    if not pipeline_parallel:
        common_path = os.path.join(checkpoints_path, directory, f'mp_rank_{tensor_rank:02d}')
    else:
        common_path = os.path.join(
            checkpoints_path, directory, f'mp_rank_{tensor_rank:02d}_{pipeline_rank:03d}'
        )
    if expert_parallel:
        common_path = common_path + f'_{expert_rank:03d}'
    return os.path.join(common_path, MODEL_CHECKPOINT_BASENAME)


def get_distributed_optimizer_checkpoint_name(model_checkpoint_name: str) -> str:
    """`distrib_optim.pt` next to a rank's `model_optim_rng.pt`."""
    return os.path.join(os.path.dirname(model_checkpoint_name), DISTRIB_OPTIM_BASENAME)


def find_checkpoint_rank_0(
    checkpoints_path: str, iteration: int, release: bool = False
) -> Optional[str]:
    """The rank-0 checkpoint file of an iteration whatever its pipeline / expert layout, or None."""
    for pipeline_parallel in (False, True):
        for expert_parallel in (False, True):
            filename = get_checkpoint_name(
                checkpoints_path,
                iteration,
                release,
                pipeline_parallel=pipeline_parallel,
                tensor_rank=0,
                pipeline_rank=0,
                expert_parallel=expert_parallel,
                expert_rank=0,
            )
            if os.path.isfile(filename):
                return filename
    return None


def get_checkpoint_tracker_filename(checkpoints_path: str) -> str:
    """The tracker file naming the latest complete checkpoint of `checkpoints_path`."""
    return os.path.join(checkpoints_path, TRACKER_FILENAME)


def checkpoint_exists(checkpoints_path: Optional[str]) -> bool:
    """Whether `checkpoints_path` holds a tracker file (a completed save)."""
    if checkpoints_path is None:
        return False
    return os.path.exists(get_checkpoint_tracker_filename(checkpoints_path))


def _parse_tracker(tracker_filename: str) -> Tuple[int, bool]:
    """(iteration, release) from the tracker file's text, without collectives."""
    with open(tracker_filename, 'r') as f:
        metastring = f.read().strip()
    try:
        iteration = int(metastring)
    except ValueError:
        if metastring == 'release':
            return 0, True
        raise ValueError(
            f'invalid metadata file {tracker_filename}: expected an iteration number or '
            f'"release", found {metastring!r}'
        )
    if iteration < 0:
        raise ValueError(
            f'invalid metadata file {tracker_filename}: iteration {iteration} is negative'
        )
    return iteration, False


def read_metadata(tracker_filename: str) -> Tuple[int, bool]:
    """Read the tracker file: (iteration, release).

    With torch.distributed initialized, the iteration is the MAX over all ranks (a collective), so
    ranks that saw different tracker contents on a lagging file system agree.

    Raises:
        ValueError: if the file holds neither an integer nor the word "release".
    """
    iteration, release = _parse_tracker(tracker_filename)
    if torch.distributed.is_initialized():
        iters = torch.tensor([iteration], dtype=torch.long, device=get_current_device())
        torch.distributed.all_reduce(iters, op=torch.distributed.ReduceOp.MAX)
        max_iter = int(iters[0].item())
        if iteration != max_iter:
            rank = torch.distributed.get_rank()
            print(
                f'WARNING: on rank {rank} found iteration {iteration} in the metadata while max '
                f'iteration across the ranks is {max_iter}, replacing it with max iteration.',
                flush=True,
            )
        iteration = max_iter
    return iteration, release


# ---------------------------------------------------------------------------------------------
# one layout per iteration directory, and replacing a checkpoint as a whole

_RANK_DIR_RE = re.compile(r'^mp_rank_\d{2}((?:_\d{3}){0,2})$')


def check_single_layout(iteration_dir: str, checkpoint_args=None) -> None:
    """Refuse an iteration directory holding the rank folders of more than one parallel layout
    (another layout written over it in place), which a loader would read as the old model.

    Folders differ in layout when they carry a different number of rank fields
    (`mp_rank_TT`, `mp_rank_TT_PPP`, `mp_rank_TT_PPP_EEE`), or when there are more of them than
    the layout recorded in `checkpoint_args` has ranks. A directory without rank folders (a
    distributed checkpoint) is left alone.

    Raises:
        ValueError: one line naming the directory, its folders and the recorded layout.
    """
    if not os.path.isdir(iteration_dir):
        return
    folders = sorted(n for n in os.listdir(iteration_dir) if _RANK_DIR_RE.match(n))
    if not folders:
        return
    kinds = {_RANK_DIR_RE.match(n).group(1).count('_') for n in folders}
    expected = None
    if checkpoint_args is not None:
        sizes = [
            getattr(checkpoint_args, name, None) or 1
            for name in (
                'tensor_model_parallel_size',
                'pipeline_model_parallel_size',
                'expert_model_parallel_size',
            )
        ]
        expected = sizes[0] * sizes[1] * sizes[2]
    if len(kinds) == 1 and (expected is None or len(folders) <= expected):
        return
    recorded = ''
    if expected is not None:
        recorded = (
            f'; its args record TP{sizes[0]} x PP{sizes[1]}'
            + (f' x EP{sizes[2]}' if sizes[2] > 1 else '')
            + f' ({expected} rank folders)'
        )
    shown = ', '.join(folders[:8]) + (f', ... ({len(folders)} in all)' if len(folders) > 8 else '')
    raise ValueError(
        f'checkpoint directory {iteration_dir} holds rank folders of more than one parallel '
        f'layout ({shown}){recorded}: another layout was written over it in place, so its '
        f'files mix two models; write the checkpoint again into an empty directory'
    )


def staging_root(save_dir: str) -> str:
    """A private directory inside `save_dir` where a whole checkpoint is written before it
    replaces the current one (same file system, so the switch is a rename)."""
    return os.path.join(save_dir, f'.staging.{os.getpid()}')


def remove_stale_staging(save_dir: str) -> None:
    """Remove the staging directories that killed writers left behind in `save_dir`."""
    if not os.path.isdir(save_dir):
        return
    for name in os.listdir(save_dir):
        if name.startswith('.staging.'):
            shutil.rmtree(os.path.join(save_dir, name), ignore_errors=True)


def commit_staged_checkpoint(save_dir: str, staging: str, iteration: int) -> None:
    """Make the checkpoint written under `staging` the checkpoint of `save_dir`, as a whole.

    The new iteration directory is renamed into place and the tracker written last, so a reader
    sees the old checkpoint or the new one. When the new iteration has the old one's name, the
    tracker is removed first and the old directory renamed aside, so that for the instant of the
    swap a reader finds no checkpoint rather than a mix. The replaced iteration directories (the
    one of the same name and the one the old tracker named) are deleted afterwards.
    """
    name = os.path.basename(get_checkpoint_name(save_dir, iteration, return_base_dir=True))
    final = os.path.join(save_dir, name)
    tracker = get_checkpoint_tracker_filename(save_dir)
    replaced = []
    if os.path.isfile(tracker):
        try:
            old_iteration, old_release = _parse_tracker(tracker)
            old = get_checkpoint_name(save_dir, old_iteration, old_release, return_base_dir=True)
            if old != final and os.path.isdir(old):
                replaced.append(old)
        except ValueError:
            pass
    if os.path.exists(final):
        if os.path.isfile(tracker):
            os.remove(tracker)
        aside = os.path.join(staging, '.replaced')
        os.rename(final, aside)
        replaced.append(aside)
    os.rename(os.path.join(staging, name), final)
    tmp = f'{tracker}.tmp.{os.getpid()}'
    with open(tmp, 'w') as f:
        f.write(str(iteration))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, tracker)
    for path in replaced:
        shutil.rmtree(path, ignore_errors=True)
    shutil.rmtree(staging, ignore_errors=True)
