"""One HTTP request's generation on the serving loop: one choice per prompt, followed while the
engine samples them.

`EngineGeneration` submits every prompt of a request to the dynamic-batching engine (each one is
an engine request, batched with everything else that runs) and follows their streams with one
reader: `next_update()` returns the index of the choice that just changed. It ends a choice as
soon as one of the request's stop strings appears in its text (the engine request is cancelled,
which frees its KV blocks at the next step) and `cancel()` ends them all (a client that went
away). `Choice.completion()` gives what is returned: the text up to the end-of-text token, the
first stop string or max_tokens, the token ids that make up that text, and the finish reason.
"""

import queue
from typing import List, Optional, Sequence

from megatron.core.inference.inference_request import Status


class Choice:
    """One prompt's generation as it progresses.

    Attributes:
        prompt_ids (list of int): the prompt's tokens (as the engine got them).
        generated (list of int): the tokens sampled so far (the end-of-text token included when
            it came; a few tokens past a stop string may follow it).
        log_probs (list of float): log probabilities of `generated` (when asked for), at the end.
        prompt_log_probs (list of float): of the prompt tokens 1.. (when asked for), at the end.
        finished (bool): no more tokens come.
        end (str): how the engine request ended: "stop" (end-of-text or stop token), "length",
            "stop_string", "cancelled" (the client went away), "error".
        error (str): why it failed (end == "error").
        emitted (int): characters of its text already streamed.
    """

    def __init__(self, prompt_ids, max_tokens, stops, tokenizer, termination_id):
        self.prompt_ids = list(prompt_ids)
        self.max_tokens = max_tokens
        self.stops = [s for s in stops if s]
        self.tokenizer = tokenizer
        self.termination_id = termination_id
        self.generated: List[int] = []
        self.log_probs: Optional[List[float]] = None
        self.prompt_log_probs: Optional[List[float]] = None
        self.finished = False
        self.end: Optional[str] = None
        self.error: Optional[str] = None
        self.emitted = 0
        self.stop_hit = False
        # Tokens that can hold the longest stop string (a token holds at least one character
        # once its neighbours complete it).
        self._window = max((len(s) for s in self.stops), default=0) + 4

    def hits_stop_string(self) -> bool:
        """Whether a stop string appeared in the text (only the tail that can hold one is
        detokenized)."""
        if not self.stops or not self.generated:
            return False
        tail = self.tokenizer.detokenize(self._kept_ids()[-self._window :])
        return any(s in tail for s in self.stops)

    def _kept_ids(self) -> List[int]:
        generated = self.generated[: self.max_tokens]
        if self.termination_id in generated:
            generated = generated[: generated.index(self.termination_id)]
        return generated

    def completion(self):
        """(text, the generated ids that make up that text, finish reason or None while it runs):
        "stop" for the end-of-text token or a stop string, "length" at max_tokens."""
        generated = self.generated[: self.max_tokens]
        finish = "length" if len(generated) == self.max_tokens else None
        if self.termination_id in generated:
            generated = generated[: generated.index(self.termination_id)]
            finish = "stop"
        elif self.finished and self.end == "stop":
            finish = "stop"  # a stop token sequence of the engine request
        text = self.tokenizer.detokenize(generated) if generated else ""
        cut = min((text.find(s) for s in self.stops if s in text), default=-1)
        if cut >= 0:
            text = text[:cut]
            finish = "stop"
            generated = generated[: self._tokens_for(generated, cut)]
        if finish is None and self.finished:
            finish = "length"
        return text, generated, finish

    def _tokens_for(self, generated, chars):
        """The fewest leading tokens whose text covers `chars` characters."""
        for k in range(len(generated) + 1):
            if len(self.tokenizer.detokenize(generated[:k])) >= chars:
                return k
        return len(generated)

    def safe_prefix(self, text, finish):
        """How much of `text` can be streamed now: not a trailing partial UTF-8 character, nor a
        tail that may still become a stop string."""
        if finish is not None:
            return len(text)
        end = len(text.rstrip("\ufffd"))
        for s in self.stops:
            for k in range(min(len(s) - 1, end), 0, -1):
                if text[:end].endswith(s[:k]):
                    end -= k
                    break
        return max(end, self.emitted)


class Generation:
    """The choices of one request as the HTTP handlers follow them (see EngineGeneration)."""

    choices: List[Choice]
    client_gone = False

    @property
    def finished(self) -> bool:
        return all(c.finished for c in self.choices)

    def next_update(self, timeout: Optional[float] = None) -> Optional[int]:
        """Wait for news of any choice; returns its index (None once every choice finished)."""
        raise NotImplementedError

    def cancel(self, client_gone: bool = False) -> None:
        """End every unfinished choice."""
        raise NotImplementedError

    def wait(self) -> None:
        """Follow every choice until all have finished."""
        while self.next_update() is not None:
            pass

    @property
    def error(self) -> Optional[str]:
        """The first choice's failure, if any failed."""
        return next((c.error for c in self.choices if c.end == "error"), None)

    def log(self, request_id: str, max_tokens: int) -> None:
        """One line: how many steps the generation ran and why it ended."""
        steps = max((len(c.generated) for c in self.choices), default=0)
        if self.client_gone:
            reason = "the client went away"
        elif self.error is not None:
            reason = f"failed: {self.error}"
        else:
            reason = "every choice finished"
        print(
            f"{request_id}: generation ended after {steps} step(s) of at most {max_tokens} "
            f"({reason})",
            flush=True,
        )


class EngineGeneration(Generation):
    """The choices of one request, run by the serving loop's engine.

    Args:
        loop (EngineLoop): the running loop.
        tokenizer: detokenizes (stop strings, texts).
        prompts (list of list of int): one token list per choice.
        params (list of SamplingParams): one per choice.
        stops (list of str): stop strings of every choice.

    Raises:
        ValueError / QueueFullError: from the engine, for the first prompt it refused (the ones
            already submitted are cancelled).
    """

    def __init__(self, loop, tokenizer, prompts: Sequence, params: Sequence, stops=()):
        self.loop = loop
        self._notify: "queue.Queue" = queue.Queue()
        self.choices = [
            Choice(ids, p.num_tokens_to_generate, stops, tokenizer, termination_id_of(p, tokenizer))
            for ids, p in zip(prompts, params)
        ]
        self.streams = []
        try:
            for ids, p in zip(prompts, params):
                self.streams.append(loop.submit(ids, p, notify=self._notify))
        except BaseException:
            self.cancel()
            raise
        self._index = {stream.request_id: i for i, stream in enumerate(self.streams)}

    def next_update(self, timeout: Optional[float] = None) -> Optional[int]:
        """Wait for news of any choice; returns its index (None once every choice finished).

        Raises:
            queue.Empty: nothing happened within `timeout` seconds.
        """
        while not self.finished:
            i = self._index[self._notify.get(timeout=timeout)]
            choice, stream = self.choices[i], self.streams[i]
            if choice.finished:
                continue
            tokens, ended = stream.poll()
            choice.generated.extend(tokens)
            if ended:
                self._finish(choice, stream)
            elif not choice.stop_hit and choice.hits_stop_string():
                # The text is complete: the engine request is cancelled (its blocks are freed
                # at the next step, its record then ends the choice).
                choice.stop_hit = True
                self.loop.cancel(stream.request_id)
            return i
        return None

    def _finish(self, choice, stream):
        choice.finished = True
        try:
            record = stream.result(timeout=0)
        except RuntimeError as exc:  # the serving loop failed
            choice.end, choice.error = "error", str(exc)
            return
        choice.generated = list(record.generated_tokens)
        choice.log_probs = record.generated_log_probs
        choice.prompt_log_probs = record.prompt_log_probs
        if record.status == Status.FAILED:
            choice.end, choice.error = "error", record.error or "the generation failed"
        elif record.status == Status.CANCELLED:
            choice.end = "stop_string" if choice.stop_hit else "cancelled"
        else:
            choice.end = record.finish_reason

    def cancel(self, client_gone: bool = False) -> None:
        """End every unfinished choice (their blocks are freed at the next step)."""
        self.client_gone = self.client_gone or client_gone
        for choice, stream in zip(self.choices, self.streams):
            if not choice.finished:
                self.loop.cancel(stream.request_id)


def termination_id_of(params, tokenizer) -> int:
    if params.termination_id is not None:
        return params.termination_id
    return tokenizer.eod
