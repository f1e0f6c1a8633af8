"""`mamba_stack_spec`: the layer specs of a hybrid model, from this project's modules only.

'M' is a MambaLayer whose pre-norm is fused into the mixer's in_proj; '*' a TransformerLayer
with only causal self attention; '-' a TransformerLayer with only an MLP. The attention and MLP
layers use separate norms, stored in distributed checkpoints under Transformer Engine's fused
names (`self_attention.linear_qkv.layer_norm_*`, `mlp.linear_fc1.layer_norm_*`) as the GPT
local spec does.
"""

from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.ssm.layer_norm_linear import LayerNormColumnParallelLinear
from megatron.core.ssm.mamba_block import MambaStack, MambaStackSubmodules
from megatron.core.ssm.mamba_layer import MambaLayer, MambaLayerSubmodules
from megatron.core.ssm.mamba_mixer import MambaMixer, MambaMixerSubmodules
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules


def mamba_attention_layer_spec(attn_mask_type: AttnMaskType = AttnMaskType.causal) -> ModuleSpec:
    """The '*' layer: norm -> self attention -> residual."""
    # Plain attention: fused QKV, no per-head query / key norms.
    attention_parts = SelfAttentionSubmodules(
        q_layernorm=IdentityOp,
        k_layernorm=IdentityOp,
        linear_qkv=ColumnParallelLinear,
        core_attention=DotProductAttention,
        linear_proj=RowParallelLinear,
    )
    attention = ModuleSpec(
        module=SelfAttention, submodules=attention_parts, params={"attn_mask_type": attn_mask_type}
    )
    # The layer's norm is stored under Transformer Engine's fused name.
    layer_parts = TransformerLayerSubmodules(
        input_layernorm=WrappedTorchNorm,
        self_attention=attention,
        self_attn_bda=get_bias_dropout_add,
        sharded_state_dict_keys_map={'input_layernorm.': 'self_attention.linear_qkv.layer_norm_'},
    )
    return ModuleSpec(module=TransformerLayer, submodules=layer_parts)


def mamba_mlp_layer_spec() -> ModuleSpec:
    """The '-' layer: norm -> MLP -> residual."""
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            pre_mlp_layernorm=WrappedTorchNorm,
            mlp=ModuleSpec(
                module=MLP,
                submodules=MLPSubmodules(
                    linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear
                ),
            ),
            mlp_bda=get_bias_dropout_add,
            sharded_state_dict_keys_map={'pre_mlp_layernorm.': 'mlp.linear_fc1.layer_norm_'},
        ),
    )


def get_mamba_stack_spec(attn_mask_type: AttnMaskType = AttnMaskType.causal) -> ModuleSpec:
    """The MambaStack spec; `attn_mask_type=AttnMaskType.arbitrary` makes the attention layers
    apply the dataloader's mask (per-document masks of --reset-attention-mask)."""
    return ModuleSpec(
        module=MambaStack,
        submodules=MambaStackSubmodules(
            mamba_layer=ModuleSpec(
                module=MambaLayer,
                submodules=MambaLayerSubmodules(
                    norm=IdentityOp,
                    mixer=ModuleSpec(
                        module=MambaMixer,
                        submodules=MambaMixerSubmodules(
                            in_proj=LayerNormColumnParallelLinear, out_proj=RowParallelLinear
                        ),
                    ),
                    mamba_bda=get_bias_dropout_add,
                ),
            ),
            attention_layer=mamba_attention_layer_spec(attn_mask_type),
            mlp_layer=mamba_mlp_layer_spec(),
        ),
    )


mamba_stack_spec = get_mamba_stack_spec()
