"""Layer and block specs of the T5 encoder and decoder (megatron-core names).

Encoder layer: pre-LN self attention (padding mask) and MLP, like BERT. Decoder layer: pre-LN causal
self attention, then pre-LN cross attention over the encoder output (`linear_q` on the decoder
stream, `linear_kv` on the encoder output, padding mask), then the MLP. Every linear has a bias;
the final LayerNorm of each stack sits on its last stage.

Megatron's `*_with_transformer_engine_*` builders fuse the layer norms into Transformer Engine
linears. This package has no Transformer Engine, so those names return the local specs (same math,
same state-dict names as Megatron's local spec) after a one-line warning.
"""

import logging

from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.attention import (
    CrossAttention,
    CrossAttentionSubmodules,
    SelfAttention,
    SelfAttentionSubmodules,
)
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

logger = logging.getLogger(__name__)

# LayerNorm or RMSNorm, following config.normalization.
LNImpl = WrappedTorchNorm

_TE_WARNED = {'done': False}


def _warn_no_transformer_engine(name: str) -> None:
    if not _TE_WARNED['done']:
        logger.warning(
            "%s: Transformer Engine is not available in this package; using the local T5 spec "
            "(same math and state-dict names).",
            name,
        )
        _TE_WARNED['done'] = True


def _mlp_spec() -> ModuleSpec:
    return ModuleSpec(
        module=MLP,
        submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
    )


def _self_attention_spec(mask_type: AttnMaskType) -> ModuleSpec:
    return ModuleSpec(
        module=SelfAttention,
        params={"attn_mask_type": mask_type},
        # QKV column parallel (heads split over tp), projection row parallel (all-reduce fwd).
        submodules=SelfAttentionSubmodules(
            q_layernorm=IdentityOp,
            k_layernorm=IdentityOp,
            core_attention=DotProductAttention,
            linear_qkv=ColumnParallelLinear,
            linear_proj=RowParallelLinear,
        ),
    )


def _cross_attention_spec() -> ModuleSpec:
    """Decoder queries over the encoder output; pad positions of the encoder are masked."""
    return ModuleSpec(
        module=CrossAttention,
        params={"attn_mask_type": AttnMaskType.padding},
        submodules=CrossAttentionSubmodules(
            core_attention=DotProductAttention,
            linear_q=ColumnParallelLinear,
            linear_kv=ColumnParallelLinear,
            linear_proj=RowParallelLinear,
        ),
    )


def encoder_model_with_local_spec() -> ModuleSpec:
    """T5 encoder layer: LN -> self attention (padding mask) -> LN -> MLP, residuals around both."""
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=LNImpl,
            self_attention=_self_attention_spec(AttnMaskType.padding),
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=LNImpl,
            mlp=_mlp_spec(),
            mlp_bda=get_bias_dropout_add,
            sharded_state_dict_keys_map={
                'input_layernorm.': 'self_attention.linear_qkv.layer_norm_',
                'pre_mlp_layernorm.': 'mlp.linear_fc1.layer_norm_',
            },
        ),
    )


def decoder_model_with_local_spec() -> ModuleSpec:
    """T5 decoder layer: LN -> causal self attention -> LN -> cross attention (padding mask) over
    the encoder output -> LN -> MLP, residuals around all three."""
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=LNImpl,
            self_attention=_self_attention_spec(AttnMaskType.causal),
            self_attn_bda=get_bias_dropout_add,
            pre_cross_attn_layernorm=LNImpl,
            cross_attention=_cross_attention_spec(),
            cross_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=LNImpl,
            mlp=_mlp_spec(),
            mlp_bda=get_bias_dropout_add,
            sharded_state_dict_keys_map={
                'input_layernorm.': 'self_attention.linear_qkv.layer_norm_',
                'pre_mlp_layernorm.': 'mlp.linear_fc1.layer_norm_',
            },
        ),
    )


def encoder_model_with_transformer_engine_default_spec() -> ModuleSpec:
    """Megatron's TE encoder layer spec name; the local spec here (see module docstring)."""
    _warn_no_transformer_engine('encoder_model_with_transformer_engine_default_spec')
    return encoder_model_with_local_spec()


def decoder_model_with_transformer_engine_default_spec() -> ModuleSpec:
    """Megatron's TE decoder layer spec name; the local spec here (see module docstring)."""
    _warn_no_transformer_engine('decoder_model_with_transformer_engine_default_spec')
    return decoder_model_with_local_spec()


def _block(layer_spec: ModuleSpec, num_layers: int) -> TransformerBlockSubmodules:
    if num_layers is None or num_layers <= 0:
        raise ValueError(f"T5 block spec: num_layers must be a positive int, got {num_layers}")
    return TransformerBlockSubmodules(layer_specs=[layer_spec] * num_layers, layer_norm=LNImpl)


def get_t5_encoder_with_local_block_spec(num_layers: int) -> TransformerBlockSubmodules:
    """All `num_layers` encoder layers and the final LayerNorm (T5Model keeps its stage's share)."""
    return _block(encoder_model_with_local_spec(), num_layers)


def get_t5_decoder_with_local_block_spec(num_layers: int) -> TransformerBlockSubmodules:
    """All `num_layers` decoder layers and the final LayerNorm (T5Model keeps its stage's share)."""
    return _block(decoder_model_with_local_spec(), num_layers)


def get_t5_encoder_with_transformer_engine_block_spec(
    num_layers: int,
) -> TransformerBlockSubmodules:
    """Megatron's TE encoder block spec name; the local block spec here."""
    _warn_no_transformer_engine('get_t5_encoder_with_transformer_engine_block_spec')
    return get_t5_encoder_with_local_block_spec(num_layers)


def get_t5_decoder_with_transformer_engine_block_spec(
    num_layers: int,
) -> TransformerBlockSubmodules:
    """Megatron's TE decoder block spec name; the local block spec here."""
    _warn_no_transformer_engine('get_t5_decoder_with_transformer_engine_block_spec')
    return get_t5_decoder_with_local_block_spec(num_layers)
