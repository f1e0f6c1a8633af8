"""`DynamicInferenceEngine`: continuous batching over a paged KV cache (later megatron-core's
dynamic engine; this implementation is plain PyTorch and runs on CPUs as well as GPUs).

Every `step()`:
1. takes in the requests added and cancelled since the last step (from any thread; with
   `request_source_rank`, that rank's submissions are broadcast to every rank of the replica);
2. schedules: each running request gets its next tokens (one decode token, or the next chunk of
   its prompt), oldest first, within `max_tokens` tokens per step; then waiting requests are
   admitted in arrival order while rows (`max_requests`), tokens and KV blocks allow. A prompt
   longer than what is left of the token budget waits, or with chunked prefill runs in chunks;
3. when a running request needs a new block and none is free, the youngest running request is
   preempted: its blocks are freed and it goes back to the head of the queue with its prompt and
   generated tokens, which are recomputed when it is admitted again (so requests wait, they never
   fail for lack of memory; the oldest request always makes progress);
4. runs one packed forward of all scheduled tokens, samples each request that completed its
   pending tokens with its own settings and random generator, and retires finished requests
   (termination id, stop sequence, token budget), freeing their blocks.

Every rank of a model replica runs the same schedule; what the last pipeline stage samples is
broadcast to the others, so they never diverge.
"""

import collections
import threading
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Union

import torch

from megatron.core.inference.contexts.dynamic_context import StepChunk
from megatron.core.inference.engines.abstract_engine import AbstractEngine
from megatron.core.inference.inference_request import DynamicInferenceRequest, Status
from megatron.core.inference.sampling_params import SamplingParams
from megatron.core.inference.text_generation_controllers.text_generation_controller import (
    ends_with_stop_sequence,
    termination_id_of,
)
from megatron.core.inference.utils import Counter
from megatron.core.utils import get_current_device


class QueueFullError(RuntimeError):
    """add_request() found `max_waiting_requests` requests already waiting."""


@dataclass
class DynamicStepResult:
    """What one `step()` did.

    Attributes:
        active_request_ids: requests holding KV blocks after the step.
        finished_requests: requests that finished (or were cancelled) in this step.
        new_tokens: request id -> tokens appended to it in this step.
        step_time: seconds the step took.
        num_tokens: tokens in the packed forward (0: nothing ran).
        num_preempted: requests preempted in this step.
    """

    active_request_ids: List[str] = field(default_factory=list)
    finished_requests: List[DynamicInferenceRequest] = field(default_factory=list)
    new_tokens: Dict[str, List[int]] = field(default_factory=dict)
    step_time: float = 0.0
    num_tokens: int = 0
    num_preempted: int = 0


class _RequestState:
    """Engine-side state of one request."""

    def __init__(self, request, params, max_new_tokens, termination_id, generator):
        self.request = request
        self.params = params
        self.tokens = list(request.prompt_tokens)  # prompt + generated: what the KV must hold
        self.prompt_length = len(request.prompt_tokens)
        self.max_new_tokens = max_new_tokens
        self.termination_id = termination_id
        self.generator = generator
        self.computed = 0  # tokens of `tokens` in the KV cache
        self.collect_prompt_log_probs = params.return_log_probs and not params.skip_prompt_log_probs

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - self.prompt_length


def _refuse_batch_dependent_model(config) -> None:
    """Refuse a model whose output for one request depends on the others in its step.

    An MoE model with an expert capacity (`moe_expert_capacity_factor`) drops the tokens beyond
    each expert's capacity, ranked over all the tokens of the forward, i.e. of every request
    packed into the step: a request's output would change with its neighbours. Dropless MoE
    routes each token on its own and is served.
    """
    factor = getattr(config, "moe_expert_capacity_factor", None)
    if getattr(config, "num_moe_experts", None) and factor is not None:
        raise ValueError(
            f"dynamic batching: the MoE layers drop tokens beyond an expert capacity "
            f"(--moe-expert-capacity-factor {factor}), chosen among all the requests of a step, "
            "so a request's output would depend on the others; serve this model without "
            "--inference-dynamic-batching (static batches), or train it dropless"
        )


class DynamicInferenceEngine(AbstractEngine):
    """Continuous-batching engine.

    Args:
        text_generation_controller (TextGenerationController): its wrapper runs the model.
        context (DynamicInferenceContext): the paged KV cache and the step limits.
        enable_chunked_prefill (bool): split prompts longer than the step's remaining token
            budget into chunks (otherwise they wait for a step with room, and a prompt longer than
            max_tokens is refused).
        random_seed (int, optional): seeds the random generators of requests without their own
            random_seed (default: torch's initial seed, i.e. Megatron's --seed).
        max_waiting_requests (int, optional): add_request raises QueueFullError when this many
            requests already wait beyond the rows that are free (those start at the next step),
            so a burst that the next step admits is never refused.
        request_source_rank (int, optional): global rank whose add_request / cancel_request
            calls are broadcast to every rank of `sync_group` at each step (a server on one rank
            drives all ranks). None: every rank makes the same calls itself.
        sync_group: process group of that broadcast (default: the default group).
        isolate_failures (bool): an exception in a step's forward or sampling fails the requests
            of that step (status FAILED, `error` set, blocks freed) and the engine goes on with
            the others; with `request_source_rank`, the ranks of `sync_group` agree on whether
            any of them failed (one all-reduce per step), so they stay in step. Default False:
            the exception propagates (offline use).
    """

    def __init__(
        self,
        text_generation_controller,
        context,
        enable_chunked_prefill: bool = False,
        random_seed: Optional[int] = None,
        max_waiting_requests: Optional[int] = None,
        request_source_rank: Optional[int] = None,
        sync_group=None,
        isolate_failures: bool = False,
    ):
        _refuse_batch_dependent_model(context.config)
        self.controller = self.text_generation_controller = text_generation_controller
        self.context = context
        self.tokenizer = text_generation_controller.tokenizer
        self.enable_chunked_prefill = enable_chunked_prefill
        if random_seed is None:
            # Reproducible under Megatron's --seed, without advancing the global generator.
            random_seed = torch.initial_seed()
        self.random_seed = random_seed
        self.max_waiting_requests = max_waiting_requests
        self.request_source_rank = request_source_rank
        self.sync_group = sync_group
        self.isolate_failures = isolate_failures
        self.request_counter = Counter()
        self.requests: Dict[str, DynamicInferenceRequest] = {}
        self._states: Dict[str, _RequestState] = {}
        self.waiting: collections.deque = collections.deque()
        self.running: List[_RequestState] = []
        self._inbox: List[tuple] = []
        self._lock = threading.Lock()
        self.step_count = 0
        self.stopped = False

    # ------------------------------------------------------------------ submission
    def add_request(
        self,
        prompt: Union[str, Sequence[int], torch.Tensor],
        sampling_params: Optional[SamplingParams] = None,
        request_id: Optional[str] = None,
        add_BOS: bool = False,
        arrival_time: Optional[float] = None,
    ) -> str:
        """Queue a request (thread safe); it joins the next step.

        Args:
            prompt: text, or token ids.
            sampling_params: its settings (default SamplingParams(), i.e. sampling at
                temperature 1; num_tokens_to_generate None = up to max_sequence_length).
            request_id: its id (default "0", "1", ... in arrival order).
            add_BOS: prepend the end-of-document id.
            arrival_time: `time.time()` it arrived (default now).

        Returns:
            The request id.

        Raises:
            ValueError: bad settings, an empty prompt, or a request that can never fit (longer
                than max_sequence_length, more KV blocks than the cache has, or a prompt above
                max_tokens without chunked prefill), before anything is queued.
            QueueFullError: max_waiting_requests already waiting.
        """
        params = (
            sampling_params
            if sampling_params is not None
            else SamplingParams(num_tokens_to_generate=None)
        )
        if isinstance(prompt, str):
            text, tokens = prompt, self.controller.tokenize_prompt(prompt, add_BOS)
        else:
            tokens = [int(t) for t in (prompt.tolist() if torch.is_tensor(prompt) else prompt)]
            tokens = ([self.tokenizer.eod] if add_BOS else []) + tokens
            text = None
        max_new = self._check_request(tokens, params)
        with self._lock:
            self._check_queue()
            index = next(self.request_counter)
            if request_id is None:
                request_id = str(index)
            if request_id in self.requests:
                raise ValueError(f"request id {request_id!r} is already in use")
            entry = (
                "add",
                request_id,
                text,
                tokens,
                params,
                max_new,
                time.time() if arrival_time is None else arrival_time,
                self._seed_for(params, index),
            )
            self._make_state(entry)
            self._inbox.append(entry)
        return request_id

    def _check_queue(self) -> None:
        """QueueFullError when max_waiting_requests wait beyond the free rows (under the lock)."""
        if self.max_waiting_requests is None:
            return
        # Waiting beyond the free rows = live requests - rows. Only add_request (under this lock)
        # adds a live request, so the count cannot be overtaken by a burst; moves between the
        # inbox, the queue and the running rows (the step thread, without the lock) leave it as
        # it is.
        beyond_rows = len(self._states) - self.context.max_requests
        if beyond_rows >= self.max_waiting_requests:
            raise QueueFullError(
                f"{beyond_rows} requests are already waiting for a free row (at most "
                f"{self.max_waiting_requests} may wait, {self.context.max_requests} run at "
                "once)"
            )

    def cancel_request(self, request_id: str) -> None:
        """Cancel a waiting or running request (thread safe): at the next step its blocks are
        freed and it finishes as CANCELLED. Unknown or finished requests are ignored."""
        with self._lock:
            self._inbox.append(("cancel", request_id))

    def stop_followers(self) -> None:
        """On the request source rank: make the other ranks' `run_follower_loop` return (sends a
        stop message with one last step)."""
        with self._lock:
            self._inbox.append(("stop",))
        self.step()

    def _seed_for(self, params: SamplingParams, index: int) -> int:
        if params.random_seed is not None:
            return int(params.random_seed)
        return (self.random_seed + 1_000_003 * (index + 1)) % (2**63)

    def _check_request(self, tokens: List[int], params: SamplingParams) -> int:
        """Validate; returns the most tokens the request may generate."""
        params.validate(self.tokenizer.vocab_size)
        ctx = self.context
        if len(tokens) == 0:
            raise ValueError("the prompt is empty: pass add_BOS=True to start from the EOD id")
        if len(tokens) >= ctx.max_sequence_length:
            raise ValueError(
                f"prompt of {len(tokens)} tokens leaves no room to generate: "
                f"max_sequence_length is {ctx.max_sequence_length}"
            )
        max_new = params.num_tokens_to_generate
        if max_new is None:
            max_new = ctx.max_sequence_length - len(tokens)
        if len(tokens) + max_new > ctx.max_sequence_length:
            raise ValueError(
                f"prompt ({len(tokens)} tokens) + num_tokens_to_generate ({max_new}) exceeds "
                f"max_sequence_length ({ctx.max_sequence_length})"
            )
        # The last generated token is never fed back, so it needs no KV slot.
        need = ctx.blocks_for(len(tokens) + max(max_new - 1, 0))
        if need > ctx.num_blocks:
            raise ValueError(
                f"prompt ({len(tokens)} tokens) + num_tokens_to_generate ({max_new}) needs "
                f"{need} KV blocks of {ctx.block_size_tokens} tokens, the cache has "
                f"{ctx.num_blocks}: raise the KV cache size"
            )
        if not self.enable_chunked_prefill and len(tokens) > ctx.max_tokens:
            raise ValueError(
                f"prompt of {len(tokens)} tokens exceeds the {ctx.max_tokens} tokens of one step "
                "(--inference-dynamic-batching-max-tokens): enable chunked prefill "
                "(--enable-chunked-prefill) or raise max_tokens"
            )
        return max_new

    def _make_state(self, entry) -> _RequestState:
        _, request_id, text, tokens, params, max_new, arrival, seed = entry
        request = DynamicInferenceRequest(
            request_id=request_id,
            prompt=text,
            inference_parameters=params,
            prompt_tokens=list(tokens),
            arrival_time=arrival,
            status=Status.WAITING_IN_QUEUE,
        )
        if params.return_log_probs:
            request.generated_log_probs = []
            if not params.skip_prompt_log_probs:
                request.prompt_log_probs = []
        generator = torch.Generator(device=get_current_device())
        generator.manual_seed(seed)
        state = _RequestState(
            request, params, max_new, termination_id_of(params, self.tokenizer), generator
        )
        self.requests[request_id] = request
        self._states[request_id] = state
        return state

    def _take_inbox(self) -> List[tuple]:
        with self._lock:
            inbox, self._inbox = self._inbox, []
        if self.request_source_rank is None:
            return inbox
        group_size = torch.distributed.get_world_size(self.sync_group)
        if group_size == 1:
            return inbox
        is_source = torch.distributed.get_rank() == self.request_source_rank
        holder = [inbox if is_source else None]
        torch.distributed.broadcast_object_list(
            holder, src=self.request_source_rank, group=self.sync_group
        )
        if not is_source:
            inbox = holder[0]
            for entry in inbox:
                if entry[0] == "add":
                    self._make_state(entry)
        return inbox

    # ------------------------------------------------------------------ status
    def has_unfinished_requests(self) -> bool:
        """Whether any request is waiting, running or not yet taken in."""
        return bool(self.waiting or self.running or self._inbox)

    def get_request(self, request_id: str) -> DynamicInferenceRequest:
        return self.requests[request_id]

    def stats(self) -> dict:
        """Queue and cache occupancy (cheap; for logs and health checks)."""
        ctx = self.context
        return {
            "waiting": len(self.waiting) + len(self._inbox),
            "running": len(self.running),
            "free_blocks": ctx.block_allocator.total_avail,
            "total_blocks": ctx.num_blocks,
            "steps": self.step_count,
        }

    # ------------------------------------------------------------------ scheduling
    def _preempt(self, state: _RequestState) -> None:
        """Free `state`'s blocks and queue it first, to be recomputed when readmitted."""
        self.context.release(state.request_id)
        self.running.remove(state)
        state.computed = 0
        if state.collect_prompt_log_probs:
            state.request.prompt_log_probs = []  # collected again while recomputing
        state.request.status = Status.WAITING_IN_QUEUE
        state.request.num_preemptions += 1
        self.waiting.appendleft(state)

    def _chunk(self, state: _RequestState, budget: int) -> int:
        """Tokens of `state` to run this step within `budget` (0: it must wait)."""
        pending = len(state.tokens) - state.computed
        if pending <= budget:
            return pending
        # A preempted request's recompute may be chunked in any case: prompt + generated tokens
        # can exceed one step.
        chunked = self.enable_chunked_prefill or state.request.num_preemptions > 0
        return budget if chunked else 0

    def _schedule(self):
        """This step's (state, number of tokens) in packing order; preempts when short of
        blocks."""
        ctx = self.context
        budget = ctx.max_tokens
        plan = []
        preempted = 0
        i = 0
        while i < len(self.running):
            state = self.running[i]
            n = self._chunk(state, budget)
            if n == 0:
                i += 1
                continue
            while not ctx.grow(state.request_id, state.computed + n):
                victim = self.running[-1]
                self._preempt(victim)
                preempted += 1
                if victim is state:
                    break
            if state.request.status == Status.WAITING_IN_QUEUE:
                break  # it preempted itself: the requests after it are gone too
            plan.append((state, n))
            budget -= n
            i += 1
        while self.waiting and len(self.running) < ctx.max_requests and budget > 0:
            state = self.waiting[0]
            n = self._chunk(state, budget)
            if n == 0 or not ctx.grow(state.request_id, n):
                break  # first come, first served: nobody overtakes the head of the queue
            self.waiting.popleft()
            self.running.append(state)
            state.request.status = Status.ACTIVE_AND_GENERATING_TOKENS
            plan.append((state, n))
            budget -= n
        return plan, preempted

    def _step_rows(self, plan):
        """Context chunks and controller rows of a plan."""
        chunks, rows = [], []
        for state, n in plan:
            start, end = state.computed, state.computed + n
            sample = end == len(state.tokens) and state.num_generated < state.max_new_tokens
            targets = None
            if state.collect_prompt_log_probs:
                targets = state.tokens[start + 1 : min(end + 1, state.prompt_length)]
            mode = "all" if targets is not None else ("last" if sample else "none")
            chunks.append(StepChunk(state.request_id, state.tokens[start:end], start, mode))
            rows.append((state.request_id, state.params, state.generator, targets, sample))
        return chunks, rows

    # ------------------------------------------------------------------ stepping
    def step(self) -> DynamicStepResult:
        """Admit, run one packed forward, sample, retire. Every rank of the model replica calls
        it (a server's background loop calls it while requests are pending)."""
        t0 = time.time()
        result = DynamicStepResult()
        for entry in self._take_inbox():
            if entry[0] == "add":
                self.waiting.append(self._states[entry[1]])
            elif entry[0] == "cancel":
                self._cancel(entry[1], result)
            else:
                self.stopped = True
        plan, result.num_preempted = self._schedule()
        if plan:
            outputs, error = self._run_plan(plan)
            result.num_tokens = sum(n for _, n in plan)
            now = time.time()
            if error is not None:
                for state, _ in plan:
                    state.request.error = error
                    self._finish(state, "error", now, result, status=Status.FAILED)
            else:
                for state, n in plan:
                    sampled = outputs[state.request_id][0] is not None
                    self._account(state, n, sampled, outputs[state.request_id], now, result)
            self.step_count += 1
        result.active_request_ids = [s.request_id for s in self.running]
        result.step_time = time.time() - t0
        return result

    def _run_plan(self, plan):
        """The packed forward and samples of a plan: (outputs, None), or with isolate_failures
        (None, error message) when it raised here or on another rank of the replica."""
        chunks, rows = self._step_rows(plan)
        if not self.isolate_failures:
            self.context.build_step(chunks)
            with torch.no_grad():
                return self.controller.dynamic_step(self.context, rows), None
        outputs, error = None, None
        try:
            self.context.build_step(chunks)
            with torch.no_grad():
                outputs = self.controller.dynamic_step(self.context, rows)
        except Exception as exc:  # the step's requests fail; the engine goes on
            error = f"{type(exc).__name__}: {exc}"
        if self.request_source_rank is not None:
            failed = torch.tensor(
                [int(error is not None)], dtype=torch.int32, device=get_current_device()
            )
            torch.distributed.all_reduce(
                failed, op=torch.distributed.ReduceOp.MAX, group=self.sync_group
            )
            if failed.item() and error is None:
                error = "the step failed on another rank (see its log)"
        if error is not None:
            print(
                f"rank {torch.distributed.get_rank() if torch.distributed.is_initialized() else 0}"
                f": inference step failed, its {len(plan)} request(s) fail: {error}",
                flush=True,
            )
            return None, error
        return outputs, None

    def _account(self, state, n, sampled, output, now, result):
        """Book one request's part of the step: its cached tokens, its sample, its stop."""
        token, log_prob, prompt_log_probs = output
        request = state.request
        state.computed += n
        if prompt_log_probs is not None:
            request.prompt_log_probs.extend(prompt_log_probs)
            if state.computed >= state.prompt_length:
                state.collect_prompt_log_probs = False
        if not sampled:
            if state.computed == len(state.tokens) and state.max_new_tokens == 0:
                self._finish(state, "length", now, result)  # scoring only
            return
        state.tokens.append(token)
        request.generated_tokens.append(token)
        request.generated_length = state.num_generated
        if request.generated_log_probs is not None:
            request.generated_log_probs.append(log_prob)
        if request.time_first_token is None:
            request.time_first_token = now
        result.new_tokens[state.request_id] = [token]
        if token == state.termination_id:
            self._finish(state, "stop", now, result)
        elif ends_with_stop_sequence(request.generated_tokens, state.params.stop_token_ids):
            self._finish(state, "stop", now, result)
        elif state.num_generated >= state.max_new_tokens:
            self._finish(state, "length", now, result)

    def _finish(self, state, reason, now, result, status=Status.COMPLETED):
        request = state.request
        self.context.release(state.request_id)
        if state in self.running:
            self.running.remove(state)
        request.status = status
        request.finish_reason = reason
        request.time_finished = now
        tokens = request.generated_tokens
        if reason == "stop" and tokens and tokens[-1] == state.termination_id:
            tokens = tokens[:-1]
        request.generated_text = self.controller.detokenize_generations(tokens)
        del self._states[state.request_id]
        result.finished_requests.append(request)

    def _cancel(self, request_id, result):
        state = self._states.get(request_id)
        if state is None:
            return
        if state in self.waiting:
            self.waiting.remove(state)
        self._finish(state, "cancelled", time.time(), result, status=Status.CANCELLED)

    # ------------------------------------------------------------------ offline use
    def generate(
        self,
        prompts: Sequence[Union[str, Sequence[int]]],
        sampling_params: Optional[Union[SamplingParams, Sequence[SamplingParams]]] = None,
        add_BOS: bool = False,
    ) -> List[DynamicInferenceRequest]:
        """Add every prompt, step until they are all finished, return them in prompt order."""
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(
                f"got {len(sampling_params)} sampling params for {len(prompts)} prompts"
            )
        ids = [self.add_request(p, sp, add_BOS=add_BOS) for p, sp in zip(prompts, sampling_params)]
        while any(not self.requests[i].finished for i in ids):
            self.step()
        return [self.requests.pop(i) for i in ids]
