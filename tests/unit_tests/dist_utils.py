"""The one distributed test harness: run a function on N gloo ranks in worker processes.

Usage::

    from tests.unit_tests.dist_utils import run_distributed

    def _body(x):                      # module level, so it can be pickled
        rank = torch.distributed.get_rank()
        return x * rank

    # [rank0_out, rank1_out]
    outs = run_distributed(_body, world_size=2, tp=2, args=(torch.ones(3),))

How it works:

- One persistent pool of worker processes per (world size, backend), at most `MAX_POOLS` alive
  (least recently used closed first). Workers are forked from a clean forkserver that has
  imported torch and the heavy megatron modules once (or spawned, see START_METHOD). Each runs
  `torch.set_num_threads(1)`, joins a gloo (or, with backend="nccl", NCCL) default process
  group on a free TCP port once, then loops over jobs. Starting processes and importing torch
  is the slow part, so pools are reused across tests.
- Per job every rank: `destroy_model_parallel()`, `initialize_model_parallel(tp, pp, vpp,
  split_rank, context_parallel_size=cp, expert_model_parallel_size=ep)`, reset RNG
  (`torch.manual_seed(1234)` and `model_parallel_cuda_manual_seed(1234)`), run `fn(*args,
  **kwargs)`, move tensors in the return value to CPU (through dicts, lists and tuples) and send it
  back.
- An exception on any rank fails the call with ``rank R: <traceback>`` for every failing rank
  (AssertionError if any rank failed an assertion, else RuntimeError). A job with no answer from
  some ranks after `timeout` seconds fails naming those ranks. In both cases the pool is killed
  (its gloo group may be stuck or inconsistent) and the next call builds a fresh one.
- Pools are shut down at interpreter exit and by the root conftest at the end of the session.
"""

import atexit
import collections
import os
import pickle
import queue
import socket
import sys
import time
import traceback
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.multiprocessing as mp

#: Seed every rank's RNGs are reset to before each job.
SEED = 1234
#: Most pools (world size, backend) kept alive at once: the suite's jobs use 1, 2 and 4 ranks
#: in every order, and a pool evicted between them costs a restart (processes, gloo, imports).
MAX_POOLS = 3
#: Seconds to wait for a fresh pool's workers to join the default process group.
POOL_START_TIMEOUT = 180.0
#: After one rank failed, seconds to wait for the others' answers before killing the pool.
ERROR_GRACE = 5.0
#: How workers are started. "forkserver" (default) forks them from one clean server process that
#: has imported torch once, which is much cheaper than importing torch in every spawned worker
#: on a busy machine; "spawn" starts each from scratch. Override with DIST_UTILS_START_METHOD.
START_METHOD = os.environ.get("DIST_UTILS_START_METHOD", "forkserver")
#: Imported once by the forkserver, so every worker it forks starts with them (about 2 s of CPU
#: per worker otherwise: torch.distributed.checkpoint pulls in DTensor, the models the MoE and
#: checkpointing code, most parity tests transformers; and about 3 s per worker for the common
#: mock-data indices).
_PRELOAD = [
    "torch",
    "torch.distributed",
    "torch.distributed.checkpoint",
    "megatron.core.parallel_state",
    "megatron.core.models.gpt",
    "megatron.training.training",
    "transformers",
    # The common mock-data indices, built once here and shared by every worker (see its doc).
    "tests.unit_tests.mock_index_warmup",
]


def _mp_context():
    ctx = mp.get_context(START_METHOD)
    if START_METHOD == "forkserver":
        ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def _find_free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _to_cpu(obj: Any) -> Any:
    """Detached CPU copies of every tensor inside dicts / lists / tuples."""
    if isinstance(obj, torch.Tensor):
        # clone: a view would pickle its whole base storage.
        return obj.detach().cpu().clone()
    if isinstance(obj, dict):
        return type(obj)((k, _to_cpu(v)) for k, v in obj.items())
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(_to_cpu(v) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _reset_state(tp, pp, vpp, cp, ep, split_rank):
    from megatron.core import parallel_state

    training_globals = sys.modules.get("megatron.training.global_vars")
    if training_globals is not None:
        # A job never inherits an earlier job's args, tokenizer or writers (whatever the order
        # pytest runs the tests in).
        training_globals.destroy_global_vars()
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        pipeline_model_parallel_split_rank=split_rank,
        context_parallel_size=cp,
        expert_model_parallel_size=ep,
    )
    torch.manual_seed(SEED)
    try:
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    except ImportError:
        return
    model_parallel_cuda_manual_seed(SEED)


def _worker_main(
    rank: int, world_size: int, port: int, job_q, result_q, parent_pid: int, backend: str
):
    """Entry point of one pool worker: join the default group, then run jobs until told to stop."""
    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    os.environ["RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(world_size)
    os.environ["LOCAL_RANK"] = str(rank)
    try:
        torch.distributed.init_process_group(
            backend=backend,
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
        )
    except BaseException:
        result_q.put(("init", rank, False, f"rank {rank}: {traceback.format_exc()}"))
        return
    result_q.put(("init", rank, True, None))

    while True:
        try:
            job = job_q.get(timeout=1.0)
        except queue.Empty:
            if not _process_alive(parent_pid):  # the test runner died: do not linger
                return
            continue
        if job is None:
            break
        job_id, sys_path, payload = job
        # The parent may have imported test modules from folders added to sys.path after this
        # worker started (pytest "prepend" import mode): mirror its path before unpickling.
        for entry in reversed(sys_path):
            if entry not in sys.path:
                sys.path.insert(0, entry)
        try:
            fn, args, kwargs, layout = pickle.loads(payload)
            _reset_state(**layout)
            out = fn(*args, **kwargs)
            data = pickle.dumps(_to_cpu(out))
            result_q.put((job_id, rank, True, data))
        except BaseException as exc:  # report everything, including KeyboardInterrupt/SystemExit
            is_assert = isinstance(exc, AssertionError)
            result_q.put(
                (job_id, rank, False, (is_assert, f"rank {rank}: {traceback.format_exc()}"))
            )
    try:
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
    except Exception:
        pass
    torch.distributed.destroy_process_group()


class _Pool:
    """`world_size` worker processes sharing one default process group (gloo or nccl)."""

    def __init__(self, world_size: int, backend: str = "gloo"):
        self.world_size = world_size
        self.backend = backend
        ctx = _mp_context()
        self.result_q = ctx.Queue()
        self.job_qs = [ctx.Queue() for _ in range(world_size)]
        self.port = _find_free_port()
        self.procs = []
        self.next_job_id = 0
        for rank in range(world_size):
            proc = ctx.Process(
                target=_worker_main,
                args=(
                    rank,
                    world_size,
                    self.port,
                    self.job_qs[rank],
                    self.result_q,
                    os.getpid(),
                    backend,
                ),
                name=f"dist_utils-ws{world_size}-rank{rank}",
            )
            proc.start()
            self.procs.append(proc)
        try:
            self._wait_ready()
        except BaseException:
            self.kill()
            raise

    def _wait_ready(self):
        deadline = time.monotonic() + POOL_START_TIMEOUT
        ready, errors = set(), []
        while len(ready) + len(errors) < self.world_size:
            msg = self._get(deadline)
            if msg is None:
                missing = sorted(set(range(self.world_size)) - ready)
                raise RuntimeError(
                    f"dist_utils: ranks {missing} of a {self.world_size}-rank pool did not join "
                    f"the gloo group on port {self.port} within {POOL_START_TIMEOUT:.0f}s"
                    + ("".join("\n" + e for e in errors))
                )
            tag, rank, ok, err = msg
            if tag != "init":
                continue
            if ok:
                ready.add(rank)
            else:
                errors.append(err)
        if errors:
            raise RuntimeError("dist_utils: pool start failed:\n" + "\n".join(errors))

    def _get(self, deadline: float):
        """Next message from any worker, or None at the deadline or if a worker died."""
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            try:
                return self.result_q.get(timeout=min(remaining, 0.5))
            except queue.Empty:
                dead = [p for p in self.procs if not p.is_alive()]
                if dead:
                    # Drain whatever the dead/alive workers managed to send before giving up.
                    try:
                        return self.result_q.get(timeout=0.5)
                    except queue.Empty:
                        self.dead_ranks = [self.procs.index(p) for p in dead]
                        return None

    def run(self, fn, args, kwargs, layout, timeout: float) -> List[Any]:
        job_id = self.next_job_id
        self.next_job_id += 1
        self.dead_ranks = []
        payload = pickle.dumps((fn, tuple(args), dict(kwargs), layout))
        for q in self.job_qs:
            q.put((job_id, list(sys.path), payload))

        results: Dict[int, Any] = {}
        errors: Dict[int, str] = {}
        any_assert = False
        deadline = time.monotonic() + timeout
        timed_out = False
        while len(results) + len(errors) < self.world_size:
            msg = self._get(deadline)
            if msg is None:
                timed_out = not errors
                break
            msg_job, rank, ok, data = msg
            if msg_job != job_id:
                continue
            if ok:
                results[rank] = pickle.loads(data)
            else:
                is_assert, text = data
                any_assert = any_assert or is_assert
                errors[rank] = text
                # The other ranks may now block in a collective with the failed one.
                deadline = min(deadline, time.monotonic() + ERROR_GRACE)

        if not errors and not timed_out and len(results) == self.world_size:
            return [results[r] for r in range(self.world_size)]

        missing = sorted(set(range(self.world_size)) - set(results) - set(errors))
        name = getattr(fn, "__qualname__", repr(fn))
        if errors:
            lines = [f"dist_utils: {name} failed on rank(s) {sorted(errors)} of {self.world_size}"]
            if missing:
                lines.append(
                    f"(ranks {missing} gave no answer; probably blocked on the failed rank)"
                )
            lines += [errors[r] for r in sorted(errors)]
            exc_type = AssertionError if any_assert else RuntimeError
            raise exc_type("\n".join(lines))
        dead = f"; ranks {self.dead_ranks} died" if self.dead_ranks else ""
        raise RuntimeError(
            f"dist_utils: {name} timed out after {timeout:.0f}s: ranks {missing} of "
            f"{self.world_size} did not answer (deadlock or mismatched collectives?){dead}"
        )

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def close(self, grace: float = 5.0):
        """Ask workers to exit cleanly; kill those that do not."""
        for q in self.job_qs:
            try:
                q.put(None)
            except Exception:
                pass
        deadline = time.monotonic() + grace
        for p in self.procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        self.kill()

    def kill(self):
        for p in self.procs:
            if p.is_alive():
                p.kill()
        for p in self.procs:
            p.join(timeout=5)
        for q in self.job_qs + [self.result_q]:
            q.cancel_join_thread()
            q.close()


# Pools by (world_size, backend), least recently used first.
_POOLS: "collections.OrderedDict[tuple, _Pool]" = collections.OrderedDict()


def _get_pool(world_size: int, backend: str = "gloo") -> _Pool:
    key = (world_size, backend)
    pool = _POOLS.get(key)
    if pool is not None and not pool.alive():
        _POOLS.pop(key).kill()
        pool = None
    if pool is None:
        while len(_POOLS) >= MAX_POOLS:
            _, old = _POOLS.popitem(last=False)  # least recently used
            old.close()
        pool = _Pool(world_size, backend)
        _POOLS[key] = pool
    _POOLS.move_to_end(key)
    return pool


def shutdown_all_pools():
    """Stop every worker pool (atexit and the root conftest's session-finish hook call this)."""
    while _POOLS:
        _, pool = _POOLS.popitem()
        pool.close()


atexit.register(shutdown_all_pools)


def run_distributed(
    fn: Callable,
    world_size: int,
    tp: int = 1,
    pp: int = 1,
    vpp: Optional[int] = None,
    cp: int = 1,
    ep: int = 1,
    split_rank: Optional[int] = None,
    args=(),
    kwargs=None,
    timeout: float = 180,
    backend: str = "gloo",
) -> List[Any]:
    """Run `fn(*args, **kwargs)` on `world_size` gloo ranks with model parallel state initialized.

    Args:
        fn: module-level (picklable) function; inside it `torch.distributed.get_rank()` is the rank.
        world_size: number of ranks.
        tp, pp, vpp, cp, ep, split_rank: tensor / pipeline / virtual pipeline / context / expert
            parallel sizes and the pipeline split rank passed to `initialize_model_parallel`.
        args, kwargs: arguments for `fn` (pickled; tensors are copied).
        timeout: seconds to wait for every rank's answer before failing.
        backend: "gloo" (CPU, default) or "nccl" (one GPU per rank; mark such tests `gpu`).

    Returns:
        The per-rank return values, index = rank, with tensors detached and moved to CPU.

    Raises:
        AssertionError / RuntimeError: naming every failing rank with its traceback, or the ranks
            that did not answer within `timeout`.
    """
    kwargs = {} if kwargs is None else kwargs
    layout = dict(tp=tp, pp=pp, vpp=vpp, cp=cp, ep=ep, split_rank=split_rank)
    if backend == "nccl" and torch.cuda.device_count() < world_size:
        raise RuntimeError(
            f"run_distributed: backend='nccl' with world_size {world_size} needs {world_size} "
            f"GPUs, found {torch.cuda.device_count()} (mark the test with @pytest.mark.gpu)"
        )
    pool = _get_pool(world_size, backend)
    try:
        return pool.run(fn, args, kwargs, layout, timeout)
    except BaseException:
        # A failed or stuck job leaves the process group in an unknown state: rebuild next time.
        if _POOLS.get((world_size, backend)) is pool:
            del _POOLS[(world_size, backend)]
        pool.kill()
        raise
