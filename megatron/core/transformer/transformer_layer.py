"""One transformer layer: norm -> attention -> bias-dropout-add -> norm -> MLP -> bias-dropout-add.

Notation: s sequence (s/tp under sequence parallelism), b batch, h hidden size.
"""

from abc import ABC
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Dict, Optional, Union

import torch

from megatron.core import parallel_state
from megatron.core.process_groups_config import ProcessGroupCollection, resolve_process_groups
from megatron.core.transformer.identity_op import IdentityFuncOp, IdentityOp
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import make_viewless_tensor


def get_transformer_layer_offset(config: TransformerConfig) -> int:
    """Global index of the first layer held by this pipeline stage (and model chunk).

    Without virtual pipeline: pp_rank * (num_layers / pp); with an encoder-decoder split rank the
    offset counts within the layer's own stack (see below). With vp model chunks per stage the
    layers are dealt round-robin in chunks of num_layers / (pp * vp): chunk vp_rank of stage
    pp_rank starts at vp_rank * (num_layers / vp) + pp_rank * (num_layers / (pp * vp)).
    """
    pipeline_rank = parallel_state.get_pipeline_model_parallel_rank()
    pp_size = parallel_state.get_pipeline_model_parallel_world_size()
    if pp_size <= 1:
        return 0
    split_rank = parallel_state.get_pipeline_model_parallel_split_rank()
    if split_rank is not None:
        # Encoder-decoder: config.num_layers is the depth of the stack this layer belongs to,
        # spread over the r stages before the split (encoder) or the pp - r after it (decoder).
        if pipeline_rank < split_rank:
            return pipeline_rank * (config.num_layers // split_rank)
        return (pipeline_rank - split_rank) * (config.num_layers // (pp_size - split_rank))
    vp_size = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    if vp_size is not None:
        vp_rank = parallel_state.get_virtual_pipeline_model_parallel_rank()
        num_layers_per_virtual_rank = config.num_layers // pp_size // vp_size
        total_virtual_chunks = config.num_layers // vp_size
        return vp_rank * total_virtual_chunks + pipeline_rank * num_layers_per_virtual_rank
    return pipeline_rank * (config.num_layers // pp_size)


@dataclass
class TransformerLayerSubmodules:
    """Specs of the submodules of `TransformerLayer` (IdentityOp / IdentityFuncOp = absent)."""

    input_layernorm: Union[ModuleSpec, type] = IdentityOp
    self_attention: Union[ModuleSpec, type] = IdentityOp
    self_attn_bda: Union[ModuleSpec, type] = IdentityFuncOp

    pre_cross_attn_layernorm: Union[ModuleSpec, type] = IdentityOp
    cross_attention: Union[ModuleSpec, type] = IdentityOp
    cross_attn_bda: Union[ModuleSpec, type] = IdentityFuncOp

    pre_mlp_layernorm: Union[ModuleSpec, type] = IdentityOp
    mlp: Union[ModuleSpec, type] = IdentityOp
    mlp_bda: Union[ModuleSpec, type] = IdentityFuncOp

    # Mapping of this layer's state-dict names to Transformer Engine's (for checkpoint interop).
    sharded_state_dict_keys_map: Dict[str, str] = field(default_factory=dict)


class BaseTransformerLayer(ABC):
    """Marker base class of transformer layers (the block builds any subclass from its spec)."""

    def __init__(self) -> None:
        pass


class TransformerLayer(MegatronModule, BaseTransformerLayer):
    """A pre-norm transformer layer built from a spec.

    Hidden dropout (in the bias-dropout-add) uses the default RNG, which is identical on all
    tensor-parallel ranks, so the replicated activations stay identical; under sequence
    parallelism the block runs the layers under the model-parallel RNG fork instead, since each
    rank then holds a different slice of the sequence.

    Args:
        config (TransformerConfig): the model config.
        submodules (TransformerLayerSubmodules): the specs of the parts.
        layer_number (int): 1-based layer number within this pipeline stage / chunk; the
            stage offset is added to get the global number.
        hidden_dropout (float, optional): overrides config.hidden_dropout.
        pg_collection (ProcessGroupCollection, optional): groups handed to the attention and
            MLP (default: the global ones).
    """

    def __init__(
        self,
        config: TransformerConfig,
        submodules: TransformerLayerSubmodules,
        layer_number: int = 1,
        hidden_dropout: Optional[float] = None,
        pg_collection: Optional[ProcessGroupCollection] = None,
    ):
        super().__init__(config=config)
        self.pg_collection = resolve_process_groups(pg_collection, ("tp",))
        self.submodules_config = submodules

        self.layer_number = layer_number + get_transformer_layer_offset(self.config)
        self.hidden_dropout = config.hidden_dropout if hidden_dropout is None else hidden_dropout

        self.input_layernorm = build_module(
            submodules.input_layernorm,
            config=self.config,
            hidden_size=self.config.hidden_size,
            eps=self.config.layernorm_epsilon,
        )

        self.self_attention = build_module(
            submodules.self_attention,
            config=self.config,
            layer_number=self.layer_number,
            pg_collection=self.pg_collection,
        )
        self.self_attn_bda = build_module(submodules.self_attn_bda)

        self.pre_cross_attn_layernorm = build_module(
            submodules.pre_cross_attn_layernorm,
            config=self.config,
            hidden_size=self.config.hidden_size,
            eps=self.config.layernorm_epsilon,
        )
        self.cross_attention = build_module(
            submodules.cross_attention,
            config=self.config,
            layer_number=self.layer_number,
            pg_collection=self.pg_collection,
        )
        self.cross_attn_bda = build_module(submodules.cross_attn_bda, config=self.config)

        self.pre_mlp_layernorm = build_module(
            submodules.pre_mlp_layernorm,
            config=self.config,
            hidden_size=self.config.hidden_size,
            eps=self.config.layernorm_epsilon,
        )
        self.mlp = build_module(
            submodules.mlp, config=self.config, pg_collection=self.pg_collection
        )
        if hasattr(self.mlp, 'set_layer_number'):
            # An MoE layer records its auxiliary losses under the global layer number.
            self.mlp.set_layer_number(self.layer_number)
        self.mlp_bda = build_module(submodules.mlp_bda)

        # Megatron runs bias-dropout-add under this handler (a no-op here).
        self.bias_dropout_add_exec_handler = nullcontext

    def sharded_state_dict(self, prefix: str = '', sharded_offsets: tuple = (), metadata=None):
        """Distributed checkpoint of the layer, under Transformer Engine's names.

        `submodules.sharded_state_dict_keys_map` renames the checkpoint keys (not the dict
        keys): the local spec's separate norms are stored as
        `self_attention.linear_qkv.layer_norm_*` / `mlp.linear_fc1.layer_norm_*`, so local and
        TE checkpoints are interchangeable.
        """
        from megatron.core.dist_checkpointing.utils import apply_prefix_mapping

        sharded_state_dict = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        prefixed_map = {
            f'{prefix}{k}': f'{prefix}{v}'
            for k, v in self.submodules_config.sharded_state_dict_keys_map.items()
        }
        if prefixed_map:
            apply_prefix_mapping(sharded_state_dict, prefixed_map)
        return sharded_state_dict

    def _get_layer_offset(self) -> int:
        """The global index of this stage's first layer (see get_transformer_layer_offset)."""
        return get_transformer_layer_offset(self.config)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: Optional[torch.Tensor],
        context: Optional[torch.Tensor] = None,
        context_mask: Optional[torch.Tensor] = None,
        rotary_pos_emb: Optional[torch.Tensor] = None,
        inference_params=None,
        packed_seq_params=None,
    ):
        """hidden_states [s, b, h] -> (hidden_states [s, b, h], context)."""
        # Residual connection.
        residual = hidden_states

        input_layernorm_output = self.input_layernorm(hidden_states)
        if self.config.apply_residual_connection_post_layernorm:
            residual = input_layernorm_output

        attention_output_with_bias = self.self_attention(
            input_layernorm_output,
            attention_mask=attention_mask,
            inference_params=inference_params,
            rotary_pos_emb=rotary_pos_emb,
            packed_seq_params=packed_seq_params,
        )

        with self.bias_dropout_add_exec_handler():
            hidden_states = self.self_attn_bda(self.training, self.config.bias_dropout_fusion)(
                attention_output_with_bias, residual, self.hidden_dropout
            )

        residual = hidden_states

        pre_cross_attn_layernorm_output = self.pre_cross_attn_layernorm(hidden_states)
        if self.config.apply_residual_connection_post_layernorm and not isinstance(
            self.pre_cross_attn_layernorm, IdentityOp
        ):
            residual = pre_cross_attn_layernorm_output

        attention_output_with_bias = self.cross_attention(
            pre_cross_attn_layernorm_output,
            attention_mask=context_mask,
            key_value_states=context,
            inference_params=inference_params,
        )

        if isinstance(attention_output_with_bias, dict) and "context" in attention_output_with_bias:
            context = attention_output_with_bias["context"]

        with self.bias_dropout_add_exec_handler():
            hidden_states = self.cross_attn_bda(self.training, self.config.bias_dropout_fusion)(
                attention_output_with_bias, residual, self.hidden_dropout
            )

        residual = hidden_states

        pre_mlp_layernorm_output = self.pre_mlp_layernorm(hidden_states)
        if self.config.apply_residual_connection_post_layernorm:
            residual = pre_mlp_layernorm_output

        mlp_output_with_bias = self.mlp(pre_mlp_layernorm_output)

        with self.bias_dropout_add_exec_handler():
            hidden_states = self.mlp_bda(self.training, self.config.bias_dropout_fusion)(
                mlp_output_with_bias, residual, self.hidden_dropout
            )

        # The output may be sent to the next pipeline stage, which frees its storage: make it
        # viewless so that no base tensor is kept alive (see make_viewless_tensor).
        output = make_viewless_tensor(
            inp=hidden_states, requires_grad=hidden_states.requires_grad, keep_graph=True
        )
        return output, context
