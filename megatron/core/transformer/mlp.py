"""The transformer MLP: h -> ffn -> h, with GeLU or a gated (SwiGLU-style) activation.

Notation: s sequence, b batch, h hidden size, f ffn_hidden_size, p tensor-parallel size.
"""

from dataclasses import dataclass
from typing import Optional, Union

import torch
import torch.nn.functional as F

from megatron.core.fusions.fused_bias_gelu import bias_gelu_impl
from megatron.core.fusions.fused_bias_swiglu import bias_swiglu_impl
from megatron.core.process_groups_config import ProcessGroupCollection, resolve_process_groups
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_config import TransformerConfig


@dataclass
class MLPSubmodules:
    """Specs of the two linear layers of `MLP`."""

    linear_fc1: Optional[Union[ModuleSpec, type]] = None
    linear_fc2: Optional[Union[ModuleSpec, type]] = None


class MLP(MegatronModule):
    """MLP: Y = act(X A + a) B + b.

    `linear_fc1` is a ColumnParallelLinear: A [h, f] is split along f (each rank computes f/p
    outputs, no communication in forward, all-reduce of the input gradient in backward). With
    `gated_linear_unit` it outputs 2f and each rank's weight rows are [W_rank; V_rank] (gate half,
    then up half); the activation is act(X W) * (X V). `linear_fc2` is a RowParallelLinear: B is
    split along f, its output is all-reduced (reduce-scattered along s under sequence
    parallelism). Both biases are returned unapplied where the fused ops add them.

    Args:
        config (TransformerConfig): the model config.
        submodules (MLPSubmodules): the two linear layers.
        is_expert (bool): an MoE expert: its linears skip their tensor-parallel communication
            when tp or ep > 1 (the token dispatcher moves and reduces the rows) and draw their
            initialization from the expert-parallel RNG stream.
        input_size (int, optional): input size (default config.hidden_size).
        ffn_hidden_size (int, optional): f (default config.ffn_hidden_size; MoE experts and
            shared experts have their own).
        pg_collection (ProcessGroupCollection, optional): its `tp` group splits f (default: the
            global tensor model parallel group).
    """

    def __init__(
        self,
        config: TransformerConfig,
        submodules: MLPSubmodules,
        is_expert: bool = False,
        input_size: Optional[int] = None,
        pg_collection: Optional[ProcessGroupCollection] = None,
        ffn_hidden_size: Optional[int] = None,
    ):
        super().__init__(config=config)
        self.config = config
        self.pg_collection = resolve_process_groups(pg_collection, ("tp",))
        cfg = self.config
        self.input_size = cfg.hidden_size if input_size is None else input_size
        self.ffn_hidden_size = cfg.ffn_hidden_size if ffn_hidden_size is None else ffn_hidden_size
        # A gated unit computes its gate and up projections in one fc1 of twice the width.
        fc1_width = self.ffn_hidden_size * (2 if cfg.gated_linear_unit else 1)
        # Both biases are returned unapplied: the activation (fc1) and the bias-dropout-add of
        # the layer (fc2) add them in their fused kernels.
        shared = {
            'config': cfg,
            'bias': cfg.add_bias_linear,
            'skip_bias_add': True,
            'is_expert': is_expert,
            'tp_group': self.pg_collection.tp,
        }
        # [s, b, h] -> [s, b, fc1_width / p]
        self.linear_fc1 = build_module(
            submodules.linear_fc1,
            self.input_size,
            fc1_width,
            init_method=cfg.init_method,
            gather_output=False,
            tp_comm_buffer_name='fc1',
            **shared,
        )
        self.activation_func = cfg.activation_func
        # [s, b, f/p] -> [s, b, h], summed across TP
        self.linear_fc2 = build_module(
            submodules.linear_fc2,
            self.ffn_hidden_size,
            cfg.hidden_size,
            init_method=cfg.output_layer_init_method,
            input_is_parallel=True,
            tp_comm_buffer_name='fc2',
            **shared,
        )

    def sharded_state_dict(self, prefix: str = '', sharded_offsets: tuple = (), metadata=None):
        """Distributed checkpoint; with a gated linear unit fc1 is stored as [W; V] (the TP=1
        layout, see apply_swiglu_sharded_factory), so it reshards across TP."""
        from megatron.core.dist_checkpointing.utils import apply_swiglu_sharded_factory

        state = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        if not self.config.gated_linear_unit:
            return state
        for key in (f'{prefix}linear_fc1.weight', f'{prefix}linear_fc1.bias'):
            if key in state:
                state[key] = apply_swiglu_sharded_factory(state[key], sharded_offsets)
        return state

    def _fused_bias_activation(self, fc1_out, fc1_bias):
        """One kernel for the bias add and the activation (GeLU, or SwiGLU when gated)."""
        if self.activation_func == F.gelu:
            assert self.config.add_bias_linear is True
            return bias_gelu_impl(fc1_out, fc1_bias)
        if self.activation_func == F.silu and self.config.gated_linear_unit:
            return bias_swiglu_impl(fc1_out, fc1_bias, self.config.activation_func_fp8_input_store)
        raise ValueError("Only support fusion of gelu and swiglu")

    def _activate(self, fc1_out, fc1_bias):
        """act(fc1_out + fc1_bias); a gated unit multiplies act(gate half) by the up half."""
        if self.config.bias_activation_fusion:
            return self._fused_bias_activation(fc1_out, fc1_bias)
        if fc1_bias is not None:
            fc1_out = fc1_out + fc1_bias
        if not self.config.gated_linear_unit:
            return self.activation_func(fc1_out)
        gate, up = torch.chunk(fc1_out, 2, dim=-1)  # [s, b, 2f/p] -> 2 x [s, b, f/p]
        return self.config.activation_func(gate) * up

    def forward(self, hidden_states: torch.Tensor):
        """hidden_states [s, b, h] -> (output [s, b, h], output_bias [h] or None)."""
        # [s, b, h] -> [s, b, f/p] (2f/p when gated)
        fc1_out, fc1_bias = self.linear_fc1(hidden_states)
        # [s, b, f/p] -> [s, b, h]
        return self.linear_fc2(self._activate(fc1_out, fc1_bias))
