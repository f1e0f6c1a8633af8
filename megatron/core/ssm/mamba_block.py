"""The layers of a hybrid Mamba / attention / MLP model held by one pipeline stage
(`MambaStack`), plus the final norm.

Notation: s sequence (s/tp under sequence parallelism), b batch, H hidden size, L layers.
"""

from contextlib import nullcontext
from dataclasses import dataclass
from typing import List, Optional, Union

import torch
from torch import Tensor

from megatron.core import parallel_state, tensor_parallel
from megatron.core.process_groups_config import ProcessGroupCollection, resolve_process_groups
from megatron.core.ssm.mamba_hybrid_layer_allocation import Symbols, allocate_layers
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import make_viewless_tensor


@dataclass
class MambaStackSubmodules:
    """Specs of the three layer types ('M', '*', '-')."""

    mamba_layer: Union[ModuleSpec, type] = IdentityOp
    attention_layer: Union[ModuleSpec, type] = IdentityOp
    mlp_layer: Union[ModuleSpec, type] = IdentityOp


def select_stage_layers(layer_type_list: List[str], pp_size: int, pp_rank: int):
    """(this stage's symbols, the global index of its first layer).

    Layers are split evenly; an uneven count is refused (Megatron core_r0.8.0 silently drops the
    remainder)."""
    total = len(layer_type_list)
    if total % pp_size != 0:
        raise ValueError(
            f"num_layers ({total}) of the hybrid model must be divisible by "
            f"pipeline_model_parallel_size ({pp_size})"
        )
    per_stage = total // pp_size
    offset = pp_rank * per_stage
    return layer_type_list[offset : offset + per_stage], offset


class MambaStack(MegatronModule):
    """The hybrid layers of this pipeline stage and, on the last stage, the final norm.

    The full pattern of config.num_layers layers comes from `allocate_layers` (ratios or the
    override pattern); this stage builds its contiguous share. Mamba layers get the global
    layer number (offset + local index + 1); attention and MLP layers (TransformerLayers) get
    the local one and add the stage offset themselves, so every layer number is global.

    With config.recompute_granularity == 'full' the layers are re-run in backward
    (recompute_method 'uniform' or 'block', recompute_num_layers), as in TransformerBlock.

    Args:
        config (TransformerConfig): the model config.
        submodules (MambaStackSubmodules): the layer specs.
        residual_in_fp32: keep Mamba layers' residuals in fp32.
        pre_process: first stage (input from the embedding).
        hybrid_attention_ratio, hybrid_mlp_ratio, hybrid_override_pattern: the allocation.
        post_layer_norm: add the final norm on the last stage.
        post_process: last stage.
        pg_collection (ProcessGroupCollection, optional): groups of every layer.
    """

    def __init__(
        self,
        config: TransformerConfig,
        submodules: MambaStackSubmodules,
        mamba_ssm_ngroups: Optional[int] = None,
        residual_in_fp32: bool = False,
        pre_process: bool = True,
        hybrid_attention_ratio: float = 0.0,
        hybrid_mlp_ratio: float = 0.0,
        hybrid_override_pattern: Optional[str] = None,
        post_layer_norm: bool = True,
        post_process: bool = True,
        device=None,
        dtype=None,
        pg_collection: Optional[ProcessGroupCollection] = None,
    ) -> None:
        super().__init__(config=config)
        if mamba_ssm_ngroups is not None and mamba_ssm_ngroups != config.mamba_num_groups:
            raise ValueError(
                f"mamba_ssm_ngroups ({mamba_ssm_ngroups}) differs from config.mamba_num_groups "
                f"({config.mamba_num_groups}); set the config field"
            )
        self.pg_collection = resolve_process_groups(pg_collection, ("tp",))
        self.pre_process = pre_process
        self.post_process = post_process
        self.post_layer_norm = post_layer_norm
        self.input_tensor = None

        self.layer_type_list = allocate_layers(
            config.num_layers, hybrid_attention_ratio, hybrid_mlp_ratio, hybrid_override_pattern
        )
        pp_size = parallel_state.get_pipeline_model_parallel_world_size()
        pp_rank = parallel_state.get_pipeline_model_parallel_rank() if pp_size > 1 else 0
        if parallel_state.get_virtual_pipeline_model_parallel_world_size() is not None:
            raise ValueError(
                "The Mamba hybrid model does not currently support virtual/interleaved "
                "pipeline parallelism"
            )
        stage_types, self.layer_offset = select_stage_layers(self.layer_type_list, pp_size, pp_rank)

        layers = []
        for index, layer_type in enumerate(stage_types):
            if layer_type == Symbols.MAMBA:
                layer = build_module(
                    submodules.mamba_layer,
                    config=self.config,
                    residual_in_fp32=residual_in_fp32,
                    layer_number=index + 1 + self.layer_offset,
                    pg_collection=self.pg_collection,
                )
            else:
                spec = (
                    submodules.attention_layer
                    if layer_type == Symbols.ATTENTION
                    else submodules.mlp_layer
                )
                layer = build_module(
                    spec,
                    config=self.config,
                    layer_number=index + 1,
                    pg_collection=self.pg_collection,
                )
            layers.append(layer)
        self.layers = torch.nn.ModuleList(layers)
        self.stage_layer_types = stage_types
        self.num_layers_per_pipeline_rank = len(self.layers)

        if self.post_process and self.post_layer_norm:
            from megatron.core.transformer.torch_norm import WrappedTorchNorm

            self.final_norm = WrappedTorchNorm(
                self.config, self.config.hidden_size, eps=self.config.layernorm_epsilon
            )
        else:
            self.final_norm = None

    def sharded_state_dict(self, prefix: str = '', sharded_offsets: tuple = (), metadata=None):
        """Distributed checkpoint with global layer keys: local layer i is stored under
        `{prefix}layers.{layer_number - 1}.` (hybrid layers differ, so there is no stacked layer
        axis), which makes the checkpoint independent of the pipeline split."""
        from megatron.core.dist_checkpointing.utils import (
            replace_prefix_for_sharding,
            sharded_state_dict_default,
        )

        out = {}
        for index, layer in enumerate(self.layers):
            local = f'{prefix}layers.{index}.'
            layer_sd = layer.sharded_state_dict(local, sharded_offsets, metadata)
            replace_prefix_for_sharding(
                layer_sd, local, f'{prefix}layers.{layer.layer_number - 1}.'
            )
            out.update(layer_sd)
        for name, module in self.named_children():
            if module is not self.layers:
                out.update(
                    sharded_state_dict_default(
                        module, f'{prefix}{name}.', sharded_offsets, metadata
                    )
                )
        return out

    def set_input_tensor(self, input_tensor: Tensor) -> None:
        """The previous stage's output (pipeline parallelism)."""
        self.input_tensor = input_tensor

    def _run_layer(
        self,
        layer,
        hidden_states,
        attention_mask,
        inference_params,
        rotary_pos_emb,
        seq_idx,
        packed_seq_params=None,
    ):
        if layer_is_mamba(layer):
            return layer(
                hidden_states,
                attention_mask=attention_mask,
                inference_params=inference_params,
                rotary_pos_emb=rotary_pos_emb,
                seq_idx=seq_idx,
                packed_seq_params=packed_seq_params,
            )
        hidden_states, _ = layer(
            hidden_states=hidden_states,
            attention_mask=attention_mask,
            inference_params=inference_params,
            rotary_pos_emb=rotary_pos_emb,
            packed_seq_params=packed_seq_params,
        )
        return hidden_states

    def _checkpointed_forward(
        self, hidden_states, attention_mask, rotary_pos_emb, seq_idx, packed_seq_params=None
    ):
        """Full recompute: only the inputs of checkpointed layer groups are kept."""

        def group(start: int, end: int):
            def run(hidden_states, attention_mask, rotary_pos_emb, seq_idx):
                for index in range(start, end):
                    hidden_states = self._run_layer(
                        self.layers[index],
                        hidden_states,
                        attention_mask,
                        None,
                        rotary_pos_emb,
                        seq_idx,
                        packed_seq_params,
                    )
                return hidden_states

            return run

        def checkpointed(run):
            return tensor_parallel.checkpoint(
                run,
                self.config.distribute_saved_activations,
                hidden_states,
                attention_mask,
                rotary_pos_emb,
                seq_idx,
            )

        count = len(self.layers)
        step = self.config.recompute_num_layers or 1
        if self.config.recompute_method == 'uniform':
            for start in range(0, count, step):
                hidden_states = checkpointed(group(start, min(start + step, count)))
        elif self.config.recompute_method == 'block':
            for index in range(count):
                run = group(index, index + 1)
                if index < step:
                    hidden_states = checkpointed(run)
                else:
                    hidden_states = run(hidden_states, attention_mask, rotary_pos_emb, seq_idx)
        else:
            raise ValueError(
                f"Invalid activation recompute method {self.config.recompute_method!r}."
            )
        return hidden_states

    def forward(
        self,
        hidden_states: Tensor,
        attention_mask: Optional[Tensor],
        inference_params=None,
        rotary_pos_emb: Optional[Tensor] = None,
        seq_idx: Optional[Tensor] = None,
        packed_seq_params=None,
    ) -> Tensor:
        """hidden_states [s, b, H] (ignored after the first stage) -> [s, b, H].

        Args:
            attention_mask: for the attention layers (Mamba layers use seq_idx instead).
            inference_params (InferenceParams): KV and conv / SSM state caches.
            rotary_pos_emb: RoPE angles for the attention layers.
            seq_idx: [b, s] document ids of packed documents (Mamba layers).
            packed_seq_params (PackedSeqParams): packed sequences for the attention layers
                (the Mamba layers read the same boundaries from seq_idx, or under context
                parallelism from packed_seq_params: the per-sequence split).
        """
        # Later pipeline stages read the previous stage's output (set_input_tensor).
        hidden_states = hidden_states if self.pre_process else self.input_tensor
        # Viewless, as the pipeline schedule frees the storage of the tensor it sends.
        hidden_states = make_viewless_tensor(inp=hidden_states, requires_grad=True, keep_graph=True)
        # Under sequence parallelism the TP ranks hold different tokens: their dropout masks
        # come from the model-parallel RNG stream.
        rng_context = nullcontext()
        if self.config.sequence_parallel:
            rng_context = tensor_parallel.get_cuda_rng_tracker().fork()
        full_recompute = self.config.recompute_granularity == 'full' and self.training
        with rng_context:
            if full_recompute:
                hidden_states = self._checkpointed_forward(
                    hidden_states, attention_mask, rotary_pos_emb, seq_idx, packed_seq_params
                )
            else:
                for layer in self.layers:
                    hidden_states = self._run_layer(
                        layer,
                        hidden_states,
                        attention_mask,
                        inference_params,
                        rotary_pos_emb,
                        seq_idx,
                        packed_seq_params,
                    )
        if self.final_norm is not None:
            hidden_states = self.final_norm(hidden_states)
            hidden_states = make_viewless_tensor(
                inp=hidden_states, requires_grad=True, keep_graph=True
            )
        return hidden_states


def layer_is_mamba(layer: torch.nn.Module) -> bool:
    """Whether a stack layer is a MambaLayer (not a TransformerLayer)."""
    from megatron.core.ssm.mamba_layer import MambaLayer

    return isinstance(layer, MambaLayer)
