"""`TextGenerationController`: tokenization, sampling, the static-batch generation loop and the
dynamic engine's packed step, on top of a model inference wrapper.

Static batch (`generate_all_output_tokens_static_batch`), the loop of Megatron's generate(): the
prompts are right-padded with the end-of-document id to max prompt + max tokens to generate; the
first forward feeds the shared prefix [0, shortest prompt), every later one a single column; rows
whose prompt is longer than the current column keep their prompt token. Each row stops at its
termination id, its stop sequences or its own num_tokens_to_generate; the loop ends when every
row has stopped. The tokens of a batch whose rows share one setting are exactly those of
Megatron's generate() (same forwards, same sampling draws).

Unlike core_r0.8.0: every row is sampled with its own settings (not the first request's); the
last pipeline stage samples and every other rank receives its tokens (stages never sample on
their own); log probs follow later megatron-core (generated tokens' log probs start at the last
prompt position; the prompt's are returned apart); prompts are not padded in place.
"""

from collections import OrderedDict
from typing import Dict, List, Optional, Sequence

import torch

from megatron.core.inference.communication_utils import share_last_stage_result
from megatron.core.inference.inference_request import InferenceRequest, Status
from megatron.core.inference.sampling import sample, sample_rows, token_log_probs
from megatron.core.inference.sampling_params import SamplingParams
from megatron.core.utils import get_current_device


def termination_id_of(params: SamplingParams, tokenizer) -> int:
    """The id that stops a request: its own, else the tokenizer's end-of-document id (-1: none)."""
    if params.termination_id is not None:
        return params.termination_id
    return tokenizer.eod


def ends_with_stop_sequence(tokens: Sequence[int], stop_token_ids) -> bool:
    """Whether `tokens` ends with one of the id sequences `stop_token_ids`."""
    for seq in stop_token_ids or ():
        if len(tokens) >= len(seq) and list(tokens[len(tokens) - len(seq) :]) == list(seq):
            return True
    return False


class TextGenerationController:
    """Turns prompts into generated tokens with a model inference wrapper.

    Args:
        inference_wrapped_model (AbstractModelInferenceWrapper): the model and its forward.
        tokenizer: has `tokenize(text) -> ids`, `detokenize(ids) -> text`, `eod` and
            `vocab_size` (Megatron's tokenizers do).
    """

    def __init__(self, inference_wrapped_model, tokenizer):
        self.inference_wrapped_model = inference_wrapped_model
        self.tokenizer = tokenizer

    # ---------------------------------------------------------------- tokens and text
    def tokenize_prompt(self, prompt: str, add_BOS: bool = False) -> List[int]:
        """The prompt's token ids (with add_BOS, the end-of-document id first, as Megatron's
        generate() does: GPT tokenizers have no BOS)."""
        tokens = self.tokenizer.tokenize(prompt)
        return [self.tokenizer.eod] + list(tokens) if add_BOS else list(tokens)

    def detokenize_generations(self, tokens) -> str:
        """Text of a list (or 1-D tensor) of token ids."""
        if isinstance(tokens, torch.Tensor):
            tokens = tokens.tolist()
        return self.tokenizer.detokenize(tokens)

    def sample_from_logits(
        self,
        last_token_logits: torch.Tensor,
        common_inference_params: SamplingParams,
        vocab_size: Optional[int] = None,
    ) -> torch.Tensor:
        """One token per row of last_token_logits [b, v], all rows with one setting (from the
        global random generator). Returns int64 [b]."""
        p = common_inference_params
        return sample(last_token_logits, p.top_k, p.top_p, p.temperature, vocab_size)

    def pad_input_prompt_tokens(
        self, batch_prompt_tokens_list: List[List[int]], max_tokens_to_generate: int
    ) -> torch.Tensor:
        """[b, max prompt + max_tokens_to_generate] int64, right-padded with the end-of-document
        id (the prompt lists are left unchanged)."""
        width = max(len(t) for t in batch_prompt_tokens_list) + max_tokens_to_generate
        rows = [list(t) + [self.tokenizer.eod] * (width - len(t)) for t in batch_prompt_tokens_list]
        return torch.tensor(rows, dtype=torch.long, device=get_current_device())

    # ---------------------------------------------------------------- static batching
    def generate_all_output_tokens_static_batch(
        self, active_requests: Dict[str, InferenceRequest]
    ) -> Dict[str, InferenceRequest]:
        """Generate every active request to completion as one padded batch; fills each
        request's generated_* fields and marks it COMPLETED. Returns the same requests."""
        requests = list(active_requests.values())
        params = [r.inference_parameters for r in requests]
        prompt_lengths = [len(r.prompt_tokens) for r in requests]
        wrapper = self.inference_wrapped_model
        device = get_current_device()
        batch_size = len(requests)
        max_new = max(p.num_tokens_to_generate for p in params)
        tokens = self.pad_input_prompt_tokens([r.prompt_tokens for r in requests], max_new)
        seq_length = tokens.size(1)
        lengths_t = torch.tensor(prompt_lengths, device=device)
        need_log_probs = any(p.return_log_probs for p in params)
        log_probs = None
        if need_log_probs and wrapper.is_last_stage():
            log_probs = torch.zeros(
                (batch_size, max(seq_length - 1, 0)), dtype=torch.float64, device=device
            )
        state = _StaticRowState(self, requests, params, prompt_lengths)

        with torch.no_grad():
            wrapper.prep_model_for_inference(tokens)
            # Sampling needs the last position only (unless log probs are asked for).
            wrapper.inference_params.materialize_only_last_token_logits = not need_log_probs
            start = 0
            for column in range(min(prompt_lengths), seq_length):
                if max_new == 0:
                    break
                logits = wrapper.run_one_forward_step(
                    wrapper.get_batch_for_context_window(start, column)
                )
                new_tokens = None
                if wrapper.is_last_stage():
                    new_tokens = sample_rows(
                        logits[:, -1, :], params, vocab_size=self.tokenizer.vocab_size
                    )
                new_tokens = share_last_stage_result(
                    (batch_size,),
                    torch.long,
                    new_tokens,
                    wrapper.pg_collection.tp,
                    wrapper.pg_collection.pp,
                    wrapper.pg_collection.ep,
                )
                started = lengths_t <= column
                tokens[started, column] = new_tokens[started]
                if log_probs is not None:
                    log_probs[:, start:column] = token_log_probs(
                        logits, tokens[:, start + 1 : column + 1]
                    )
                start = column
                if state.update(tokens, column):
                    break

        if need_log_probs:
            log_probs = share_last_stage_result(
                (batch_size, max(seq_length - 1, 0)),
                torch.float64,
                log_probs,
                wrapper.pg_collection.tp,
                wrapper.pg_collection.pp,
                wrapper.pg_collection.ep,
            )
        state.finish(tokens, log_probs)
        return active_requests

    def generate_output_tokens_dynamic_batch(self, *args, **kwargs):
        """The dynamic engine drives `dynamic_step` instead (see engines/dynamic_engine.py)."""
        raise NotImplementedError(
            "dynamic batching runs through DynamicInferenceEngine.step(), which calls "
            "TextGenerationController.dynamic_step"
        )

    # ---------------------------------------------------------------- dynamic batching
    def dynamic_step(self, context, rows) -> "OrderedDict[str, tuple]":
        """One packed forward of the dynamic engine and the samples of the requests that need one.

        Args:
            context (DynamicInferenceContext): the step's packed tokens (`step_input_ids`,
                `step_position_ids`) and which logit positions belong to which request.
            rows (list of (request_id, SamplingParams, torch.Generator, prompt log-prob
                targets or None, sample)): per scheduled request in the context's order; `sample`
                False for a prompt chunk that does not end its prompt.

        Returns:
            request_id -> (new token or None, its log prob or None, prompt log probs or None),
            identical on every rank of the model replica.
        """
        wrapper = self.inference_wrapped_model
        _check_expert_parallel_lockstep(context, wrapper.pg_collection.ep)
        logits = wrapper.forward_packed(context.step_input_ids, context.step_position_ids, context)
        sampled = [r for r in rows if r[4]]
        n = len(sampled)
        lp_targets = [(i, r) for i, r in enumerate(rows) if r[3] is not None]
        num_prompt_lp = sum(len(r[3]) for _, r in lp_targets)
        # Row 0: tokens, row 1: their log probs (as floats), then prompt log probs.
        payload = None
        if wrapper.is_last_stage():
            payload = self._sample_packed(logits[0], context, rows, sampled, lp_targets)
        payload = share_last_stage_result(
            (2 * n + num_prompt_lp,),
            torch.float64,
            payload,
            wrapper.pg_collection.tp,
            wrapper.pg_collection.pp,
            wrapper.pg_collection.ep,
        ).tolist()
        out = OrderedDict()
        k = 0
        for row in rows:
            out[row[0]] = [None, None, None]
        for row in sampled:
            out[row[0]][0] = int(payload[k])
            out[row[0]][1] = payload[n + k]
            k += 1
        offset = 2 * n
        for _, row in lp_targets:
            out[row[0]][2] = payload[offset : offset + len(row[3])]
            offset += len(row[3])
        return OrderedDict((key, tuple(v)) for key, v in out.items())

    def _sample_packed(self, logits, context, rows, sampled, lp_targets):
        """On the last stage: sample each request's next token from its last logit position,
        and the log probs asked for. logits [N, v] in the context's logit-position order."""
        device = logits.device
        last = [context.logit_slices[r[0]][1] - 1 for r in sampled]
        if sampled:
            last_logits = logits.index_select(0, torch.tensor(last, device=device))
            tokens = sample_rows(
                last_logits,
                [r[1] for r in sampled],
                vocab_size=self.tokenizer.vocab_size,
                generators=[r[2] for r in sampled],
            )
            if any(r[1].return_log_probs for r in sampled):
                lps = token_log_probs(last_logits, tokens)
            else:  # no log_softmax over the vocabulary when nobody asked for log probs
                lps = torch.zeros(len(sampled), device=device)
        else:
            tokens = torch.zeros(0, dtype=torch.long, device=device)
            lps = torch.zeros(0, device=device)
        parts = [tokens.double(), lps.double()]
        for _, row in lp_targets:
            start, end = context.logit_slices[row[0]]
            targets = torch.tensor(row[3], dtype=torch.long, device=device)
            # The chunk's positions predict its next prompt tokens (the last one predicts the
            # sample, whose log prob is in row 1).
            parts.append(token_log_probs(logits[start : start + len(row[3])], targets).double())
        return torch.cat(parts).contiguous()


def _check_expert_parallel_lockstep(context, ep_group) -> None:
    """Refuse a packed step that differs between the replicas of an expert-parallel group.

    Their tokens meet in the MoE layers' dispatch, so they must run the same steps (the same
    requests, e.g. submitted on one rank with the engine's `request_source_rank`): a replica
    with another number of tokens would fail or hang inside the dispatch, and one with other
    tokens would get the first replica's samples. One all-reduce of four integers per step.
    """
    if ep_group.size() == 1:
        return
    ids = context.step_input_ids.reshape(-1).long()
    positions = context.step_position_ids.reshape(-1).long()
    weights = torch.arange(1, ids.numel() + 1, device=ids.device)
    digest = int(((ids * 1_000_003 + positions) * weights).sum()) % (2**61 - 1)
    both = torch.tensor([ids.numel(), digest], dtype=torch.long, device=ids.device)
    extremes = torch.cat([both, -both])
    torch.distributed.all_reduce(extremes, op=torch.distributed.ReduceOp.MAX, group=ep_group)
    if not torch.equal(extremes[:2], -extremes[2:]):
        raise RuntimeError(
            f"expert-parallel replicas scheduled different steps ({ids.numel()} tokens here, "
            f"{-int(extremes[2])} to {int(extremes[0])} on the {ep_group.size()} ranks of the "
            "expert-parallel group, or other tokens): every replica of an expert-parallel group "
            "must be given the same requests (submit them on one rank with the engine's "
            "request_source_rank)"
        )


class _StaticRowState:
    """Per-row stop bookkeeping of a static batch."""

    def __init__(self, controller, requests, params, prompt_lengths):
        self.controller = controller
        self.requests = requests
        self.params = params
        self.prompt_lengths = prompt_lengths
        self.termination = [termination_id_of(p, controller.tokenizer) for p in params]
        self.generated = [0] * len(requests)
        self.done = [p.num_tokens_to_generate == 0 for p in params]

    def update(self, tokens: torch.Tensor, column: int) -> bool:
        """Account for the token written at `column`; True once every row has stopped. A row's
        termination id is not counted (nor returned), a stop sequence is."""
        column_tokens = tokens[:, column].tolist()
        for i, token in enumerate(column_tokens):
            if self.done[i] or self.prompt_lengths[i] > column:
                continue
            if token == self.termination[i]:
                self.done[i] = True
                continue
            self.generated[i] += 1
            p = self.params[i]
            start = self.prompt_lengths[i]
            stop_ids = p.stop_token_ids
            if self.generated[i] >= p.num_tokens_to_generate or (
                stop_ids
                and ends_with_stop_sequence(
                    tokens[i, start : start + self.generated[i]].tolist(), stop_ids
                )
            ):
                self.done[i] = True
        return all(self.done)

    def finish(self, tokens: torch.Tensor, log_probs: Optional[torch.Tensor]):
        for i, request in enumerate(self.requests):
            p_len, k = self.prompt_lengths[i], self.generated[i]
            request.generated_tokens = tokens[i, p_len : p_len + k].clone()
            request.generated_length = k
            request.generated_text = self.controller.detokenize_generations(
                request.generated_tokens
            )
            if log_probs is not None and self.params[i].return_log_probs:
                request.generated_log_probs = log_probs[i, p_len - 1 : p_len - 1 + k].tolist()
                if not self.params[i].skip_prompt_log_probs:
                    request.prompt_log_probs = log_probs[i, : p_len - 1].tolist()
            request.status = Status.COMPLETED
