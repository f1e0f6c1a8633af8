"""Asynchronous saves: files are written by a background worker while training continues.

A save is split into an `AsyncRequest`:

- the collective, fast part runs at once on every rank (planning, and staging: a CPU copy of
  every tensor this rank writes, so training may change the parameters right after);
- `async_fn` writes this rank's files in a background thread (no collectives, so it never
  interleaves with the training loop's communication);
- `finalize_fns` run on the main thread once *every* rank's writer is done: the DCP
  `.metadata` (gathered write results), then `metadata.json`, then the caller's steps (the
  trainer moves the tracker file last).

`AsyncCallsQueue.maybe_finalize_async_calls` is called by the training loop at every iteration:
one small all-reduce (only while a save is pending) tells whether all writers finished. The
next save, the end of training and the exit paths finalize with `blocking=True`. If the writer
failed on any rank, finalization raises on every rank and nothing after `.distcp` is written:
the previous checkpoint stays the latest.
"""

import threading
import time
from typing import Any, Callable, List, Optional, Tuple

import torch

from megatron.core.utils import get_current_device


class AsyncRequest:
    """A save's background part (`async_fn(*async_fn_args)`) and its finalize steps.

    Args:
        async_fn: writes files; must not run collectives. None: nothing to write.
        async_fn_args: its positional arguments.
        finalize_fns: run in order on the main thread after all ranks' async_fn finished.
    """

    def __init__(
        self,
        async_fn: Optional[Callable],
        async_fn_args: Tuple = (),
        finalize_fns: Optional[List[Callable]] = None,
    ):
        self.async_fn = async_fn
        self.async_fn_args = tuple(async_fn_args)
        self.finalize_fns = list(finalize_fns or [])
        self.result: Any = None
        self.error: Optional[BaseException] = None

    def add_finalize_fn(self, fn: Callable) -> None:
        self.finalize_fns.append(fn)

    def run_async_fn(self) -> None:
        """Run the background part here, recording its result or error."""
        try:
            if self.async_fn is not None:
                self.result = self.async_fn(*self.async_fn_args)
        except BaseException as exc:  # reported at finalization, on every rank
            self.error = exc

    def execute_sync(self) -> None:
        """Write and finalize now (a synchronous save through the same steps)."""
        self.run_async_fn()
        _raise_if_any_failed(self.error)
        for fn in self.finalize_fns:
            fn()


def _raise_if_any_failed(error: Optional[BaseException]) -> None:
    """Collective: every rank raises if any rank's writer failed."""
    failed = 1 if error is not None else 0
    if torch.distributed.is_initialized():
        flag = torch.tensor([failed], dtype=torch.int32, device=get_current_device())
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        failed = int(flag.item())
    if failed:
        detail = f': {error!r}' if error is not None else ' (on another rank)'
        raise RuntimeError(f'asynchronous checkpoint write failed{detail}') from error


class AsyncCallsQueue:
    """Background checkpoint writers of this process, finalized in order on every rank."""

    def __init__(self):
        self._pending: List[Tuple[int, threading.Thread, AsyncRequest]] = []
        self._call_idx = -1

    def schedule_async_request(self, request: AsyncRequest) -> int:
        """Start `request.async_fn` in a background thread; returns the call index."""
        self._call_idx += 1
        thread = threading.Thread(
            target=request.run_async_fn, name=f'async-ckpt-{self._call_idx}', daemon=True
        )
        thread.start()
        self._pending.append((self._call_idx, thread, request))
        return self._call_idx

    def get_num_unfinalized_calls(self) -> int:
        return len(self._pending)

    def maybe_finalize_async_calls(self, blocking: bool = False) -> List[int]:
        """Finalize the pending saves whose writers finished on every rank.

        Collective when something is pending (every rank schedules the same saves, so every
        rank takes part). With `blocking`, waits for all of them.

        Returns:
            the finalized call indices.
        """
        done = []
        while self._pending:
            call_idx, thread, request = self._pending[0]
            if blocking:
                thread.join()
            finished = 0 if thread.is_alive() else 1
            if torch.distributed.is_initialized():
                flag = torch.tensor([finished], dtype=torch.int32, device=get_current_device())
                torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN)
                finished = int(flag.item())
            if not finished:
                break
            thread.join()
            self._pending.pop(0)
            _raise_if_any_failed(request.error)
            for fn in request.finalize_fns:
                fn()
            done.append(call_idx)
        return done

    def close(self) -> None:
        """Finalize everything pending (blocking)."""
        self.maybe_finalize_async_calls(blocking=True)


def wait_for_thread(thread: threading.Thread, poll: float = 0.05) -> None:
    while thread.is_alive():
        time.sleep(poll)
