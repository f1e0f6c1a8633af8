"""One-line exits for user errors in the entry scripts.

A wrong flag, a missing or malformed input file, a `--save` directory that would be damaged: these
are the user's to fix, and a 60-line traceback printed once per rank (and again inside torchrun's
failure report) hides the one line that says what to fix. `run_main` runs an entry point and turns
such errors into

    error: <message>

on stderr, printed ONCE for the whole job, and exit code 1 (`EXIT_USER_ERROR`). Which rank prints:
the first rank to fail (an atomic counter in the job's c10d store: torchrun's agent store before
torch.distributed is initialized, the default group's after), so an error seen only on rank 5 is
still reported, and only once; the other failing ranks wait for its line before they exit.
Without a launcher's store (a plain single process), rank 0 prints.

Internal errors (assertions, RuntimeError, ...) keep their tracebacks. Set MEGATRON_TRACEBACK=1 to
get the traceback of user errors too.
"""

import os
import sys
from typing import Any, Callable

#: Exit code of a user error (argparse's own errors keep argparse's code, 2).
EXIT_USER_ERROR = 1
#: Exit code when the watchdog finds a rank that stopped making progress.
EXIT_WATCHDOG = 3

#: Exception types that mean "the input is wrong", not "the program is wrong".
USER_ERRORS = (
    ValueError,
    FileNotFoundError,
    PermissionError,
    NotADirectoryError,
    IsADirectoryError,
    FileExistsError,
)

# With torchrun's restart count: a restarted job must not see the last attempt's key.
_STORE_KEY = f"megatron_errors/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/printed"


def global_rank() -> int:
    """This process's global rank (torchrun's RANK before torch.distributed is initialized)."""
    import torch

    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return int(os.environ.get('RANK', '0'))


def _distributed_world_size() -> int:
    import torch

    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size()
    return 1


def _job_store():
    """The job's c10d store, or None: the default group's once torch.distributed is initialized,
    before that the store torchrun's agent serves to its workers (TORCHELASTIC_USE_AGENT_STORE),
    so that ranks failing before initialization can agree too."""
    import torch

    if torch.distributed.is_available() and torch.distributed.is_initialized():
        try:
            return torch.distributed.distributed_c10d._get_default_store()
        except Exception:
            return None
    if os.environ.get('TORCHELASTIC_USE_AGENT_STORE') != 'True' or 'MASTER_PORT' not in os.environ:
        return None
    try:
        import datetime

        return torch.distributed.TCPStore(
            os.environ.get('MASTER_ADDR', '127.0.0.1'),
            int(os.environ['MASTER_PORT']),
            is_master=False,
            timeout=datetime.timedelta(seconds=10),
        )
    except Exception:  # no agent store after all: fall back to rank 0
        return None


def _first_to_report(store) -> bool:
    """True on exactly one rank of the job: the first to fail (an atomic counter in the job's
    store). Without a store: rank 0 before initialization, every rank after it."""
    import torch

    initialized = torch.distributed.is_available() and torch.distributed.is_initialized()
    if store is None:
        return True if initialized else global_rank() == 0
    if initialized and torch.distributed.get_world_size() == 1:
        return True
    try:
        return store.add(_STORE_KEY, 1) == 1
    except Exception:  # the store is gone (its host died): better twice than never
        return True


def _printed(store) -> None:
    try:
        store.set(_STORE_KEY + '_done', '1')
    except Exception:
        pass


def _wait_for_reporter(store) -> bool:
    """Let the reporting rank print before this rank exits (its exit makes the launcher stop
    the others, the reporter included). False if it never confirmed."""
    import datetime

    try:
        store.wait([_STORE_KEY + '_done'], datetime.timedelta(seconds=10))
        return True
    except Exception:
        return False


def format_user_error(exc: BaseException) -> str:
    """`error: <message>` (FileNotFoundError / PermissionError keep the file name they carry)."""
    if isinstance(exc, OSError) and exc.filename is not None:
        message = f'{exc.strerror}: {exc.filename}'
    else:
        message = str(exc) if str(exc) else type(exc).__name__
    return f'error: {message}'


def exit_with_user_error(exc: BaseException) -> None:
    """Print `exc` as one `error:` line (once per job) and exit with EXIT_USER_ERROR.

    Under a launcher, the first rank to fail prints; every other rank waits until it has
    printed before exiting (the launcher stops the whole job as soon as one rank exits, which
    could otherwise kill the reporter before its line is out), and prints the line itself if
    the reporter never confirms.
    """
    store = _job_store()
    if _first_to_report(store):
        print(format_user_error(exc), file=sys.stderr, flush=True)
        if store is not None:
            _printed(store)
    elif store is not None and not _wait_for_reporter(store):
        print(format_user_error(exc), file=sys.stderr, flush=True)
    sys.stdout.flush()
    if _distributed_world_size() > 1:
        # Peers may be blocked in a collective with this rank: interpreter shutdown would wait on
        # process-group teardown. The launcher notices the exit and stops the other ranks.
        os._exit(EXIT_USER_ERROR)
    sys.exit(EXIT_USER_ERROR)


def run_main(main: Callable[..., Any], *args, **kwargs) -> Any:
    """Call `main(*args, **kwargs)`, turning user errors into one line and exit code 1."""
    try:
        return main(*args, **kwargs)
    except USER_ERRORS as exc:
        if os.environ.get('MEGATRON_TRACEBACK', '0') not in ('', '0'):
            raise
        exit_with_user_error(exc)


def note(args, message: str) -> None:
    """Print a rank-0 note about a flag that was adjusted or has no effect here (no exit)."""
    if args.rank == 0:
        print(f'NOTE: {message}', flush=True)
