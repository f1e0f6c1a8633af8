"""GPT layer specs with multi-latent attention (later Megatron's `get_gpt_layer_local_spec(...,
multi_latent_attention=True)` and the MLA branch of `get_gpt_decoder_block_spec`).

The latent norms `q_layernorm` / `kv_layernorm` exist only with `qk_layernorm` (otherwise they
are identities), as in Megatron: DeepSeek checkpoints need `--qk-layernorm`.
"""

from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.gpt.gpt_layer_specs import LNImpl, _get_mlp_module_spec
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.duplicated_linear import DuplicatedLinear
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.multi_latent_attention import (
    MLACoreAttention,
    MLASelfAttention,
    MLASelfAttentionSubmodules,
)
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules


def get_gpt_mla_layer_local_spec(
    num_experts: int = None, moe_grouped_gemm: bool = False, qk_layernorm: bool = False
) -> ModuleSpec:
    """TransformerLayer spec with MLASelfAttention and a dense MLP (or an MoE layer).

    Args:
        num_experts: MoE experts (None: dense MLP).
        moe_grouped_gemm: GroupedMLP experts.
        qk_layernorm: build the latent RMSNorms q_layernorm / kv_layernorm.
    """
    # The latent norms exist only with qk_layernorm.
    latent_norm = LNImpl if qk_layernorm else IdentityOp
    # The down projections are small and replicated (DuplicatedLinear); the up projections
    # and the output projection split the heads across TP.
    attention_parts = MLASelfAttentionSubmodules(
        linear_q_proj=ColumnParallelLinear,
        linear_q_down_proj=DuplicatedLinear,
        linear_q_up_proj=ColumnParallelLinear,
        linear_kv_down_proj=DuplicatedLinear,
        linear_kv_up_proj=ColumnParallelLinear,
        core_attention=MLACoreAttention,
        linear_proj=RowParallelLinear,
        q_layernorm=latent_norm,
        kv_layernorm=latent_norm,
    )
    causal_attention = ModuleSpec(
        module=MLASelfAttention,
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
    )
    return ModuleSpec(module=TransformerLayer, submodules=layer_parts)


def get_gpt_mla_decoder_block_spec(config):
    """Block spec of this pipeline stage's MLA layers, each dense or MoE per
    `config.moe_layer_freq` (dense everywhere without experts)."""
    from megatron.core.transformer.moe.moe_config_checks import moe_layer_pattern
    from megatron.core.transformer.transformer_block import (
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    dense = get_gpt_mla_layer_local_spec(None, False, config.qk_layernorm)
    if config.num_moe_experts is None:
        pattern = [0] * config.num_layers
        moe = dense
    else:
        pattern = moe_layer_pattern(config)
        moe = get_gpt_mla_layer_local_spec(
            config.num_moe_experts, config.moe_grouped_gemm, config.qk_layernorm
        )
    offset = get_transformer_layer_offset(config)
    num_layers = get_num_layers_to_build(config)
    layer_specs = [moe if pattern[offset + i] else dense for i in range(num_layers)]
    return TransformerBlockSubmodules(layer_specs=layer_specs, layer_norm=LNImpl)
