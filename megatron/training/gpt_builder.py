"""args -> the GPT layer spec and GPTModel keyword arguments, shared by pretrain_gpt.py and the
text generation server so that a served model is built exactly as it was trained (Qwen3's
--qk-layernorm, MLA, dense / MoE layer mixes, rope interpolation and Llama-3.1 rope scaling).
"""

from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_decoder_block_spec,
    get_gpt_layer_local_spec,
)
from megatron.training.mla_config import mla_config_from_args, mla_layer_spec


def gpt_config_from_args(args):
    """The TransformerConfig of `args` (an MLATransformerConfig with --multi-latent-attention)."""
    from megatron.training.arguments import core_transformer_config_from_args

    if getattr(args, 'multi_latent_attention', False):
        return mla_config_from_args(args)
    return core_transformer_config_from_args(args)


def gpt_layer_spec_from_args(args, config):
    """The layer spec (or block spec, one spec per layer of this stage) that `args` asks for:
    --spec when given, else MLA, else dense and MoE layers mixed by --moe-layer-freq, else one
    local spec for every layer, with q/k layernorm when --qk-layernorm is set."""
    spec = getattr(args, 'spec', None)
    if spec is not None:
        import importlib

        module_name, function_name = spec
        return getattr(importlib.import_module(module_name), function_name)()
    if getattr(args, 'multi_latent_attention', False):
        return mla_layer_spec(config)  # MLA, dense or MoE per layer
    if args.num_experts is not None and args.moe_layer_freq != 1:
        return get_gpt_decoder_block_spec(config)  # dense and MoE layers mixed
    return get_gpt_layer_local_spec(
        args.num_experts, args.moe_grouped_gemm, getattr(args, 'qk_layernorm', False)
    )


def gpt_model_kwargs(args):
    """GPTModel's keyword arguments that come from `args` alone (not the config, spec, stage or
    output layout)."""
    return dict(
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        fp16_lm_cross_entropy=args.fp16_lm_cross_entropy,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base,
        seq_len_interpolation_factor=getattr(args, 'rotary_seq_len_interpolation_factor', None),
        rope_scaling=getattr(args, 'use_rope_scaling', False),
        rope_scaling_factor=getattr(args, 'rope_scaling_factor', 8.0),
    )
