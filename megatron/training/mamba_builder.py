"""MambaModel from Megatron's args: the one builder of pretrain_mamba.py and the text generation
servers (so a served checkpoint is the model that was trained)."""

import copy
import importlib

from megatron.core.models.mamba import MambaModel
from megatron.core.models.mamba.mamba_layer_specs import mamba_stack_spec as default_stack_spec
from megatron.core.transformer.enums import AttnMaskType
from megatron.training.arguments import core_transformer_config_from_args


def mamba_stack_spec_from_args(args):
    """`--spec` (module, attribute) or the default mamba_stack_spec; with
    --reset-attention-mask the attention layers take the per-document (arbitrary) mask."""
    if args.spec is not None:
        module_name, attribute = args.spec
        stack_spec = getattr(importlib.import_module(module_name), attribute)
    else:
        stack_spec = default_stack_spec
    if args.reset_attention_mask:
        stack_spec = copy.deepcopy(stack_spec)
        attention = stack_spec.submodules.attention_layer.submodules.self_attention
        attention.params = {**attention.params, 'attn_mask_type': AttnMaskType.arbitrary}
    return stack_spec


def mamba_model_from_args(
    args, pre_process: bool = True, post_process: bool = True, parallel_output: bool = True
) -> MambaModel:
    """The MambaModel of this pipeline stage. parallel_output=False gathers the logits over the
    tensor-parallel group (generation samples from the full vocabulary on every rank)."""
    return MambaModel(
        config=core_transformer_config_from_args(args),
        mamba_stack_spec=mamba_stack_spec_from_args(args),
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process,
        hybrid_attention_ratio=args.hybrid_attention_ratio,
        hybrid_mlp_ratio=args.hybrid_mlp_ratio,
        hybrid_override_pattern=args.hybrid_override_pattern,
        post_process=post_process,
        fp16_lm_cross_entropy=args.fp16_lm_cross_entropy,
        parallel_output=parallel_output,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base,
    )
