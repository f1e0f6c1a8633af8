"""Checks of the output directories, run before any model is built.

Megatron finds a read-only `--save` only at the first save (the training before it is lost) and
writes into a `--save` that already holds another run's checkpoints, overwriting its iterations and
moving `latest_checkpointed_iteration.txt` back. Here both stop start-up with one line:

* `--save` (and `--data-cache-path`) must be creatable and writable;
* a `--save` that holds a checkpoint must be the directory this run resumes from (`--load` names
  the same directory), and the run must not start below its latest iteration (`--finetune`, or a
  `--ckpt-step` older than the latest), since its saves would replace newer checkpoints.
"""

import os
import tempfile


def check_output_directories(args) -> None:
    """Raise ValueError (naming the flag and the directory) before any work starts."""
    if args.save is not None:
        _check_writable('--save', args.save)
        _check_save_holds_no_foreign_checkpoint(args)
    cache = getattr(args, 'data_cache_path', None)
    if cache is not None and not getattr(args, 'mock_data', False):
        _check_writable('--data-cache-path', cache)


def _check_writable(flag: str, directory: str) -> None:
    try:
        os.makedirs(directory, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=directory, prefix='.write-test-'):
            pass
    except OSError as exc:
        raise ValueError(
            f'{flag} {directory} is not a writable directory ({exc.strerror or exc})'
        ) from None


def _same_directory(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.realpath(a) == os.path.realpath(b)


def _check_save_holds_no_foreign_checkpoint(args) -> None:
    from megatron.training.checkpointing import TRACKER_FILENAME, _parse_tracker

    tracker = os.path.join(args.save, TRACKER_FILENAME)
    if not os.path.isfile(tracker):
        return
    saved_iteration, release = _parse_tracker(tracker)
    saved = 'release' if release else f'iteration {saved_iteration}'
    if args.load is None or not _same_directory(args.load, args.save):
        raise ValueError(
            f'--save {args.save} already holds a checkpoint ({saved}) that this run does not load '
            f'(--load {args.load}); resume it with --load {args.save}, or choose another --save '
            f'directory'
        )
    if args.finetune:
        start, why = 0, '--finetune'
    elif args.ckpt_step is not None:
        start, why = args.ckpt_step, f'--ckpt-step {args.ckpt_step}'
    else:
        return
    if start < saved_iteration:
        raise ValueError(
            f'--save {args.save} holds checkpoints up to iteration {saved_iteration} but this run '
            f'starts at iteration {start} ({why}): its saves would replace newer checkpoints and '
            f'move {TRACKER_FILENAME} backwards; choose another --save directory'
        )
