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
from megatron.core.transformer.pipeline_layer_split import (
    pipeline_stage_layer_offset,
    uneven_split_requested,
)
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
    first, last = config.first_pipeline_num_layers, config.last_pipeline_num_layers
    if uneven_split_requested(first, last):
        return pipeline_stage_layer_offset(config.num_layers, pp_size, pipeline_rank, first, last)
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


# A spec slot: a ModuleSpec or a bare class (IdentityOp / IdentityFuncOp leave the part out).
_Spec = Union[ModuleSpec, type]


@dataclass
class TransformerLayerSubmodules:
    """Specs of the submodules of `TransformerLayer` (IdentityOp / IdentityFuncOp = absent).

    Each of the three sublayers (self attention, cross attention, MLP) is a norm, the sublayer
    itself and a bias-dropout-add (bda) onto the residual.
    """

    input_layernorm: _Spec = IdentityOp
    self_attention: _Spec = IdentityOp
    self_attn_bda: _Spec = IdentityFuncOp

    pre_cross_attn_layernorm: _Spec = IdentityOp
    cross_attention: _Spec = IdentityOp
    cross_attn_bda: _Spec = IdentityFuncOp

    pre_mlp_layernorm: _Spec = IdentityOp
    mlp: _Spec = IdentityOp
    mlp_bda: _Spec = IdentityFuncOp

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

        # Built in forward order, which is also the order of the weight-init draws.
        self.input_layernorm = self._build_norm(submodules.input_layernorm)
        self.self_attention = self._build_mixer(submodules.self_attention, self.layer_number)
        self.self_attn_bda = build_module(submodules.self_attn_bda)

        self.pre_cross_attn_layernorm = self._build_norm(submodules.pre_cross_attn_layernorm)
        self.cross_attention = self._build_mixer(submodules.cross_attention, self.layer_number)
        self.cross_attn_bda = build_module(submodules.cross_attn_bda, config=self.config)

        self.pre_mlp_layernorm = self._build_norm(submodules.pre_mlp_layernorm)
        self.mlp = self._build_mixer(submodules.mlp)
        if hasattr(self.mlp, 'set_layer_number'):
            # An MoE layer records its auxiliary losses under the global layer number.
            self.mlp.set_layer_number(self.layer_number)
        self.mlp_bda = build_module(submodules.mlp_bda)

        # Megatron runs bias-dropout-add under this handler (a no-op here).
        self.bias_dropout_add_exec_handler = nullcontext

    def _build_norm(self, spec):
        """A norm over the hidden size h (an IdentityOp spec ignores the arguments)."""
        return build_module(
            spec,
            config=self.config,
            hidden_size=self.config.hidden_size,
            eps=self.config.layernorm_epsilon,
        )

    def _build_mixer(self, spec, layer_number=None):
        """An attention (given the global layer number) or an MLP, on this layer's groups."""
        extra = {} if layer_number is None else {'layer_number': layer_number}
        return build_module(spec, config=self.config, pg_collection=self.pg_collection, **extra)

    def sharded_state_dict(self, prefix: str = '', sharded_offsets: tuple = (), metadata=None):
        """Distributed checkpoint of the layer, under Transformer Engine's names.

        `submodules.sharded_state_dict_keys_map` renames the checkpoint keys (not the dict
        keys): the local spec's separate norms are stored as
        `self_attention.linear_qkv.layer_norm_*` / `mlp.linear_fc1.layer_norm_*`, so local and
        TE checkpoints are interchangeable.
        """
        from megatron.core.dist_checkpointing.utils import apply_prefix_mapping

        state = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        renames = self.submodules_config.sharded_state_dict_keys_map
        if renames:
            # Both sides of each rename live under this layer's prefix.
            apply_prefix_mapping(
                state, {prefix + ours: prefix + te for ours, te in renames.items()}
            )
        return state

    def _get_layer_offset(self) -> int:
        """The global index of this stage's first layer (see get_transformer_layer_offset)."""
        return get_transformer_layer_offset(self.config)

    def _norm_and_residual(self, norm, hidden_states, post_norm_residual):
        """(norm(hidden_states), residual): the residual is the norm's output instead of its
        input when post_norm_residual (apply_residual_connection_post_layernorm) holds."""
        normed = norm(hidden_states)
        return normed, (normed if post_norm_residual else hidden_states)

    def _bias_dropout_add(self, bda, output_with_bias, residual):
        """residual + dropout(output + bias), fused when config.bias_dropout_fusion."""
        with self.bias_dropout_add_exec_handler():
            add = bda(self.training, self.config.bias_dropout_fusion)
            return add(output_with_bias, residual, self.hidden_dropout)

    def _self_attention_step(
        self, hidden_states, attention_mask, rotary_pos_emb, inference_params, packed_seq_params
    ):
        """Norm, self attention, bias-dropout-add: [s, b, h] -> [s, b, h]."""
        normed, residual = self._norm_and_residual(
            self.input_layernorm,
            hidden_states,
            self.config.apply_residual_connection_post_layernorm,
        )
        out_with_bias = self.self_attention(
            normed,
            attention_mask=attention_mask,
            inference_params=inference_params,
            rotary_pos_emb=rotary_pos_emb,
            packed_seq_params=packed_seq_params,
        )
        return self._bias_dropout_add(self.self_attn_bda, out_with_bias, residual)

    def _cross_attention_step(self, hidden_states, context, context_mask, inference_params):
        """Norm, cross attention over `context`, bias-dropout-add -> (hidden_states, context)."""
        # Without a cross-attention norm there is no post-norm output to take as residual.
        post_norm = self.config.apply_residual_connection_post_layernorm and not isinstance(
            self.pre_cross_attn_layernorm, IdentityOp
        )
        normed, residual = self._norm_and_residual(
            self.pre_cross_attn_layernorm, hidden_states, post_norm
        )
        out_with_bias = self.cross_attention(
            normed,
            attention_mask=context_mask,
            key_value_states=context,
            inference_params=inference_params,
        )
        # A cross attention may hand back an updated context along with its output.
        if isinstance(out_with_bias, dict) and "context" in out_with_bias:
            context = out_with_bias["context"]
        return self._bias_dropout_add(self.cross_attn_bda, out_with_bias, residual), context

    def _mlp_step(self, hidden_states):
        """Norm, MLP (or MoE), bias-dropout-add: [s, b, h] -> [s, b, h]."""
        normed, residual = self._norm_and_residual(
            self.pre_mlp_layernorm,
            hidden_states,
            self.config.apply_residual_connection_post_layernorm,
        )
        return self._bias_dropout_add(self.mlp_bda, self.mlp(normed), residual)

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
        hidden_states = self._self_attention_step(
            hidden_states, attention_mask, rotary_pos_emb, inference_params, packed_seq_params
        )
        hidden_states, context = self._cross_attention_step(
            hidden_states, context, context_mask, inference_params
        )
        hidden_states = self._mlp_step(hidden_states)

        # The output may be sent to the next pipeline stage, which frees its storage: make it
        # viewless so that no base tensor is kept alive (see make_viewless_tensor).
        output = make_viewless_tensor(
            inp=hidden_states, requires_grad=hidden_states.requires_grad, keep_graph=True
        )
        return output, context
