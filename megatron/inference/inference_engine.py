"""Inference engines built from Megatron's command-line args (the training layer's side of
`megatron.core.inference`, which itself takes configs only).

`get_inference_engine(args, model)` gives the static-batching `MCoreEngine` (core_r0.8.0), or with
`--inference-dynamic-batching` the `DynamicInferenceEngine` over a paged KV cache sized by the
`--inference-dynamic-batching-*` flags.
"""

from megatron.core.inference.contexts.dynamic_context import DynamicInferenceContext
from megatron.core.inference.engines.dynamic_engine import DynamicInferenceEngine
from megatron.core.inference.engines.mcore_engine import MCoreEngine
from megatron.core.inference.model_inference_wrappers.gpt.gpt_inference_wrapper import (
    GPTInferenceWrapper,
)
from megatron.core.inference.model_inference_wrappers.inference_wrapper_config import (
    InferenceWrapperConfig,
)
from megatron.core.inference.text_generation_controllers.simple_text_generation_controller import (
    SimpleTextGenerationController,
)
from megatron.training.global_vars import get_tokenizer
from megatron.training.gpt_builder import gpt_config_from_args
from megatron.training.validation.argument_validation_mamba import is_mamba_run


def get_inference_wrapper_config(args) -> InferenceWrapperConfig:
    return InferenceWrapperConfig(
        hidden_size=args.hidden_size,
        inference_batch_times_seqlen_threshold=args.inference_batch_times_seqlen_threshold,
        fp32_residual_connection=args.fp32_residual_connection,
        params_dtype=args.params_dtype,
        padded_vocab_size=args.padded_vocab_size,
    )


def _kv_layers_per_stage(args):
    """The most attention layers on one pipeline stage: of a hybrid Mamba model, or of an
    uneven split (--standalone-embedding-stage, --decoder-first/last-pipeline-num-layers); None
    for the even split (num_layers / pp on every stage)."""
    if not is_mamba_run(args):
        first = getattr(args, 'decoder_first_pipeline_num_layers', None)
        last = getattr(args, 'decoder_last_pipeline_num_layers', None)
        if first is None and last is None:
            return None
        from megatron.core.transformer.pipeline_layer_split import pipeline_stage_layer_counts

        pp = args.pipeline_model_parallel_size
        return max(pipeline_stage_layer_counts(args.num_layers, pp, first, last))
    from megatron.core.ssm.mamba_block import select_stage_layers
    from megatron.core.ssm.mamba_hybrid_layer_allocation import Symbols, check_hybrid_allocation

    pattern = check_hybrid_allocation(
        args.num_layers,
        args.hybrid_attention_ratio,
        args.hybrid_mlp_ratio,
        args.hybrid_override_pattern,
    )
    pp = args.pipeline_model_parallel_size
    return max(
        select_stage_layers(pattern, pp, rank)[0].count(Symbols.ATTENTION) for rank in range(pp)
    )


def get_dynamic_inference_context(args, max_requests=None) -> DynamicInferenceContext:
    """The paged KV cache of the --inference-dynamic-batching-* flags (ValueError naming the flag
    when a size is out of range); `max_requests` overrides
    --inference-dynamic-batching-max-requests."""
    max_seq = args.inference_max_seq_length or args.max_position_embeddings
    if (
        max_seq > args.max_position_embeddings
        and args.position_embedding_type == 'learned_absolute'
    ):
        raise ValueError(
            f"--inference-max-seq-length ({max_seq}) exceeds --max-position-embeddings "
            f"({args.max_position_embeddings}) of a model with learned position embeddings"
        )
    for flag, value in (
        ('--inference-dynamic-batching-block-size', args.inference_dynamic_batching_block_size),
        ('--inference-dynamic-batching-max-requests', args.inference_dynamic_batching_max_requests),
        ('--inference-dynamic-batching-max-tokens', args.inference_dynamic_batching_max_tokens),
    ):
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be at least 1, got {value}")
    if args.inference_dynamic_batching_buffer_size_gb <= 0:
        raise ValueError(
            "--inference-dynamic-batching-buffer-size-gb must be > 0, got "
            f"{args.inference_dynamic_batching_buffer_size_gb}"
        )
    return DynamicInferenceContext(
        gpt_config_from_args(args),  # an MLATransformerConfig for MLA: a latent cache
        num_kv_layers=_kv_layers_per_stage(args),
        max_sequence_length=max_seq,
        buffer_size_gb=args.inference_dynamic_batching_buffer_size_gb,
        block_size_tokens=args.inference_dynamic_batching_block_size,
        max_requests=max_requests or args.inference_dynamic_batching_max_requests,
        max_tokens=args.inference_dynamic_batching_max_tokens,
    )


def get_dynamic_inference_engine(
    args,
    model,
    tokenizer=None,
    random_seed=None,
    request_source_rank=None,
    max_requests=None,
    max_waiting_requests=None,
    isolate_failures=False,
) -> DynamicInferenceEngine:
    """The dynamic-batching engine of `model` (one pipeline stage) from the
    --inference-dynamic-batching-* flags and --enable-chunked-prefill, whatever
    --inference-dynamic-batching says (the text generation server always uses it).

    Args:
        max_requests: most requests running at once (a server's --max-batch-size; default
            --inference-dynamic-batching-max-requests).
        max_waiting_requests, isolate_failures, request_source_rank, random_seed: see
            DynamicInferenceEngine.
    """
    tokenizer = tokenizer if tokenizer is not None else get_tokenizer()
    wrapper = GPTInferenceWrapper(model, get_inference_wrapper_config(args))
    controller = SimpleTextGenerationController(
        inference_wrapped_model=wrapper, tokenizer=tokenizer
    )
    return DynamicInferenceEngine(
        controller,
        get_dynamic_inference_context(args, max_requests=max_requests),
        enable_chunked_prefill=args.enable_chunked_prefill,
        random_seed=random_seed,
        max_waiting_requests=max_waiting_requests,
        request_source_rank=request_source_rank,
        isolate_failures=isolate_failures,
    )


def get_inference_engine(
    args, model, tokenizer=None, max_batch_size=None, random_seed=None, request_source_rank=None
):
    """The engine of `model` (one pipeline stage, not a list).

    Args:
        args: Megatron's args.
        model: the model of this stage.
        tokenizer: default `get_tokenizer()`.
        max_batch_size: the static engine's batch size (default args.max_batch_size or 1).
        random_seed: engine seed (static: torch.manual_seed at each generate(); dynamic: seeds
            the requests' generators).
        request_source_rank: dynamic engine only: the rank whose submissions are broadcast to
            the others at each step (a server), None when every rank submits the same requests.
    """
    if getattr(args, 'inference_dynamic_batching', False):
        return get_dynamic_inference_engine(
            args,
            model,
            tokenizer,
            random_seed=random_seed,
            request_source_rank=request_source_rank,
        )
    tokenizer = tokenizer if tokenizer is not None else get_tokenizer()
    wrapper = GPTInferenceWrapper(model, get_inference_wrapper_config(args))
    controller = SimpleTextGenerationController(
        inference_wrapped_model=wrapper, tokenizer=tokenizer
    )
    if max_batch_size is None:
        max_batch_size = getattr(args, 'max_batch_size', None) or 1
    return MCoreEngine(
        text_generation_controller=controller,
        max_batch_size=max_batch_size,
        random_seed=random_seed,
    )
