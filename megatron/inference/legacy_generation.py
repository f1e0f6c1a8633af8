"""The OpenAI endpoints' generation under `--use-legacy-static-engine`: the request's prompts run
as one padded batch through Megatron's generate() loop (`text_generation/`), one request at a
time on the serving loop's thread, as the server did before the dynamic engine.

It follows the same interface as `generations.EngineGeneration`: after each generated column the
loop's step callback reports every row's new tokens; the generation ends early (every rank
follows rank 0's verdict, `GenerationSettings.host_stop`) once every choice met its end-of-text
token, `max_tokens` or a stop string, or when the client went away.
"""

import queue
from typing import Optional

from megatron.inference.generations import Choice, Generation, termination_id_of
from megatron.inference.text_generation.request import (
    SAMPLING,
    GenerationSettings,
    PreparedRequest,
    check_batch_size,
)
from megatron.inference.text_generation.tokenization import eod_id

_DONE = object()


def _settings(params) -> GenerationSettings:
    """One setting for the whole batch (the choices of a request share their sampling)."""
    p = params[0]
    return GenerationSettings(
        mode=SAMPLING,
        tokens_to_generate=max(q.num_tokens_to_generate for q in params),
        return_output_log_probs=p.return_log_probs,
        top_k_sampling=p.top_k,
        top_p_sampling=p.top_p,
        temperature=p.temperature,
        use_eod_token_for_early_termination=p.termination_id != -1,
        random_seed=-1 if p.random_seed is None else p.random_seed,
        host_stop=True,
    )


class LegacyGeneration(Generation):
    """The choices of one request as one legacy batch (see the module docstring).

    Raises:
        ValueError: settings or lengths Megatron's loop refuses (before anything runs).
    """

    def __init__(self, serving, prompts, params, stops=()):
        import torch

        from megatron.core.utils import get_current_device
        from megatron.training.global_vars import get_args

        tokenizer = serving.tokenizer
        self.choices = [
            Choice(ids, p.num_tokens_to_generate, stops, tokenizer, termination_id_of(p, tokenizer))
            for ids, p in zip(prompts, params)
        ]
        settings = _settings(params)
        settings.check(tokenizer.vocab_size)
        lengths = [len(ids) for ids in prompts]
        args = get_args()
        check_batch_size(settings, lengths, args.max_position_embeddings, args.max_tokens_to_oom)
        width = max(lengths) + settings.tokens_to_generate
        eod = eod_id(tokenizer)
        rows = [list(ids) + [eod] * (width - len(ids)) for ids in prompts]
        device = get_current_device()
        prepared = PreparedRequest(
            settings=settings,
            tokens=torch.tensor(rows, dtype=torch.long, device=device),
            lengths=torch.tensor(lengths, dtype=torch.long, device=device),
        )
        self._events: "queue.Queue" = queue.Queue()
        self._cancelled = False
        self._pending = []
        self._seen = [0] * len(prompts)
        self._job = serving.loop.submit_legacy(
            prepared, step_callback=self._on_step, on_done=lambda: self._events.put(_DONE)
        )

    def _on_step(self, tokens, context_length):
        """On the serving loop's thread after each column: report new tokens; True ends the
        loop on every rank (every choice done, or the client went away)."""
        ids = tokens[:, : context_length + 1].tolist()
        done = True
        for i, choice in enumerate(self.choices):
            generated = ids[i][len(choice.prompt_ids) :]
            if len(generated) > self._seen[i]:
                self._seen[i] = len(generated)
                self._events.put((i, generated))
            kept = generated[: choice.max_tokens]
            ended = len(kept) >= choice.max_tokens or choice.termination_id in kept
            if not ended and choice.stops:
                tail = choice.tokenizer.detokenize(kept[-choice._window :])
                ended = any(s in tail for s in choice.stops)
            done = done and ended
        return done or self._cancelled

    def next_update(self, timeout: Optional[float] = None) -> Optional[int]:
        while not self.finished:
            if self._pending:
                return self._finish_one(self._pending.pop(0))
            event = self._events.get(timeout=timeout)
            if event is _DONE:
                # Every choice ends with the batch (its result or error is set).
                self._pending = list(range(len(self.choices)))
                continue
            i, generated = event
            choice = self.choices[i]
            choice.generated = generated
            if not choice.stop_hit and choice.hits_stop_string():
                choice.stop_hit = True
            return i
        return None

    def _finish_one(self, i):
        choice = self.choices[i]
        choice.finished = True
        if self._job.error is not None:
            choice.end, choice.error = "error", str(self._job.error)
            return i
        _, _, log_probs, tokens = self._job.result
        start = len(choice.prompt_ids)
        choice.generated = list(tokens[i][start:])
        if log_probs is not None:
            # Megatron's entry k is log P(token k + 1 | tokens 0..k).
            choice.log_probs = list(log_probs[i][start - 1 :])
            choice.prompt_log_probs = list(log_probs[i][: start - 1])
        kept = choice.generated[: choice.max_tokens]
        if choice.stop_hit:
            choice.end = "stop_string"
        elif self.client_gone:
            choice.end = "cancelled"
        elif choice.termination_id in kept:
            choice.end = "stop"
        else:
            choice.end = "length"
        return i

    def cancel(self, client_gone: bool = False) -> None:
        self.client_gone = self.client_gone or client_gone
        self._cancelled = True
