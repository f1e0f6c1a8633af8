"""Request records: `Status`, `InferenceRequest` (core_r0.8.0's fields, in its order) and
`DynamicInferenceRequest` (the dynamic engine's, with per-token lists and timings)."""

from dataclasses import dataclass, field
from enum import Enum
from typing import List, Optional

import torch

from megatron.core.inference.sampling_params import SamplingParams


class Status(Enum):
    """Where a request is in its life."""

    WAITING_IN_QUEUE = 1
    ACTIVE_AND_GENERATING_TOKENS = 2
    ACTIVE_BUT_NOT_GENERATING_TOKENS = 3
    COMPLETED = 4
    FAILED = 5
    CANCELLED = 6


@dataclass
class InferenceRequest:
    """One prompt and what was generated for it.

    Attributes:
        request_id (str): id given by the scheduler / engine ("0", "1", ...).
        prompt (str): the prompt text.
        inference_parameters (SamplingParams): its sampling settings (every request may have
            its own).
        prompt_tokens (list of int): the tokenized prompt.
        arrival_time (float): `time.time()` when it was added.
        status (Status): see `Status`.
        generated_text (str): detokenized generated tokens (no prompt, no end-of-document).
        generated_tokens: generated token ids (static engine: int64 tensor, without the
            end-of-document token that stopped it, as core_r0.8.0).
        generated_log_probs: log P(generated token i | everything before), one per generated
            token (with return_log_probs).
        generated_length (int): number of generated tokens.
        prompt_log_probs: log P(prompt token k + 1 | prompt tokens 0..k), len(prompt) - 1 of
            them (with return_log_probs and not skip_prompt_log_probs).
    """

    request_id: str
    prompt: str
    inference_parameters: SamplingParams
    prompt_tokens: List[int]
    arrival_time: float
    status: Optional[Status] = None
    generated_text: Optional[str] = None
    generated_tokens: Optional[torch.Tensor] = None
    generated_log_probs: Optional[List[float]] = None
    generated_length: int = 0
    prompt_log_probs: Optional[List[float]] = None

    @property
    def sampling_params(self) -> SamplingParams:
        """Later megatron-core's name of `inference_parameters`."""
        return self.inference_parameters


@dataclass
class DynamicInferenceRequest(InferenceRequest):
    """A request of the dynamic engine.

    `generated_tokens` and `generated_log_probs` are lists that grow while the request runs; the
    token that stopped it (termination id or stop sequence) is kept in `generated_tokens` and
    left out of `generated_text`.

    Attributes:
        finish_reason (str): "length" (num_tokens_to_generate or the max sequence length
            reached), "stop" (termination id or a stop sequence), "cancelled", "error" (the
            step it was in failed, see `error`; engines built with isolate_failures), or None while
            running.
        time_first_token (float): `time.time()` when its first token was sampled.
        time_finished (float): `time.time()` when it finished.
        num_preemptions (int): times its KV blocks were taken back and its tokens recomputed.
        error (str): why it FAILED, if it did.
    """

    generated_tokens: List[int] = field(default_factory=list)
    generated_log_probs: Optional[List[float]] = None
    finish_reason: Optional[str] = None
    time_first_token: Optional[float] = None
    time_finished: Optional[float] = None
    num_preemptions: int = 0
    error: Optional[str] = None

    @property
    def finished(self) -> bool:
        return self.status in (Status.COMPLETED, Status.FAILED, Status.CANCELLED)
