"""Asynchronous saves: files are written by a background worker while training continues.

A save is split into an `AsyncRequest`:

- what must see the values of the save call and is cheap runs at once (the torch_dist
  strategy pickles the objects that may change; a synchronous save also plans here);
- `stage_fn` (when given) runs first in the background thread: a CPU snapshot of every tensor
  this rank writes. The caller's tensors must not change until it is done: the trainer's
  optimizer step waits for it (`AsyncCallsQueue.wait_for_staging`), so the copy overlaps the
  next iteration's forward and backward instead of blocking training;
- `async_fn` then writes this rank's files in the same thread; its only collectives (the
  torch_dist planning exchange) run over a process group of their own, so they never
  interleave with the training loop's communication;
- finalization runs on the main thread once *every* rank's writer is done: one gather of
  every rank's outcome to rank 0, which writes DCP's `.metadata` (from the gathered write
  results), then `metadata.json`, then the caller's steps (the trainer moves the tracker file
  last), and one broadcast of its verdict.

`AsyncCallsQueue.maybe_finalize_async_calls` is called by the training loop at every iteration:
one small all-reduce (only while a save is pending) tells whether all writers finished. The
next save, the end of training and the exit paths finalize with `blocking=True`. If the writer
failed on any rank (or rank 0's finishing steps fail), finalization raises on every rank and
nothing after `.distcp` is written: the previous checkpoint stays the latest.
"""

import threading
import time
from typing import Any, Callable, List, Optional, Tuple

import torch

from megatron.core.utils import get_current_device


class AsyncRequest:
    """A save's background part (`async_fn(*async_fn_args)`) and its finalize steps.

    Finalization (`finalize`, collective, main thread, after every rank's async_fn finished) is
    one exchange: every rank's outcome (error or async_fn's result) is gathered on rank 0;
    rank 0 runs the coordinator functions in order (each gets the list of every rank's result:
    DCP's `.metadata`, then `metadata.json`, then the trainer's tracker) unless a writer failed;
    rank 0's verdict is broadcast and every rank raises the same error or goes on with the
    finalize functions.

    Args:
        async_fn: writes files; collectives only over a group the main thread never uses.
            It is skipped when stage_fn raises, so with collectives in async_fn a stage_fn
            hands its failure on to async_fn instead of raising. None: nothing to write.
        async_fn_args: its positional arguments.
        finalize_fns: run in order on every rank after a successful finalization.
        coordinator_fns: run in order on rank 0 with every rank's async_fn result.
        stage_fn: run before async_fn in the same thread; until it returns the caller must not
            change the tensors being saved (`wait_until_staged`). None: nothing to stage.
    """

    def __init__(
        self,
        async_fn: Optional[Callable],
        async_fn_args: Tuple = (),
        finalize_fns: Optional[List[Callable]] = None,
        coordinator_fns: Optional[List[Callable[[List[Any]], None]]] = None,
        stage_fn: Optional[Callable[[], None]] = None,
    ):
        self.async_fn = async_fn
        self.async_fn_args = tuple(async_fn_args)
        self.finalize_fns = list(finalize_fns or [])
        self.coordinator_fns = list(coordinator_fns or [])
        self.stage_fn = stage_fn
        self.staged = threading.Event()
        self.result: Any = None
        self.error: Optional[BaseException] = None

    def add_finalize_fn(self, fn: Callable) -> None:
        self.finalize_fns.append(fn)

    def add_coordinator_fn(self, fn: Callable[[List[Any]], None]) -> None:
        self.coordinator_fns.append(fn)

    def run_async_fn(self) -> None:
        """Run the background part here (staging, then writing), recording its result or
        error."""
        try:
            if self.stage_fn is not None:
                self.stage_fn()
        except BaseException as exc:  # reported at finalization, on every rank
            self.error = exc
        finally:
            self.staged.set()  # a failed staging must not leave the trainer waiting
        if self.error is not None:
            return
        try:
            if self.async_fn is not None:
                self.result = self.async_fn(*self.async_fn_args)
        except BaseException as exc:
            self.error = exc

    def wait_until_staged(self) -> None:
        """Block until the tensors being saved may change (the snapshot is taken)."""
        self.staged.wait()

    def execute_sync(self) -> None:
        """Write and finalize now (a synchronous save through the same steps)."""
        self.run_async_fn()
        self.finalize()

    def finalize(self) -> None:
        """Collective: gather the outcomes, run the coordinator steps, share the verdict."""
        mine = (None, self.result) if self.error is None else (repr(self.error), None)
        if torch.distributed.is_initialized():
            rank = torch.distributed.get_rank()
            gathered = [None] * torch.distributed.get_world_size() if rank == 0 else None
            torch.distributed.gather_object(mine, gathered, dst=0)
        else:
            rank, gathered = 0, [mine]
        verdict = None
        if rank == 0:
            verdict = self._coordinate(gathered)
        if torch.distributed.is_initialized():
            box = [verdict]
            torch.distributed.broadcast_object_list(box, src=0)
            verdict = box[0]
        if verdict:
            raise RuntimeError(verdict) from self.error
        for fn in self.finalize_fns:
            fn()

    def _coordinate(self, gathered: List[Tuple[Optional[str], Any]]) -> Optional[str]:
        failed = [(rank, error) for rank, (error, _) in enumerate(gathered) if error is not None]
        if failed:
            rank, error = failed[0]
            return f'asynchronous checkpoint write failed on rank {rank}: {error}'
        results = [result for _, result in gathered]
        try:
            for fn in self.coordinator_fns:
                fn(results)
        except Exception as exc:  # every rank must still get the verdict
            return f'finishing the checkpoint failed on rank 0: {exc!r}'
        return None


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

    def wait_for_staging(self) -> None:
        """Block until every pending save has its snapshot (local, no collective): call it
        before changing the saved tensors (the trainer's optimizer step does)."""
        for _, _, request in self._pending:
            request.wait_until_staged()

    def get_num_unfinalized_calls(self) -> int:
        return len(self._pending)

    def writers_finished(self) -> bool:
        """Whether this rank's background writers are all done (local; nothing finalized)."""
        return not any(thread.is_alive() for _, thread, _ in self._pending)

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
            request.finalize()
            done.append(call_idx)
        return done

    def close(self) -> None:
        """Finalize everything pending (blocking)."""
        self.maybe_finalize_async_calls(blocking=True)


def wait_for_thread(thread: threading.Thread, poll: float = 0.05) -> None:
    while thread.is_alive():
        time.sleep(poll)
