"""Generation with images on a vision-language (LLaVA) server: one request at a time on every
rank, modelled on the legacy generate() path.

Rank 0's `VLMLoop` thread owns the collectives. For each request it sends the choice
`VLM_GENERATE_NUM`, then broadcasts the settings, the prompt ids (image placeholders included)
and the preprocessed images [n, 3, H, W]; every rank then runs `LLaVAModel`'s KV-cache decode
(the prompt step runs the ViT and fills the cache with the text and image tokens, later steps
feed one token). After each step rank 0 broadcasts the token it sampled and whether to stop
(end-of-text, max tokens, a stop string, a client gone), so every rank feeds the same token and
stops together. A generation that raises on any rank ends on all of them (`GenerationFailed`,
agreed by an all-reduce) and the server goes on. While idle the loop sends `IDLE_NUM` every
`HEARTBEAT_S` so that waiting ranks never reach the process group's timeout.

The language model's logits are vocabulary-parallel (the model is built as pretrain_vlm.py
builds it); each step all-gathers the last position's logits over the tensor-parallel group.
"""

import dataclasses
import queue
import threading
from typing import List, Optional

import torch

from megatron.core.utils import get_current_device
from megatron.inference.generations import Choice, Generation, termination_id_of
from megatron.inference.text_generation.api import GenerationFailed
from megatron.inference.text_generation.communication import (
    broadcast_float64_list,
    broadcast_int64_list,
    broadcast_tensor,
    failed_ranks,
)
from megatron.inference.text_generation.sampling import sample

_DONE = object()


@dataclasses.dataclass
class VLMRequest:
    """One prompt with its images, as every rank runs it.

    Attributes:
        ids (list of int): prompt ids; each image is one placeholder id.
        images (Tensor): [n, 3, H, W] float32 preprocessed images (n = the placeholders).
        max_tokens (int): most tokens to generate (>= 1).
        termination_id (int): the id that ends the generation (-1: none).
        top_k, top_p, temperature: sampling (top_k 1: greedy).
        seed (int): torch's seed on every rank before sampling (-1: unset).
        return_log_probs (bool): log probabilities of the generated tokens.
    """

    ids: List[int]
    images: torch.Tensor
    max_tokens: int
    termination_id: int = -1
    top_k: int = 0
    top_p: float = 0.0
    temperature: float = 1.0
    seed: int = -1
    return_log_probs: bool = False


def broadcast_request(request: Optional[VLMRequest]) -> VLMRequest:
    """Rank 0 passes its request, every other rank None; every rank gets rank 0's."""
    device = get_current_device()
    header = None
    if request is not None:
        n, c, h, w = request.images.shape
        header = [len(request.ids), n, c, h, w, request.max_tokens, request.termination_id,
                  request.top_k, request.seed, int(request.return_log_probs)]  # fmt: skip
    length, n, c, h, w, max_tokens, term, top_k, seed, logp = broadcast_int64_list(10, header)
    floats = broadcast_float64_list(
        2, None if request is None else [request.top_p, request.temperature]
    )
    ids = broadcast_tensor(
        length,
        torch.int64,
        None if request is None else torch.tensor(request.ids, dtype=torch.int64, device=device),
    )
    images = None
    if n:
        mine = None if request is None else request.images.to(device, torch.float32).contiguous()
        images = broadcast_tensor((n, c, h, w), torch.float32, mine)
    return VLMRequest(
        ids=ids.tolist(), images=images if images is not None else torch.zeros(0, c, h, w),
        max_tokens=max_tokens, termination_id=term, top_k=top_k, top_p=floats[0],
        temperature=floats[1], seed=seed, return_log_probs=bool(logp),
    )  # fmt: skip


def combined_length(model, ids) -> int:
    """Positions the language model sees for `ids`: each placeholder is the image's tokens."""
    images = sum(1 for t in ids if t == model.image_token_index)
    return len(ids) + images * (model.img_seq_len - 1)


def _last_logits(model, logits, vocab_size):
    """[b, S, v/p] -> the last position's full-vocabulary fp32 logits [1, v]."""
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

    last = logits[:, -1].float()  # [1, v/p]
    tp = model.language_model.pg_collection.tp
    if tp is not None and tp.size() > 1:
        last = gather_from_tensor_model_parallel_region(last, group=tp)  # [1, v]
    return last[:, :vocab_size]


def _agree_on_token(token: int, stop: bool):
    """Rank 0's sampled token and stop verdict, on every rank."""
    token, stop = broadcast_int64_list(2, [token, int(stop)])
    return token, bool(stop)


def decode(model, request: VLMRequest, vocab_size: int, step_callback=None):
    """Every rank: the cached greedy / sampled decode of one request.

    Collectives per step, after the model's forward (which runs its own TP collectives): an
    all-gather of the last position's vocabulary-parallel logits over the tensor-parallel
    group, then a broadcast from rank 0 over the default group of the token and the verdict.

    Args:
        model (LLaVAModel): in eval mode.
        request (VLMRequest): the same on every rank.
        vocab_size (int): the tokenizer's vocabulary (padding ids are never sampled).
        step_callback: rank 0 only: called with the generated ids after each token; True stops.

    Returns:
        (generated ids, their log probabilities or None).
    """
    from megatron.core.inference_params import InferenceParams

    device = get_current_device()
    ids = torch.tensor([request.ids], dtype=torch.long, device=device)  # [1, s]
    images = request.images.to(device) if request.images.shape[0] else None
    params = InferenceParams(1, combined_length(model, request.ids) + request.max_tokens)
    learned = model.language_model.position_embedding_type == 'learned_absolute'
    if request.seed != -1:
        torch.random.manual_seed(request.seed)
    generated, log_probs = [], []
    with torch.no_grad():
        logits, _ = model(images, ids, None, None, inference_params=params)
        params.sequence_len_offset += logits.shape[1]
        while True:
            last = _last_logits(model, logits, vocab_size)
            token = int(sample(last, request.top_k, request.top_p, request.temperature,
                               vocab_size)[0])  # fmt: skip
            generated.append(token)
            stop = token == request.termination_id or len(generated) >= request.max_tokens
            if step_callback is not None and not stop:
                stop = bool(step_callback(generated))
            token, stop = _agree_on_token(token, stop)
            generated[-1] = token
            if request.return_log_probs:
                log_probs.append(float(torch.log_softmax(last, dim=-1)[0, token]))
            if stop:
                break
            # Learned absolute positions count the text only; RoPE continues from the offset.
            position = None
            if learned:
                position = torch.tensor([[len(request.ids) + len(generated) - 1]], device=device)
            step = torch.tensor([[token]], dtype=torch.long, device=device)
            logits, _ = model(None, step, position, None, inference_params=params)
            params.sequence_len_offset += 1
    return generated, (log_probs if request.return_log_probs else None)


def run_vlm_request(model, vocab_size, request=None, step_callback=None):
    """Every rank (rank 0 passes the request): broadcast, decode, agree on failure.

    Raises:
        GenerationFailed: the decode raised on some rank (every rank raises it).
    """
    request = broadcast_request(request)
    error, result = None, None
    try:
        result = decode(model, request, vocab_size, step_callback)
    except Exception as exc:  # reported on every rank below, so that the ranks stay in step
        error = exc
        print(
            f'rank {torch.distributed.get_rank()}: generation failed: {type(exc).__name__}: {exc}',
            flush=True,
        )
    ranks = failed_ranks(error is not None)
    if ranks:
        message = (
            f'generation failed: {type(error).__name__}: {error}'
            if error is not None
            else f'generation failed on rank(s) {ranks} (see their log)'
        )
        raise GenerationFailed(message, ranks) from error
    return result


class _Job:
    def __init__(self, request, step_callback, on_done):
        self.request = request
        self.step_callback = step_callback
        self.on_done = on_done
        self.result = None
        self.error = None


class VLMLoop:
    """Rank 0's thread doing every collective of a vision-language server: one request at a
    time, heartbeats while idle.

    Args:
        model (LLaVAModel): this rank's model.
        vocab_size (int): the tokenizer's vocabulary.
        heartbeat_s (float): idle interval between IDLE_NUM choices (multi-rank only).
    """

    def __init__(self, model, vocab_size, heartbeat_s=None):
        from megatron.inference.worker_protocol import HEARTBEAT_S

        self.model = model
        self.vocab_size = vocab_size
        self.multi_rank = torch.distributed.get_world_size() > 1
        self.heartbeat_s = HEARTBEAT_S if heartbeat_s is None else heartbeat_s
        self.error = None
        self._jobs: "queue.Queue" = queue.Queue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name='vlm-serving-loop', daemon=True)

    def start(self) -> "VLMLoop":
        self._thread.start()
        return self

    @property
    def running(self) -> bool:
        return self._thread.is_alive() and self.error is None and not self._stop.is_set()

    def submit(self, request, step_callback=None, on_done=None):
        """Queue a request; `on_done()` runs on the loop's thread once `result` or `error` is
        set on the returned job."""
        if not self.running:
            raise RuntimeError(f"the serving loop is not running ({self.error or 'stopped'})")
        job = _Job(request, step_callback, on_done)
        self._jobs.put(job)
        return job

    def stop(self, timeout: float = 30.0) -> None:
        self._stop.set()
        self._thread.join(timeout)

    def _run(self):
        from megatron.inference.worker_protocol import (
            IDLE_NUM,
            STOP_NUM,
            VLM_GENERATE_NUM,
            _send_choice,
        )

        try:
            while not self._stop.is_set():
                try:
                    job = self._jobs.get(timeout=self.heartbeat_s if self.multi_rank else 0.5)
                except queue.Empty:
                    if self.multi_rank:
                        _send_choice(IDLE_NUM)
                    continue
                try:
                    if self.multi_rank:
                        _send_choice(VLM_GENERATE_NUM)
                    job.result = run_vlm_request(
                        self.model, self.vocab_size, job.request, job.step_callback
                    )
                except Exception as exc:  # the request's failure, reported to its client
                    job.error = exc
                finally:
                    if job.on_done is not None:
                        job.on_done()
            if self.multi_rank:
                _send_choice(STOP_NUM)
        except BaseException as exc:  # a collective broke: the server stops serving
            self.error = exc
            raise
        finally:
            self._fail_waiting()

    def _fail_waiting(self):
        """Jobs still queued when the loop ends get an error (their clients stop waiting)."""
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                return
            job.error = RuntimeError(f"the serving loop stopped ({self.error or 'stopped'})")
            if job.on_done is not None:
                job.on_done()


class VLMGeneration(Generation):
    """The choices of one request (one prompt each, with its images) run one after another on
    the `VLMLoop`; the same interface as `EngineGeneration` (streaming included).

    Args:
        serving (VLMServing): the loop, the tokenizer and the model's image geometry.
        prompts (list of list of int): prompt ids (placeholders included).
        params (list of SamplingParams): one per prompt.
        stops (list of str): stop strings.
        images (list of Tensor): [n_i, 3, H, W] per prompt.
    """

    def __init__(self, serving, prompts, params, stops=(), images=None):
        tokenizer = serving.tokenizer
        images = images or [None] * len(prompts)
        self.choices = [
            Choice(ids, p.num_tokens_to_generate, stops, tokenizer, termination_id_of(p, tokenizer))
            for ids, p in zip(prompts, params)
        ]
        self._events: "queue.Queue" = queue.Queue()
        self._cancelled = False
        # Every prompt is checked before any runs.
        requests = [serving.request(*each) for each in zip(self.choices, params, images)]
        self._jobs = []
        for i, request in enumerate(requests):
            self._jobs.append(
                serving.loop.submit(
                    request,
                    step_callback=lambda ids, i=i: self._on_step(i, ids),
                    on_done=lambda i=i: self._events.put((_DONE, i)),
                )
            )

    def _on_step(self, i, generated):
        """On the loop's thread after each token of choice i: report it; True stops."""
        choice = self.choices[i]
        self._events.put((i, list(generated)))
        ended = False
        if choice.stops:
            tail = choice.tokenizer.detokenize(generated[-choice._window :])
            ended = any(s in tail for s in choice.stops)
        return ended or self._cancelled

    def next_update(self, timeout: Optional[float] = None) -> Optional[int]:
        while not self.finished:
            kind, value = self._events.get(timeout=timeout)
            if kind is _DONE:
                return self._finish_one(value)
            choice = self.choices[kind]
            choice.generated = value
            if not choice.stop_hit and choice.hits_stop_string():
                choice.stop_hit = True
            return kind
        return None

    def _finish_one(self, i):
        choice, job = self.choices[i], self._jobs[i]
        choice.finished = True
        if job.error is not None:
            choice.end, choice.error = "error", str(job.error)
            return i
        choice.generated, choice.log_probs = job.result
        if choice.stop_hit or choice.hits_stop_string():
            choice.end = "stop_string"
        elif self.client_gone:
            choice.end = "cancelled"
        elif choice.termination_id in choice.generated:
            choice.end = "stop"
        else:
            choice.end = "length"
        return i

    def cancel(self, client_gone: bool = False) -> None:
        self.client_gone = self.client_gone or client_gone
        self._cancelled = True
