"""Layer specs of BERT (pre-LayerNorm layers with padding-masked self attention).

`bert_layer_local_spec` is built from this project's plain-PyTorch modules. Megatron's default,
`bert_layer_with_transformer_engine_spec`, needs Transformer Engine, which is not available here:
reading that name logs a one-line warning and returns the local spec (same math; the state-dict
keys of the norms are the local names, `input_layernorm.*` / `pre_mlp_layernorm.*`, and the
`sharded_state_dict_keys_map` maps them to the Transformer Engine names in distributed
checkpoints).
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

# Megatron picks apex's FusedLayerNorm when apex imports, else the torch LayerNorm.
LNImpl = WrappedTorchLayerNorm

# Attention: QKV split by heads over tp (column parallel), output projection row parallel
# (all-reduce forward); BERT attends over every non-pad token, hence the padding mask type.
_padding_self_attention = ModuleSpec(
    module=SelfAttention,
    params={"attn_mask_type": AttnMaskType.padding},
    submodules=SelfAttentionSubmodules(
        q_layernorm=IdentityOp,
        k_layernorm=IdentityOp,
        core_attention=DotProductAttention,
        linear_qkv=ColumnParallelLinear,
        linear_proj=RowParallelLinear,
    ),
)

# MLP: fc1 split along the ffn dim (column parallel), fc2 row parallel (all-reduce forward).
_tp_mlp = ModuleSpec(
    module=MLP,
    submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
)

# Distributed checkpoints store the norms under Transformer Engine's fused-linear names.
_TE_NORM_KEYS = {
    'input_layernorm.': 'self_attention.linear_qkv.layer_norm_',
    'pre_mlp_layernorm.': 'mlp.linear_fc1.layer_norm_',
}

bert_layer_local_spec = ModuleSpec(
    module=TransformerLayer,
    submodules=TransformerLayerSubmodules(
        input_layernorm=LNImpl,
        pre_mlp_layernorm=LNImpl,
        self_attention=_padding_self_attention,
        mlp=_tp_mlp,
        self_attn_bda=get_bias_dropout_add,
        mlp_bda=get_bias_dropout_add,
        sharded_state_dict_keys_map=_TE_NORM_KEYS,
    ),
)

_TE_SPEC_NAME = 'bert_layer_with_transformer_engine_spec'


def __getattr__(name):
    # Module-level fallback (PEP 562): Megatron users import the Transformer Engine spec by name.
    if name == _TE_SPEC_NAME:
        logger.warning(
            "%s: Transformer Engine is not available here; using bert_layer_local_spec",
            _TE_SPEC_NAME,
        )
        return bert_layer_local_spec
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
