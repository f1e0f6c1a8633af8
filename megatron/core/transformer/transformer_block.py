"""The stack of transformer layers held by one pipeline stage (or model chunk), plus the final norm.

Notation: s sequence (s/tp under sequence parallelism), b batch, h hidden size.
"""

from contextlib import nullcontext
from dataclasses import dataclass
from typing import List, Optional, Union

import torch
from torch import Tensor

from megatron.core import parallel_state, tensor_parallel
from megatron.core.process_groups_config import ProcessGroupCollection, resolve_process_groups
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.moe.moe_config_checks import moe_layer_pattern
from megatron.core.transformer.pipeline_layer_split import (
    pipeline_stage_layer_counts,
    uneven_split_requested,
)
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import BaseTransformerLayer
from megatron.core.utils import make_viewless_tensor


def get_num_layers_to_build(config: TransformerConfig) -> int:
    """Layers held by this pipeline stage (per model chunk with virtual pipeline)."""
    pp_size = parallel_state.get_pipeline_model_parallel_world_size()
    first, last = config.first_pipeline_num_layers, config.last_pipeline_num_layers
    if uneven_split_requested(first, last):
        # The config refuses virtual stages with an uneven split.
        counts = pipeline_stage_layer_counts(config.num_layers, pp_size, first, last)
        return counts[parallel_state.get_pipeline_model_parallel_rank()]
    if config.num_layers % pp_size != 0:
        raise ValueError(
            f"num_layers ({config.num_layers}) must be a multiple of the pipeline model parallel "
            f"size ({pp_size})"
        )
    num_layers_per_pipeline_rank = config.num_layers // pp_size
    vp_size = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    if vp_size is not None:
        if num_layers_per_pipeline_rank % vp_size != 0:
            raise ValueError(
                f"num_layers per pipeline stage ({num_layers_per_pipeline_rank}) must be a "
                f"multiple of the virtual pipeline size ({vp_size})"
            )
        # Interleaved schedule: each stage holds vp chunks of num_layers / (pp * vp) layers.
        return num_layers_per_pipeline_rank // vp_size
    return num_layers_per_pipeline_rank


@dataclass
class TransformerBlockSubmodules:
    """The layer specs of a block and the spec of its final norm."""

    layer_specs: List[ModuleSpec] = None
    layer_norm: Optional[Union[ModuleSpec, torch.nn.Module]] = None


# What a block is built from: its submodules, or one layer spec to repeat.
_BlockSpec = Union[TransformerBlockSubmodules, ModuleSpec]


def _get_block_submodules(
    config: TransformerConfig, spec: _BlockSpec
) -> TransformerBlockSubmodules:
    """Expand a block spec: a layer spec is repeated for every layer of this stage."""
    if isinstance(spec, TransformerBlockSubmodules):
        return spec
    if isinstance(spec, ModuleSpec):
        if issubclass(spec.module, TransformerBlock):
            return spec.submodules
        if issubclass(spec.module, BaseTransformerLayer):
            num_layers = get_num_layers_to_build(config)
            return TransformerBlockSubmodules(
                layer_specs=[spec] * num_layers, layer_norm=WrappedTorchNorm
            )
        raise Exception(f"specialize for {spec.module.__name__}.")
    raise Exception(f"specialize for {type(spec).__name__}.")


def _mixes_dense_and_moe_layers(config: TransformerConfig) -> bool:
    """Whether `moe_layer_freq` makes some layers dense and others MoE."""
    if not config.num_moe_experts:
        return False
    return len(set(moe_layer_pattern(config))) > 1


class TransformerBlock(MegatronModule):
    """The transformer layers of this pipeline stage and, on the last stage, the final norm.

    Args:
        config (TransformerConfig): the model config.
        spec: a layer spec (repeated for every layer of the stage) or TransformerBlockSubmodules.
        post_layer_norm (bool): add the final norm (on the last stage).
        pre_process (bool): first stage: the input comes from the embedding; otherwise from
            `set_input_tensor`.
        post_process (bool): last stage.
        pg_collection (ProcessGroupCollection, optional): groups handed to every layer
            (default: the global ones).
    """

    def __init__(
        self,
        config: TransformerConfig,
        spec: _BlockSpec,
        post_layer_norm: bool = True,
        pre_process: bool = True,
        post_process: bool = True,
        pg_collection: Optional[ProcessGroupCollection] = None,
    ):
        super().__init__(config=config)
        self.pg_collection = resolve_process_groups(pg_collection, ("tp",))

        self.submodules = _get_block_submodules(config, spec)
        self.post_layer_norm = post_layer_norm
        self.pre_process = pre_process
        self.post_process = post_process
        # Set by set_input_tensor on stages after the first.
        self.input_tensor = None

        self.checkpoint_core_attention = self.config.recompute_granularity == 'selective'

        self._build_layers()
        self.num_layers_per_pipeline_rank = len(self.layers)

    def _build_layers(self):
        # Layer numbers count from 1 within the stage; each layer adds its stage offset itself.
        self.layers = torch.nn.ModuleList(
            build_module(
                spec, config=self.config, layer_number=number, pg_collection=self.pg_collection
            )
            for number, spec in enumerate(self.submodules.layer_specs, start=1)
        )
        # Only the last stage normalises the block output.
        wants_final_norm = self.submodules.layer_norm and self.post_process and self.post_layer_norm
        self.final_layernorm = None
        if wants_final_norm:
            self.final_layernorm = build_module(
                self.submodules.layer_norm,
                config=self.config,
                hidden_size=self.config.hidden_size,
                eps=self.config.layernorm_epsilon,
            )

    def sharded_state_dict(self, prefix: str = '', sharded_offsets: tuple = (), metadata=None):
        """Distributed checkpoint: every layer parameter is one global tensor [num_layers, ...].

        Layer i of this stage (global index g = its layer_number - 1) is saved with the axis
        (0, g, num_layers) prepended and its keys renamed from `{prefix}layers.{i}.` to
        `{prefix}layers.`, so pipeline / virtual-pipeline stages write disjoint slices of the
        same tensors and any other split reads them. With metadata
        `{'non_homogeneous_layers': True}`, or when `moe_layer_freq` mixes dense and MoE layers
        (whose parameters differ, so no tensor spans all layers), the keys are
        `{prefix}layers.{g}.` instead. An expert axis is prepended by the MoE layer after this
        one.
        """
        from megatron.core.dist_checkpointing.utils import (
            replace_prefix_for_sharding,
            sharded_state_dict_default,
        )

        non_homogeneous = bool(metadata and metadata.get('non_homogeneous_layers'))
        non_homogeneous = non_homogeneous or _mixes_dense_and_moe_layers(self.config)
        sharded_state_dict = {}
        layer_prefix = f'{prefix}layers.'
        for local_index, layer in enumerate(self.layers):
            global_index = layer.layer_number - 1
            state_dict_prefix = f'{layer_prefix}{local_index}.'
            if non_homogeneous:
                sharded_prefix, layer_offsets = f'{layer_prefix}{global_index}.', ()
            else:
                sharded_prefix = layer_prefix
                layer_offsets = ((0, global_index, self.config.num_layers),)
            layer_sd = layer.sharded_state_dict(state_dict_prefix, layer_offsets, metadata)
            replace_prefix_for_sharding(layer_sd, state_dict_prefix, sharded_prefix)
            sharded_state_dict.update(layer_sd)
        for name, module in self.named_children():
            if module is not self.layers:
                sharded_state_dict.update(
                    sharded_state_dict_default(
                        module, f'{prefix}{name}.', sharded_offsets, metadata
                    )
                )
        return sharded_state_dict

    def _get_layer(self, layer_number: int):
        """The layer at 0-based position `layer_number` of this stage."""
        return self.layers[layer_number]

    def _recompute_segments(self):
        """(start, end, checkpointed) for each run of layers under full recomputation.

        'uniform': groups of recompute_num_layers layers, each checkpointed (only the group
        inputs are stored); 'block': the first recompute_num_layers layers checkpointed one by
        one, the rest run normally.
        """
        count = self.num_layers_per_pipeline_rank
        group = self.config.recompute_num_layers
        method = self.config.recompute_method
        if method == 'uniform':
            return [(first, min(first + group, count), True) for first in range(0, count, group)]
        if method == 'block':
            return [(index, index + 1, index < group) for index in range(count)]
        raise ValueError(f"Invalid activation recompute method {method!r}.")

    def _layer_range_forward(self, start: int, end: int, packed_seq_params):
        """A function running layers [start, end) of the stage, with positional tensor inputs
        as tensor_parallel.checkpoint hands them over."""

        def run(hidden_states, attention_mask, context, context_mask, rotary_pos_emb):
            for index in range(start, end):
                hidden_states, context = self._get_layer(index)(
                    hidden_states=hidden_states,
                    context=context,
                    **self._layer_kwargs(
                        attention_mask, context_mask, rotary_pos_emb, None, packed_seq_params
                    ),
                )
            return hidden_states, context

        return run

    @staticmethod
    def _layer_kwargs(
        attention_mask, context_mask, rotary_pos_emb, inference_params, packed_seq_params
    ):
        """The inputs every layer receives unchanged from the block."""
        return {
            'attention_mask': attention_mask,
            'context_mask': context_mask,
            'rotary_pos_emb': rotary_pos_emb,
            'inference_params': inference_params,
            'packed_seq_params': packed_seq_params,
        }

    def _checkpointed_forward(
        self,
        hidden_states: Tensor,
        attention_mask: Optional[Tensor],
        context: Optional[Tensor],
        context_mask: Optional[Tensor],
        rotary_pos_emb: Optional[Tensor],
        packed_seq_params=None,
    ):
        """Full activation recomputation: only the inputs of checkpointed layer groups are kept,
        the layers are re-run in backward (tensor_parallel.checkpoint restores the RNG states so
        dropout masks are the same)."""
        for start, end, checkpointed in self._recompute_segments():
            run = self._layer_range_forward(start, end, packed_seq_params)
            inputs = (hidden_states, attention_mask, context, context_mask, rotary_pos_emb)
            if checkpointed:
                keep_sharded = self.config.distribute_saved_activations
                hidden_states, context = tensor_parallel.checkpoint(run, keep_sharded, *inputs)
            else:
                hidden_states, context = run(*inputs)
        return hidden_states

    def set_input_tensor(self, input_tensor: Tensor):
        """Set the input of this stage (the previous stage's output) for pipeline parallelism.

        The pipeline schedule calls this on every stage; the first stage ignores it and reads the
        embedding output passed to forward.
        """
        self.input_tensor = input_tensor

    def forward(
        self,
        hidden_states: Tensor,
        attention_mask: Optional[Tensor],
        context: Tensor = None,
        context_mask: Tensor = None,
        rotary_pos_emb: Tensor = None,
        inference_params=None,
        packed_seq_params=None,
    ):
        """hidden_states [s, b, h] (ignored on stages after the first) -> [s, b, h]."""
        # Later pipeline stages take their input from set_input_tensor(), not the argument.
        hidden_states = hidden_states if self.pre_process else self.input_tensor

        # The pipeline schedule frees this tensor's storage after sending it: keep it viewless.
        hidden_states = make_viewless_tensor(inp=hidden_states, requires_grad=True, keep_graph=True)

        # Under sequence parallelism each TP rank holds a different slice of the sequence, so
        # dropout masks come from the model-parallel RNG, which differs across TP ranks.
        sequence_parallel = self.config.sequence_parallel
        rng_context = (
            tensor_parallel.get_cuda_rng_tracker().fork() if sequence_parallel else nullcontext()
        )
        full_recompute = self.config.recompute_granularity == 'full' and self.training
        with rng_context:
            if full_recompute:
                layer_inputs = (attention_mask, context, context_mask, rotary_pos_emb)
                hidden_states = self._checkpointed_forward(
                    hidden_states, *layer_inputs, packed_seq_params=packed_seq_params
                )
            else:
                shared = self._layer_kwargs(
                    attention_mask,
                    context_mask,
                    rotary_pos_emb,
                    inference_params,
                    packed_seq_params,
                )
                for layer in self.layers:
                    hidden_states, context = layer(
                        hidden_states=hidden_states, context=context, **shared
                    )

        if self.final_layernorm is not None:
            hidden_states = self.final_layernorm(hidden_states)
            # Viewless for the same reason as above (the last stage's output may be kept).
            hidden_states = make_viewless_tensor(
                inp=hidden_states, requires_grad=True, keep_graph=True
            )

        return hidden_states
