"""Non-persistent checkpoints (`--non-persistent-save-interval`, `--non-persistent-ckpt-type`).

Frequent, cheap checkpoints between the persistent ones, in a directory of their own that keeps
only the newest:

- `global`: the run's checkpoint format (torch or torch_dist) in `--non-persistent-global-ckpt-dir`,
  default `<save>/non_persistent`;
- `local`: the torch format (each rank writes its own files, no resharding) in
  `--non-persistent-local-ckpt-dir`.

Each is a complete checkpoint with its own tracker file, written like a persistent one (files to
temporary names, agreement of every rank, tracker last), always synchronously. A save happens at
iterations divisible by the interval that are not `--save-interval` iterations. It never touches
`--save`'s own tracker or iterations, and it does not count as the run's final save.

On `--load`, `choose_load_dir` picks the newest valid checkpoint of either kind (a non-persistent
one of the same iteration as the persistent one wins, as in Megatron); "valid" means every file
this rank would read is present and, for torch-format files, passes its zip CRC check, agreed
over all ranks. An invalid newest one is skipped with a warning.
"""

import glob
import os
import re
import shutil
import zipfile
from typing import List, Optional, Tuple

import torch

from megatron.training.checkpoint.checkpoint_layout import (
    _parse_tracker,
    get_checkpoint_name,
    get_checkpoint_tracker_filename,
)
from megatron.training.utils import print_rank_0

#: The `global` directory under `--save` / `--load` when no directory is given.
NON_PERSISTENT_CKPT_SUBDIR = 'non_persistent'

_ITER_DIR = re.compile(r'^iter_(\d{7})$')


def non_persistent_dir(args, base: Optional[str]) -> Optional[str]:
    """The directory of the run's non-persistent checkpoints (None: none configured)."""
    kind = args.non_persistent_ckpt_type
    if kind == 'local':
        return args.non_persistent_local_ckpt_dir
    if kind == 'global':
        if args.non_persistent_global_ckpt_dir:
            return args.non_persistent_global_ckpt_dir
        return None if base is None else os.path.join(base, NON_PERSISTENT_CKPT_SUBDIR)
    return None


def is_due(args, iteration: int) -> bool:
    """Whether `iteration` gets a non-persistent save (never on a --save-interval iteration)."""
    interval = args.non_persistent_save_interval
    if not (args.save and interval and iteration % interval == 0):
        return False
    return not (args.save_interval and iteration % args.save_interval == 0)


def _iterations_in(directory: str) -> List[int]:
    found = []
    for path in glob.glob(os.path.join(directory, 'iter_*')):
        match = _ITER_DIR.match(os.path.basename(path))
        if match and os.path.isdir(path):
            found.append(int(match.group(1)))
    return sorted(found)


def _tracker_iteration(directory: str) -> Optional[int]:
    tracker = get_checkpoint_tracker_filename(directory)
    if not os.path.isfile(tracker):
        return None
    try:
        # This rank's own reading (read_metadata would agree over all ranks: a collective).
        iteration, release = _parse_tracker(tracker)
    except (ValueError, OSError):
        return None
    return None if release else iteration


def _remove_iterations(directory: str, keep) -> None:
    for it in _iterations_in(directory):
        if not keep(it):
            shutil.rmtree(get_checkpoint_name(directory, it, return_base_dir=True), True)


def _barrier() -> None:
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


def save_non_persistent_checkpoint(
    save_checkpoint, iteration: int, model, optimizer, opt_param_scheduler, flops_so_far: float
) -> None:
    """Save the non-persistent checkpoint of `iteration`, then drop the older ones (every rank
    calls it).

    Args:
        save_checkpoint: `megatron.training.checkpointing.save_checkpoint` (passed in: that
            module imports this one).
    """
    from megatron.training.global_vars import get_args

    args = get_args()
    directory = non_persistent_dir(args, args.save)
    is_rank_0 = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
    if is_rank_0:
        os.makedirs(directory, exist_ok=True)
        latest = _tracker_iteration(directory)
        if latest is not None and latest >= iteration:
            # Left by a run that went further before being resumed from an older checkpoint:
            # scratch that must not block (or be mistaken for) this run's saves.
            os.remove(get_checkpoint_tracker_filename(directory))
        _remove_iterations(directory, keep=lambda it: it < iteration and it == latest)
    _barrier()
    saved = (args.save, args.async_save, args.ckpt_format, args.use_dist_ckpt)
    args.save, args.async_save = directory, False
    if args.non_persistent_ckpt_type == 'local':
        args.ckpt_format, args.use_dist_ckpt = 'torch', False
    try:
        save_checkpoint(iteration, model, optimizer, opt_param_scheduler, flops_so_far)
    finally:
        args.save, args.async_save, args.ckpt_format, args.use_dist_ckpt = saved
    if is_rank_0:
        _remove_iterations(directory, keep=lambda it: it == iteration)
    _barrier()
    print_rank_0(f'  non-persistent checkpoint of iteration {iteration} saved in {directory}')


def _zip_ok(path: str) -> bool:
    try:
        with zipfile.ZipFile(path) as archive:
            return archive.testzip() is None
    except (OSError, zipfile.BadZipFile, EOFError, RuntimeError):
        return False


def _files_ok(args, directory: str, iteration: int) -> bool:
    """Whether this rank's files of the checkpoint look complete."""
    base = get_checkpoint_name(directory, iteration, return_base_dir=True)
    if not os.path.isdir(base):
        return False
    if os.path.isfile(os.path.join(base, '.metadata')):  # torch_dist
        for path in glob.glob(os.path.join(base, '*')):
            if path.endswith('.pt') and not _zip_ok(path):
                return False
            if path.endswith('.distcp') and os.path.getsize(path) == 0:
                return False
        return True
    if not _zip_ok(get_checkpoint_name(directory, iteration)):
        return False
    if args.use_distributed_optimizer and not args.no_load_optim:
        rank_dir = os.path.dirname(get_checkpoint_name(directory, iteration))
        shards = glob.glob(os.path.join(rank_dir, 'distrib_optim*.pt'))
        return all(_zip_ok(path) for path in shards)
    return True


def _all_ranks(ok: bool) -> bool:
    if not torch.distributed.is_initialized():
        return ok
    from megatron.core.device import get_current_device

    flag = torch.tensor([int(ok)], dtype=torch.int32, device=get_current_device())
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN)
    return bool(flag.item())


def choose_load_dir(args, load_dir: Optional[str]) -> Optional[str]:
    """The directory to resume from: `load_dir`, or the non-persistent directory when it holds
    a valid checkpoint at least as new (collective over all ranks when one is configured)."""
    if args.non_persistent_ckpt_type is None or args.ckpt_step is not None or args.finetune:
        return load_dir
    candidates: List[Tuple[int, int, str]] = []  # (iteration, preference, directory)
    persistent = _tracker_iteration(load_dir) if load_dir else None
    if persistent is not None:
        candidates.append((persistent, 0, load_dir))
    other = non_persistent_dir(args, load_dir)
    newest = _tracker_iteration(other) if other and os.path.isdir(other) else None
    if newest is not None:
        candidates.append((newest, 1, other))
        if persistent is not None and newest < persistent:
            print_rank_0('WARNING: non-persistent checkpoints are older than persistent checkpoint')
    for iteration, _, directory in sorted(candidates, reverse=True):
        if directory == load_dir:
            return load_dir  # the persistent checkpoint: its own loader reports any defect
        if _all_ranks(_files_ok(args, directory, iteration)):
            print_rank_0(
                f'resuming from the non-persistent checkpoint of iteration {iteration} in '
                f'{directory}'
            )
            return directory
        print_rank_0(
            f'WARNING: the non-persistent checkpoint of iteration {iteration} in {directory} is '
            'incomplete or corrupt; skipping it'
        )
    return load_dir
