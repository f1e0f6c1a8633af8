"""What the HTTP handlers generate with (`Serving`): the serving loop, the tokenizer and the
limits, and how one request's generation starts on it (the engine's `EngineGeneration`, or
`LegacyGeneration` under `--use-legacy-static-engine`).
"""

from megatron.inference.generations import EngineGeneration
from megatron.inference.legacy_generation import LegacyGeneration


class Serving:
    """What the HTTP handlers generate with: the serving loop, the tokenizer and the limits.

    Args:
        loop (ServingLoop): rank 0's loop (engine steps and legacy requests).
        tokenizer: the server's tokenizer.
        legacy (bool): `--use-legacy-static-engine`: every request runs through Megatron's
            generate() loop, one at a time, instead of the engine.
        max_waiting_requests (int, optional): the queue limit (for messages).
    """

    def __init__(self, loop, tokenizer, legacy=False, max_waiting_requests=None):
        self.loop = loop
        self.engine = loop.engine
        self.tokenizer = tokenizer
        self.legacy = legacy
        self.max_waiting_requests = max_waiting_requests

    @property
    def max_sequence_length(self) -> int:
        return self.engine.context.max_sequence_length

    def generation(self, prompts, params, stops=()):
        """Start the choices of one request (see EngineGeneration)."""
        if self.legacy:
            return LegacyGeneration(self, prompts, params, stops)
        return EngineGeneration(self.loop, self.tokenizer, prompts, params, stops)

    def busy_message(self, exc) -> str:
        """The 503 answer to a full queue."""
        return (
            f"the server is busy, try again later: {exc} (--max-batch-size "
            f"{self.engine.context.max_requests}, --max-waiting-requests "
            f"{self.max_waiting_requests})"
        )

    def health(self):
        """(body, HTTP status) of GET /health: 200 while the serving loop runs."""
        body = {"service": "Megatron Inference Server"}
        if not self.loop.running:
            reason = self.loop.error or "stopped"
            return dict(body, status="error", ready=False, error=str(reason)), 503
        return dict(body, status="ok", ready=True, engine=self.engine.stats()), 200


def legacy_serving(model):
    """Serving for Megatron's `MegatronServer(model)`: every request runs through the legacy
    generate() loop on the serving loop's thread (the engine is built but never given work)."""
    from megatron.inference.inference_engine import get_dynamic_inference_engine
    from megatron.inference.worker_loop import ServingLoop
    from megatron.training.global_vars import get_args, get_tokenizer

    engine = get_dynamic_inference_engine(get_args(), model)
    return Serving(ServingLoop(engine, model).start(), get_tokenizer(), legacy=True)
