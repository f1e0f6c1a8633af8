"""Layer specs of GPT models built from this project's modules only (no Transformer Engine).

`get_gpt_layer_with_transformer_engine_spec` keeps Megatron's name for scripts that call it; it
returns the local spec (with a one-line warning), as `--transformer-impl transformer_engine` falls
back to `local`. With `num_experts` the MLP is an `MoELayer` (SequentialMLP experts of
ColumnParallelLinear / RowParallelLinear, or GroupedMLP with `moe_grouped_gemm`);
`get_gpt_decoder_block_spec` mixes dense and MoE layers per `moe_layer_freq`.
"""

import logging

from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

logger = logging.getLogger(__name__)

# LayerNorm or RMSNorm, following config.normalization.
LNImpl = WrappedTorchNorm

# Transformer Engine fuses each norm into the linear after it; checkpoints store the separate
# norms of the local spec under those fused names.
_TE_FUSED_NORM_KEYS = {
    'input_layernorm.': 'self_attention.linear_qkv.layer_norm_',
    'pre_mlp_layernorm.': 'mlp.linear_fc1.layer_norm_',
}


def get_gpt_layer_local_spec(
    num_experts: int = None, moe_grouped_gemm: bool = False, qk_layernorm: bool = False
) -> ModuleSpec:
    """GPT layer spec with the local (plain PyTorch) modules.

    Args:
        num_experts: number of MoE experts (None: a dense MLP).
        moe_grouped_gemm: MoE experts as one GroupedMLP instead of one MLP each.
        qk_layernorm: normalise queries and keys per head.

    Returns:
        ModuleSpec of a TransformerLayer with separate input / pre-MLP norms, causal
        self attention (fused QKV) and a dense MLP or an MoE layer.
    """
    # One norm class serves both per-head norms; IdentityOp leaves them out.
    qk_norm = LNImpl if qk_layernorm else IdentityOp
    attention_parts = SelfAttentionSubmodules(
        linear_qkv=ColumnParallelLinear,
        core_attention=DotProductAttention,
        linear_proj=RowParallelLinear,
        q_layernorm=qk_norm,
        k_layernorm=qk_norm,
    )
    causal_attention = ModuleSpec(
        module=SelfAttention,
        submodules=attention_parts,
        params={"attn_mask_type": AttnMaskType.causal},
    )
    layer_parts = TransformerLayerSubmodules(
        input_layernorm=LNImpl,
        self_attention=causal_attention,
        self_attn_bda=get_bias_dropout_add,
        pre_mlp_layernorm=LNImpl,
        mlp=_get_mlp_module_spec(num_experts, moe_grouped_gemm),
        mlp_bda=get_bias_dropout_add,
        sharded_state_dict_keys_map=dict(_TE_FUSED_NORM_KEYS),
    )
    return ModuleSpec(module=TransformerLayer, submodules=layer_parts)


def get_gpt_layer_with_transformer_engine_spec(
    num_experts: int = None,
    moe_grouped_gemm: bool = False,
    qk_layernorm: bool = False,
    fp8: str = None,
) -> ModuleSpec:
    """Megatron's Transformer Engine GPT layer spec; here the local spec (TE is not used).

    The local modules compute the same layer (separate norms instead of TE's fused
    LayerNorm-Linear), and the state-dict key map of the local spec keeps checkpoints compatible.

    Args:
        num_experts, moe_grouped_gemm, qk_layernorm: as in `get_gpt_layer_local_spec`.
        fp8: TE's fp8 format; fp8 is not supported, so it must be None.
    """
    if fp8 is not None:
        raise ValueError(
            f"fp8 ({fp8!r}): fp8 needs Transformer Engine, which this package does not use"
        )
    logger.warning(
        "get_gpt_layer_with_transformer_engine_spec: Transformer Engine is not used by this "
        "package; returning the local spec (get_gpt_layer_local_spec)"
    )
    return get_gpt_layer_local_spec(num_experts, moe_grouped_gemm, qk_layernorm)


def _get_mlp_module_spec(num_experts: int = None, moe_grouped_gemm: bool = False) -> ModuleSpec:
    """Dense MLP spec (ColumnParallelLinear fc1, RowParallelLinear fc2) without experts; else the
    MoELayer spec: the same linears for SequentialMLP experts, or no submodules (GroupedMLP)."""
    if num_experts is None:
        return ModuleSpec(
            module=MLP,
            submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
        )
    if moe_grouped_gemm:
        return ModuleSpec(module=MoELayer)
    return ModuleSpec(
        module=MoELayer,
        submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
    )


def get_gpt_decoder_block_spec(config, use_transformer_engine: bool = False):
    """Block spec with this pipeline stage's layers, each dense or MoE per
    `config.moe_layer_freq` (later Megatron's function of the same name).

    Args:
        config (TransformerConfig): the model config (num_moe_experts set).
        use_transformer_engine: Megatron's choice of the TE spec; the local spec is used here.

    Returns:
        TransformerBlockSubmodules listing the layer specs of this stage (or model chunk).
    """
    from megatron.core.transformer.moe.moe_config_checks import moe_layer_pattern
    from megatron.core.transformer.transformer_block import (
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    dense = get_gpt_layer_local_spec(None, False, config.qk_layernorm)
    moe = get_gpt_layer_local_spec(
        config.num_moe_experts, config.moe_grouped_gemm, config.qk_layernorm
    )
    pattern = moe_layer_pattern(config)
    offset = get_transformer_layer_offset(config)
    num_layers = get_num_layers_to_build(config)
    layer_specs = [moe if pattern[offset + i] else dense for i in range(num_layers)]
    return TransformerBlockSubmodules(layer_specs=layer_specs, layer_norm=LNImpl)
