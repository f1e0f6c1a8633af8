"""Layer specs of the ViT encoders: pre-norm transformer layers whose self attention sees every
token (`AttnMaskType.no_mask`).

Megatron r0.8's `get_vit_layer_with_transformer_engine_spec()` declared its attention causal (and
v0.9-v0.17's local spec kept that), so a ViT trained with it attended causally. Both names here
build the bidirectional layer; the Transformer Engine name logs one warning and returns the local
spec, whose norms are separate modules (`input_layernorm`, `pre_mlp_layernorm`) with the same
math; `sharded_state_dict_keys_map` maps them to the TE names in distributed checkpoints.
"""

import logging

from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchLayerNorm
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

logger = logging.getLogger(__name__)


def _get_mlp_module_spec(use_te: bool = False) -> ModuleSpec:
    """The dense MLP of a ViT layer (fc1 column-parallel, fc2 row-parallel)."""
    del use_te  # both variants are the local modules here
    return ModuleSpec(
        module=MLP,
        submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
    )


def get_vit_layer_with_local_spec() -> ModuleSpec:
    """A ViT layer from the plain-PyTorch modules: LayerNorm, bidirectional self attention
    (fused QKV, column-parallel; output projection row-parallel), LayerNorm, MLP."""
    # Every patch attends to every other one, and there are no per-head query / key norms.
    attention_parts = SelfAttentionSubmodules(
        q_layernorm=IdentityOp,
        k_layernorm=IdentityOp,
        linear_qkv=ColumnParallelLinear,
        core_attention=DotProductAttention,
        linear_proj=RowParallelLinear,
    )
    bidirectional_attention = ModuleSpec(
        module=SelfAttention,
        submodules=attention_parts,
        params={"attn_mask_type": AttnMaskType.no_mask},
    )
    layer_parts = TransformerLayerSubmodules(
        input_layernorm=WrappedTorchLayerNorm,
        self_attention=bidirectional_attention,
        self_attn_bda=get_bias_dropout_add,
        pre_mlp_layernorm=WrappedTorchLayerNorm,
        mlp=_get_mlp_module_spec(),
        mlp_bda=get_bias_dropout_add,
        # Checkpoints name the separate norms as Transformer Engine's fused ones.
        sharded_state_dict_keys_map={
            'input_layernorm.': 'self_attention.linear_qkv.layer_norm_',
            'pre_mlp_layernorm.': 'mlp.linear_fc1.layer_norm_',
        },
    )
    return ModuleSpec(module=TransformerLayer, submodules=layer_parts)


def get_vit_layer_with_transformer_engine_spec() -> ModuleSpec:
    """Megatron's Transformer Engine ViT spec name; Transformer Engine is not used here, so this
    is the local, bidirectional spec (one warning)."""
    logger.warning(
        "get_vit_layer_with_transformer_engine_spec: Transformer Engine is not available here; "
        "using get_vit_layer_with_local_spec (bidirectional attention)"
    )
    return get_vit_layer_with_local_spec()
