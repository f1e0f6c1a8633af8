"""How the ranks of a text generation server run requests together.

Global rank 0 serves HTTP; one thread of it, the `ServingLoop`, does every collective of the
server, so the other ranks see one sequence of work. Before each unit of work it broadcasts a
choice over the default group, Megatron's protocol extended by two values:

- `GENERATE_NUM` (0) / `BEAM_NUM` (1), Megatron's: a request of the legacy generate() path
  (`text_generation.api.run_prepared`, one request at a time: beam search, top-p decay, the colon
  rule, or `--use-legacy-static-engine`);
- `ENGINE_STEP_NUM` (2): one step of the dynamic-batching engine, which starts with its own
  broadcast of rank 0's new requests and cancellations (every rank schedules the same requests);
  sent at least every `heartbeat_s` while idle, so waiting ranks never reach the process group's
  timeout;
- `STOP_NUM` (3): the waiting ranks return (rank 0 stops serving);
- `VLM_GENERATE_NUM` (4): a request of a vision-language (LLaVA) server, with its images
  (`vlm_generation.run_vlm_request`, one at a time);
- `IDLE_NUM` (5): no work (a vision-language server's idle heartbeat).

Every other rank waits in `run_generation_worker_loop(model, engine)` for the choice and joins.

A failed request never stops a rank. A legacy request ends with every rank agreeing on whether
any of them failed, then raises the same exception on all of them (`RequestRefused`,
`GenerationFailed`), so the loop reports it and waits for the next choice. An engine step that
raises fails the requests of that step on every rank (the engine is built with
`isolate_failures`, one agreement all-reduce per step) and the engine goes on. This covers every
failure that is a function of the request (the same on every rank: the ranks hold identical
settings, tokens and, within a stage, identical logits). A rank that fails alone in the middle
of a collective (a device fault) leaves its peers waiting in that collective; only tearing the
process group down would free them, which this loop does not attempt.
"""

import queue
import threading

import torch

from megatron.core.inference.engines.engine_loop import EngineLoop
from megatron.core.utils import get_current_device
from megatron.inference.text_generation.api import (
    GenerationFailed,
    RequestRefused,
    run_prepared,
    run_request,
)
from megatron.inference.text_generation.request import BEAM_SEARCH
from megatron.inference.worker_protocol import (  # noqa: F401  (the names this module had)
    BEAM_NUM,
    ENGINE_STEP_NUM,
    GENERATE_NUM,
    HEARTBEAT_S,
    IDLE_NUM,
    STOP_NUM,
    VLM_GENERATE_NUM,
    _send_choice,
)

#: One legacy generation at a time: the other ranks follow rank 0's broadcasts in order.
lock = threading.Lock()


def send_do_generate():
    """Tell the waiting ranks to join a sampling generation."""
    _send_choice(GENERATE_NUM)


def send_do_beam_search():
    """Tell the waiting ranks to join a beam search."""
    _send_choice(BEAM_NUM)


def serve(model, prepared, step_callback=None):
    """Rank 0: run a prepared legacy request on every rank (under the lock; in a server, from
    the serving loop's thread only).

    Returns:
        The post-processed result (see `run_prepared`).

    Raises:
        GenerationFailed: a loop raised on some rank (all ranks are back in step).
    """
    with lock:
        _send_choice(BEAM_NUM if prepared.settings.mode == BEAM_SEARCH else GENERATE_NUM)
        return run_prepared(model, prepared, step_callback=step_callback)


def follow_one_request(model, engine=None):
    """Every rank but the server's: wait for rank 0's next choice and join that work.

    Whatever a request does (refused, or a loop that raised on any rank), this rank leaves it
    together with the others, ready for the next one.

    Returns:
        'ok', 'refused', 'failed', 'step' (an engine step), 'stop', or 'ignored' (a choice that
        is no work).
    """
    choice = torch.tensor([-1], dtype=torch.long, device=get_current_device())
    torch.distributed.broadcast(choice, 0)
    choice = choice.item()
    if choice == ENGINE_STEP_NUM and engine is not None:
        for request in engine.step().finished_requests:
            engine.requests.pop(request.request_id, None)
        return 'step'
    if choice == STOP_NUM:
        return 'stop'
    if choice == VLM_GENERATE_NUM:
        return _follow_vlm_request(model)
    if choice not in (GENERATE_NUM, BEAM_NUM):
        return 'ignored'
    try:
        # One path for both choices: the mode travels with the request's settings.
        run_request(model)
    except RequestRefused:
        return 'refused'
    except GenerationFailed as exc:
        print(
            f'rank {torch.distributed.get_rank()}: request failed ({exc}); waiting for the next '
            f'one',
            flush=True,
        )
        return 'failed'
    return 'ok'


def _follow_vlm_request(model):
    from megatron.inference.vlm_generation import run_vlm_request
    from megatron.training.global_vars import get_tokenizer

    try:
        run_vlm_request(model, get_tokenizer().vocab_size)
    except GenerationFailed as exc:
        print(f'rank {torch.distributed.get_rank()}: request failed ({exc})', flush=True)
        return 'failed'
    return 'ok'


def run_generation_worker_loop(model, engine=None):
    """Loop of every rank but the server's: follow rank 0's work until it says stop."""
    while follow_one_request(model, engine) != 'stop':
        pass


class _LegacyJob:
    """A legacy request handed to the serving loop, and its outcome."""

    def __init__(self, prepared, step_callback, on_done):
        self.prepared = prepared
        self.step_callback = step_callback
        self.on_done = on_done
        self.done = threading.Event()
        self.result = None
        self.error = None


class ServingLoop(EngineLoop):
    """Rank 0's thread that does all of a server's collective work: engine steps (continuous
    batching of every engine request) and, between them, legacy requests one at a time.

    Args:
        engine (DynamicInferenceEngine): built on every rank with request_source_rank=0 (on a
            single rank: None) and isolate_failures=True.
        model: this rank's model (for the legacy path).
        heartbeat_s (float, optional): idle step interval; default HEARTBEAT_S with other ranks.
    """

    def __init__(self, engine, model, heartbeat_s=None):
        self.multi_rank = torch.distributed.get_world_size() > 1
        if heartbeat_s is None and self.multi_rank:
            heartbeat_s = HEARTBEAT_S
        super().__init__(engine, heartbeat_s=heartbeat_s)
        self.model = model
        self._legacy = queue.Queue()
        self._last_was_legacy = False

    def submit_legacy(self, prepared, step_callback=None, on_done=None):
        """Queue a prepared legacy request; returns its job (`done` is set once `result` or
        `error` is; `on_done()` is then called on the loop's thread)."""
        if self.error is not None or self._stop.is_set():
            raise RuntimeError(f"the inference engine is not running ({self.error or 'stopped'})")
        job = _LegacyJob(prepared, step_callback, on_done)
        self._legacy.put(job)
        self._wake.set()
        return job

    def run_legacy(self, prepared, step_callback=None):
        """Run a prepared legacy request on every rank, between engine steps.

        Returns:
            Its post-processed result (see `text_generation.api.run_prepared`).

        Raises:
            GenerationFailed: it failed on some rank (the server goes on).
            RuntimeError: the serving loop stopped or failed.
        """
        job = self.submit_legacy(prepared, step_callback)
        while not job.done.wait(1.0):
            if not self.running:
                raise RuntimeError(f"the serving loop stopped ({self.error or 'stopped'})")
        if job.error is not None:
            raise job.error
        return job.result

    def _has_work(self):
        return not self._legacy.empty() or super()._has_work()

    def _iterate(self):
        job = None
        # Legacy requests and engine steps alternate while both wait, so neither starves.
        if not (self._last_was_legacy and self.engine.has_unfinished_requests()):
            try:
                job = self._legacy.get_nowait()
            except queue.Empty:
                pass
        self._last_was_legacy = job is not None
        if job is None:
            if self.multi_rank:
                _send_choice(ENGINE_STEP_NUM)
            super()._iterate()
            return
        try:
            job.result = serve(self.model, job.prepared, step_callback=job.step_callback)
        except Exception as exc:  # the request's failure, reported to its client
            job.error = exc
        finally:
            _end_job(job)

    def _shutdown(self):
        if self.multi_rank:
            _send_choice(STOP_NUM)
        while not self._legacy.empty():
            job = self._legacy.get_nowait()
            job.error = RuntimeError("the serving loop was stopped")
            _end_job(job)


def _end_job(job):
    job.done.set()
    if job.on_done is not None:
        job.on_done()
