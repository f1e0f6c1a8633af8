"""Progress watchdog and launcher-death detection for training processes.

Without it a rank that stops making progress (stopped with SIGSTOP, stuck in I/O, deadlocked)
hangs the whole job silently until `--distributed-timeout-minutes` (10 min) expires, and workers
whose launcher was killed keep training (and saving) as orphans.

Watchdog (`--watchdog-timeout` seconds, 0 disables). A daemon thread per rank

* publishes a heartbeat every few seconds in the job's c10d store (a counter, the operation the
  rank is in and its iteration), and
* watches the others' heartbeats and its own current operation.

When the rank's own operation (a training step, an evaluation) has run longer than the timeout,
or a peer's heartbeat counter has not moved for that long (the peer's process is frozen or gone),
the first rank to notice prints one line naming the silent rank(s), the operation and how long,
e.g.::

    watchdog: rank 1 stopped making progress: no heartbeat for 31 s (last heartbeat in
    'training iteration' at iteration 4); rank 0 has waited 30 s in 'training iteration' at
    iteration 5 (--watchdog-timeout 30)

and the process exits with code 3 (`errors.EXIT_WATCHDOG`); the launcher then stops the rest.
Counters rather than timestamps are compared, so clocks of different nodes need not agree.

Launcher death: `exit_when_launcher_dies` polls the parent process id; when the launcher
(torchrun) is gone the worker prints one line and exits.
"""

import os
import sys
import threading
import time
from contextlib import contextmanager
from typing import Dict, Optional

from megatron.training.run_control.errors import EXIT_WATCHDOG

# Keys carry torchrun's restart count: a restarted job must not see the last attempt's keys.
_ATTEMPT = os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')
_KEY = f'megatron_watchdog/{_ATTEMPT}/heartbeat/' + '{}'
_REPORTED_KEY = f'megatron_watchdog/{_ATTEMPT}/reported'


class Watchdog:
    """Heartbeats through a c10d store plus a deadline on the current operation.

    Args:
        store: the job's c10d store (shared by all ranks), or None for a single process.
        rank, world_size: this process's global rank and the job size.
        timeout: seconds without progress before the job is stopped.
        poll_interval: seconds between heartbeats / checks (default: timeout / 10, 0.5..5 s).
        exit_fn: called with the exit code after the report (default os._exit).
    """

    def __init__(
        self,
        store,
        rank: int,
        world_size: int,
        timeout: float,
        poll_interval: Optional[float] = None,
        exit_fn=None,
    ):
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.timeout = float(timeout)
        self.poll_interval = poll_interval or min(5.0, max(0.5, self.timeout / 10))
        self.exit_fn = exit_fn or os._exit
        self._lock = threading.Lock()
        self._op = 'initialization'
        self._op_deadline = False
        self._op_start = time.monotonic()
        self._iteration = 0
        self._beats = 0
        # peer -> (last counter seen, local time it last changed, last payload)
        self._peers: Dict[int, tuple] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name='megatron-watchdog', daemon=True)

    def start(self) -> 'Watchdog':
        self._beat()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def progress(self, operation: str, iteration: Optional[int] = None, deadline: bool = True):
        """Progress was made: the rank now is in `operation` (until the next call), clock reset."""
        with self._lock:
            self._op, self._op_deadline, self._op_start = operation, deadline, time.monotonic()
            if iteration is not None:
                self._iteration = iteration

    @contextmanager
    def watch(self, operation: str, iteration: Optional[int] = None, deadline: bool = True):
        """Mark the current operation; with `deadline` it must finish within the timeout."""
        with self._lock:
            previous = (self._op, self._op_deadline, self._op_start)
            self._op, self._op_deadline, self._op_start = operation, deadline, time.monotonic()
            if iteration is not None:
                self._iteration = iteration
        try:
            yield
        finally:
            with self._lock:
                self._op, self._op_deadline, _ = previous
                self._op_start = time.monotonic()

    # -- the thread ----------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.wait(self.poll_interval):
            try:
                self._beat()
                message = self._check()
            except Exception:  # the store went away: the launcher is tearing the job down
                return
            if message is not None:
                self._report(message)
                return

    def _beat(self) -> None:
        if self.store is None:
            return
        self._beats += 1
        with self._lock:
            payload = f'{self._beats}|{self._op}|{self._iteration}'
        self.store.set(_KEY.format(self.rank), payload)

    def _silent_peers(self, now: float):
        """[(rank, seconds without a heartbeat, op, iteration)] for peers silent > 2 polls."""
        silent = []
        if self.store is None:
            return silent
        for peer in range(self.world_size):
            if peer == self.rank:
                continue
            key = _KEY.format(peer)
            if not self.store.check([key]):
                continue
            counter, op, iteration = self.store.get(key).decode().split('|', 2)
            last = self._peers.get(peer)
            if last is None or last[0] != counter:
                self._peers[peer] = (counter, now, op, iteration)
                continue
            age = now - last[1]
            if age > 2 * self.poll_interval:
                silent.append((peer, age, op, iteration))
        return silent

    def _check(self) -> Optional[str]:
        now = time.monotonic()
        silent = self._silent_peers(now)
        dead = [s for s in silent if s[1] > self.timeout]
        with self._lock:
            op, deadline, op_age, iteration = (
                self._op,
                self._op_deadline,
                now - self._op_start,
                self._iteration,
            )
        stuck = deadline and op_age > self.timeout
        if not dead and not stuck:
            return None
        parts = [
            f'rank {peer} stopped making progress: no heartbeat for {age:.0f} s (last heartbeat '
            f"in '{peer_op}' at iteration {peer_it})"
            for peer, age, peer_op, peer_it in sorted(silent, key=lambda s: -s[1])
        ]
        parts.append(
            f"rank {self.rank} has waited {op_age:.0f} s in '{op}' at iteration {iteration}"
        )
        return 'watchdog: ' + '; '.join(parts) + f' (--watchdog-timeout {self.timeout:g})'

    def _report(self, message: str) -> None:
        first = True
        if self.store is not None:
            try:
                first = self.store.add(_REPORTED_KEY, 1) == 1
            except Exception:
                first = True
        if first:
            print(message, file=sys.stderr, flush=True)
        sys.stdout.flush()
        self.exit_fn(EXIT_WATCHDOG)


_WATCHDOG: Optional[Watchdog] = None


def start_watchdog(timeout: float) -> Optional[Watchdog]:
    """Start the job's watchdog (torch.distributed must be initialized); None if timeout <= 0."""
    import torch

    global _WATCHDOG
    if _WATCHDOG is not None:
        _WATCHDOG.stop()
        _WATCHDOG = None
    if not timeout or timeout <= 0:
        return None
    world_size = torch.distributed.get_world_size()
    store = None
    if world_size > 1:
        store = torch.distributed.distributed_c10d._get_default_store()
    _WATCHDOG = Watchdog(store, torch.distributed.get_rank(), world_size, timeout).start()
    return _WATCHDOG


def stop_watchdog() -> None:
    global _WATCHDOG
    if _WATCHDOG is not None:
        _WATCHDOG.stop()
        _WATCHDOG = None


def progress(operation: str, iteration: Optional[int] = None, deadline: bool = True) -> None:
    """`Watchdog.progress` on the running watchdog; a no-op when none runs."""
    if _WATCHDOG is not None:
        _WATCHDOG.progress(operation, iteration, deadline)


@contextmanager
def watch(operation: str, iteration: Optional[int] = None, deadline: bool = True):
    """`Watchdog.watch` on the running watchdog; a no-op when none runs."""
    if _WATCHDOG is None:
        yield
    else:
        with _WATCHDOG.watch(operation, iteration, deadline):
            yield


def exit_when_launcher_dies(poll_interval: float = 1.0) -> None:
    """Under torchrun: exit (code 1) as soon as the launcher process is gone.

    The parent process id is polled from a daemon thread: it changes (the orphan is re-parented to
    init or a subreaper) when the launcher dies, whatever killed it, on every POSIX system.
    """
    if 'TORCHELASTIC_RUN_ID' not in os.environ or getattr(exit_when_launcher_dies, 'started', 0):
        return
    exit_when_launcher_dies.started = 1
    launcher = os.getppid()

    def _poll():
        while True:
            time.sleep(poll_interval)
            if os.getppid() != launcher:
                print(
                    f'rank {os.environ.get("RANK", "?")}: the launcher (pid {launcher}) is gone; '
                    f'exiting',
                    file=sys.stderr,
                    flush=True,
                )
                os._exit(1)

    threading.Thread(target=_poll, name='megatron-launcher-watch', daemon=True).start()
