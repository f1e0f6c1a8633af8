"""What the HTTP handlers generate with (`Serving`): the serving loop, the tokenizer and the
limits, and how one request's generation starts on it (the engine's `EngineGeneration`, or
`LegacyGeneration` under `--use-legacy-static-engine`); `VLMServing` for a vision-language
(LLaVA) model, whose requests may carry images (`vlm_generation.py`).
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

    #: Whether requests may carry images (a vision-language model).
    takes_images = False

    def __init__(self, loop, tokenizer, legacy=False, max_waiting_requests=None):
        self.loop = loop
        self.engine = loop.engine
        self.tokenizer = tokenizer
        self.legacy = legacy
        self.max_waiting_requests = max_waiting_requests

    @property
    def max_sequence_length(self) -> int:
        return self.engine.context.max_sequence_length

    def prompt_length(self, ids) -> int:
        """Positions the model sees for a prompt's ids."""
        return len(ids)

    def generation(self, prompts, params, stops=(), images=None):
        """Start the choices of one request (see EngineGeneration); `images` (one list per
        prompt) only for a model that takes them."""
        if images is not None and any(len(i) for i in images):
            raise ValueError("this server's model takes no images (a text-only GPT model)")
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


class VLMServing(Serving):
    """Serving of a vision-language (LLaVA) model: every request runs on the `VLMLoop`, one
    prompt at a time, with or without images (see vlm_generation.py).

    Args:
        loop (VLMLoop): rank 0's loop.
        tokenizer: the server's tokenizer.
        model (LLaVAModel): rank 0's model (the placeholder id and image geometry).
    """

    takes_images = True

    def __init__(self, loop, tokenizer, model):
        self.loop = loop
        self.engine = None
        self.tokenizer = tokenizer
        self.legacy = False
        self.max_waiting_requests = None
        self.model = model
        self.placeholder = model.image_token_index
        self.image_size = (model.vision_model.img_h, model.vision_model.img_w)

    @property
    def max_sequence_length(self) -> int:
        return self.model.language_max_sequence_length

    def prompt_length(self, ids) -> int:
        from megatron.inference.vlm_generation import combined_length

        return combined_length(self.model, ids)

    def request(self, choice, params, images):
        """The VLMRequest of one choice (its SamplingParams and [n, 3, H, W] images)."""
        import torch

        from megatron.inference.vlm_generation import VLMRequest

        if images is None:
            images = torch.zeros(0, 3, *self.image_size)
        placeholders = sum(1 for t in choice.prompt_ids if t == self.placeholder)
        if placeholders != images.shape[0]:
            raise ValueError(
                f"the prompt holds {placeholders} image placeholder(s) but the request gives "
                f"{images.shape[0]} image(s)"
            )
        if params.num_tokens_to_generate < 1:
            raise ValueError("a vision-language request must generate at least one token")
        length = self.prompt_length(choice.prompt_ids) + params.num_tokens_to_generate
        if length > self.max_sequence_length:
            raise ValueError(
                f"Length of prompt + tokens_to_generate longer than allowed: "
                f"{self.prompt_length(choice.prompt_ids)} prompt positions (images included) + "
                f"{params.num_tokens_to_generate} > {self.max_sequence_length}"
            )
        greedy = params.top_k == 1
        return VLMRequest(
            ids=list(choice.prompt_ids),
            images=images,
            max_tokens=params.num_tokens_to_generate,
            termination_id=choice.termination_id,
            top_k=int(params.top_k),
            top_p=0.0 if greedy else float(params.top_p),
            temperature=float(params.temperature),
            seed=-1 if params.random_seed is None else int(params.random_seed),
            return_log_probs=bool(params.return_log_probs),
        )

    def generation(self, prompts, params, stops=(), images=None):
        from megatron.inference.vlm_generation import VLMGeneration

        return VLMGeneration(self, prompts, params, stops, images)

    def busy_message(self, exc) -> str:
        return f"the server is busy, try again later: {exc}"

    def health(self):
        body = {"service": "Megatron Inference Server"}
        if not self.loop.running:
            reason = self.loop.error or "stopped"
            return dict(body, status="error", ready=False, error=str(reason)), 503
        return dict(
            body, status="ok", ready=True, model="vision-language (one request at a time)"
        ), 200
