"""Tiny seeded GPT models (GPT-2-like: learned positions, LayerNorm, GeLU; Llama-like: RoPE,
RMSNorm, SwiGLU, GQA) with the engines of megatron.core.inference on top, for the engine tests.

Imported inside distributed workers (tests.unit_tests.dist_utils), so everything is module level.
Equality tests run in float64: CPU GEMMs round differently for different batch shapes, so fp32
greedy choices could flip on near-ties; in float64 the logits of a request agree to ~1e-13
whatever shares its step, far below the margins of these random models.
"""

import torch

from megatron.core import parallel_state
from megatron.core.inference.contexts.dynamic_context import DynamicInferenceContext
from megatron.core.inference.engines.dynamic_engine import DynamicInferenceEngine
from megatron.core.inference.engines.mcore_engine import MCoreEngine
from megatron.core.inference.model_inference_wrappers.gpt.gpt_inference_wrapper import (
    GPTInferenceWrapper,
)
from megatron.core.inference.model_inference_wrappers.inference_wrapper_config import (
    InferenceWrapperConfig,
)
from megatron.core.inference.sampling_params import SamplingParams
from megatron.core.inference.text_generation_controllers.text_generation_controller import (
    TextGenerationController,
)
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.training.tokenizer.tokenizer import _NullTokenizer
from tests.unit_tests.models import gpt_test_utils as gu

#: Model vocabulary (the null tokenizer's 127 ids + its EOD, id 127).
VOCAB = gu.VOCAB
EOD = VOCAB - 1
MAX_SEQ = 64


def build_model(arch="llama", dtype=torch.float64, seed=0, threshold=512, **config_overrides):
    """(model, config, controller) of a tiny random model with sharpened weights (clear greedy
    margins), in `dtype`, for the current parallel state. "mixtral" is the Llama architecture
    with MoE layers (4 experts, top-2, dropless; expert parallel size from parallel_state);
    `config_overrides` go to its TransformerConfig."""
    torch.manual_seed(seed)
    kw = gu.gpt2_like_kwargs() if arch == "gpt2" else gu.llama_like_kwargs()
    spec = {}
    if arch == "mixtral":
        kw.update(
            num_moe_experts=4,
            moe_router_topk=2,
            expert_model_parallel_size=parallel_state.get_expert_model_parallel_world_size(),
        )
        spec["transformer_layer_spec"] = get_gpt_layer_local_spec(num_experts=4)
    kw.update(params_dtype=dtype, **config_overrides)
    model, config = gu.build_gpt(kw, arch=arch, max_sequence_length=MAX_SEQ, **spec)
    model = model.to(dtype)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(4.0)
    wrapper = GPTInferenceWrapper(
        model, InferenceWrapperConfig(config.hidden_size, dtype, threshold, VOCAB)
    )
    controller = TextGenerationController(wrapper, _NullTokenizer(VOCAB - 1))
    return model, config, controller


def dynamic_engine(
    controller,
    config,
    block_size=4,
    num_blocks=64,
    max_tokens=64,
    max_requests=None,
    chunked=False,
    **kw,
):
    context = DynamicInferenceContext(
        config,
        max_sequence_length=MAX_SEQ,
        block_size_tokens=block_size,
        num_blocks=num_blocks,
        max_tokens=max_tokens,
        max_requests=max_requests,
    )
    return DynamicInferenceEngine(controller, context, enable_chunked_prefill=chunked, **kw)


def static_engine(controller, max_batch_size=1):
    return MCoreEngine(controller, max_batch_size=max_batch_size)


def prompts(lengths, seed=3):
    """Random prompts (token id lists, no EOD) of these lengths."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, EOD, (n,), generator=g).tolist() for n in lengths]


def greedy(n, **kw):
    return SamplingParams(top_k=1, num_tokens_to_generate=n, termination_id=-1, **kw)


def run_schedule(engine, requests, arrival_steps):
    """Add request i (prompt, params) at step arrival_steps[i]; step until all finish.
    Returns the finished request records in request order and the steps run."""
    ids = [None] * len(requests)
    step = 0
    while any(i is None for i in ids) or engine.has_unfinished_requests():
        for i, (prompt, params) in enumerate(requests):
            if ids[i] is None and arrival_steps[i] <= step:
                ids[i] = engine.add_request(prompt, params)
        engine.step()
        step += 1
        assert step < 1000, "engine made no progress"
    return [engine.get_request(i) for i in ids], step


def solo(controller, config, prompt, params, **engine_kw):
    """The request alone in a fresh engine."""
    engine = dynamic_engine(controller, config, **engine_kw)
    (request,), _ = run_schedule(engine, [(prompt, params)], [0])
    return request
