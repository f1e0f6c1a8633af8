"""`EngineLoop`: a background thread that drives a `DynamicInferenceEngine` for a server.

Request threads call `submit()` (validation errors raise there, before anything is queued) and
read the returned `RequestStream` (tokens as they are sampled, then the finished record); a
client that goes away calls `cancel()`, which frees the request's KV blocks at the next step.
The loop thread steps the engine while requests are pending and sleeps otherwise.

With several ranks (the engine built with `request_source_rank` = this rank), the other ranks run
`run_follower_loop(engine)`: every step starts with a broadcast of this rank's submissions, so the
loop keeps stepping every `heartbeat_s` even when idle (the followers wait inside that broadcast),
and `stop()` sends them a stop message.
"""

import queue
import threading
from typing import Iterator, List, Optional, Tuple

from megatron.core.inference.inference_request import DynamicInferenceRequest

_FINISHED = object()


class RequestStream:
    """The tokens of one request, as the engine samples them (thread safe, one reader).

    Args:
        request_id (str): the request.
        notify (queue.Queue, optional): also receives `request_id` whenever new tokens or the
            end arrive, so that one reader can follow many streams (`poll()` each one notified).
    """

    def __init__(self, request_id: str, notify: Optional["queue.Queue"] = None):
        self.request_id = request_id
        self._queue: "queue.Queue" = queue.Queue()
        self._done = threading.Event()
        self._notify = notify
        self._end_seen = False
        self.request: Optional[DynamicInferenceRequest] = None
        self.error: Optional[BaseException] = None

    def _put_tokens(self, tokens):
        for token in tokens:
            self._queue.put(token)
        if self._notify is not None:
            self._notify.put(self.request_id)

    def _finish(self, request=None, error=None):
        self.request, self.error = request, error
        self._queue.put(_FINISHED)
        self._done.set()
        if self._notify is not None:
            self._notify.put(self.request_id)

    def poll(self) -> Tuple[List[int], bool]:
        """(the tokens that arrived since the last poll, whether the request has finished),
        without waiting. After it finished, `result()` holds the record."""
        tokens = []
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return tokens, self._end_seen
            if item is _FINISHED:
                self._end_seen = True
                return tokens, True
            tokens.append(item)

    def __iter__(self) -> Iterator[int]:
        """Yield each new token id until the request finishes (raises the loop's error, if it
        died)."""
        while True:
            item = self._queue.get()
            if item is _FINISHED:
                if self.error is not None:
                    raise RuntimeError(f"the inference engine failed: {self.error}") from self.error
                return
            yield item

    def result(self, timeout: Optional[float] = None) -> DynamicInferenceRequest:
        """The finished request record (COMPLETED or CANCELLED); waits up to `timeout` s."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"request {self.request_id} did not finish within {timeout} s")
        if self.error is not None:
            raise RuntimeError(f"the inference engine failed: {self.error}") from self.error
        return self.request

    @property
    def finished(self) -> bool:
        return self._done.is_set()


class EngineLoop:
    """Steps `engine` in a daemon thread.

    Args:
        engine (DynamicInferenceEngine): the engine (on a multi-rank replica, built with
            `request_source_rank` set to this rank).
        heartbeat_s (float, optional): with other ranks following, step at least this often even
            when idle (default 5 s when the engine has a request_source_rank, else never).
    """

    def __init__(self, engine, heartbeat_s: Optional[float] = None):
        self.engine = engine
        if heartbeat_s is None and engine.request_source_rank is not None:
            heartbeat_s = 5.0
        self.heartbeat_s = heartbeat_s
        self._streams = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self.error: Optional[BaseException] = None

    def start(self) -> "EngineLoop":
        self._thread = threading.Thread(target=self._run, name="inference-engine-loop", daemon=True)
        self._thread.start()
        return self

    def submit(
        self, prompt, sampling_params=None, request_id=None, add_BOS=False, notify=None
    ) -> RequestStream:
        """Queue a request; returns its stream (`notify`: see RequestStream). Raises ValueError /
        QueueFullError at once for a request the engine refuses, RuntimeError once the loop has
        stopped or failed."""
        if self.error is not None or self._stop.is_set():
            raise RuntimeError(f"the inference engine is not running ({self.error or 'stopped'})")
        with self._lock:
            request_id = self.engine.add_request(prompt, sampling_params, request_id, add_BOS)
            stream = RequestStream(request_id, notify)
            self._streams[request_id] = stream
        self._wake.set()
        return stream

    def cancel(self, request_id: str) -> None:
        """Cancel a request (e.g. its client disconnected); its stream finishes as CANCELLED."""
        self.engine.cancel_request(request_id)
        self._wake.set()

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the loop (and, with followers, tell them to stop) and join it."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def running(self) -> bool:
        """Whether the loop thread is alive and has not failed."""
        return self._thread is not None and self._thread.is_alive() and self.error is None

    # Steps of the loop thread; a subclass may interleave other collective work (a server's
    # other request kinds) by overriding them.
    def _has_work(self) -> bool:
        return self.engine.has_unfinished_requests()

    def _iterate(self) -> None:
        """One unit of work (also the idle heartbeat): an engine step."""
        self._dispatch(self.engine.step())

    def _shutdown(self) -> None:
        """On stop: release the follower ranks."""
        if self.engine.request_source_rank is not None:
            self.engine.stop_followers()

    def _run(self):
        try:
            while not self._stop.is_set():
                if not self._has_work():
                    self._wake.wait(self.heartbeat_s)
                    self._wake.clear()
                    if self._stop.is_set():
                        break
                    if not self._has_work() and self.heartbeat_s is None:
                        continue
                self._iterate()
            self._shutdown()
            self._fail_streams(RuntimeError("the engine loop was stopped"))
        except BaseException as exc:  # fail every waiting client rather than leave it hanging
            self.error = exc
            self._fail_streams(exc)

    def _fail_streams(self, exc):
        with self._lock:
            streams, self._streams = list(self._streams.values()), {}
        for stream in streams:
            stream._finish(error=exc)

    def _dispatch(self, result):
        with self._lock:
            for request_id, tokens in result.new_tokens.items():
                stream = self._streams.get(request_id)
                if stream is not None:
                    stream._put_tokens(tokens)
            for request in result.finished_requests:
                stream = self._streams.pop(request.request_id, None)
                self.engine.requests.pop(request.request_id, None)
                if stream is not None:
                    stream._finish(request=request)


def run_follower_loop(engine) -> None:
    """Loop of the ranks that do not take requests: step until the source rank says stop."""
    while not engine.stopped:
        for request in engine.step().finished_requests:
            engine.requests.pop(request.request_id, None)
