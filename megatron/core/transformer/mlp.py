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

    linear_fc1: Union[ModuleSpec, type] = None
    linear_fc2: Union[ModuleSpec, type] = None


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
        self.input_size = input_size if input_size is not None else self.config.hidden_size

        if ffn_hidden_size is None:
            ffn_hidden_size = self.config.ffn_hidden_size
        self.ffn_hidden_size = ffn_hidden_size
        if self.config.gated_linear_unit:
            ffn_hidden_size *= 2

        self.linear_fc1 = build_module(
            submodules.linear_fc1,
            self.input_size,
            ffn_hidden_size,
            config=self.config,
            init_method=self.config.init_method,
            gather_output=False,
            bias=self.config.add_bias_linear,
            skip_bias_add=True,
            is_expert=is_expert,
            tp_comm_buffer_name='fc1',
            tp_group=self.pg_collection.tp,
        )

        self.activation_func = self.config.activation_func

        self.linear_fc2 = build_module(
            submodules.linear_fc2,
            self.ffn_hidden_size,
            self.config.hidden_size,
            config=self.config,
            init_method=self.config.output_layer_init_method,
            bias=self.config.add_bias_linear,
            input_is_parallel=True,
            skip_bias_add=True,
            is_expert=is_expert,
            tp_comm_buffer_name='fc2',
            tp_group=self.pg_collection.tp,
        )

    def sharded_state_dict(self, prefix: str = '', sharded_offsets: tuple = (), metadata=None):
        """Distributed checkpoint; with a gated linear unit fc1 is stored as [W; V] (the TP=1
        layout, see apply_swiglu_sharded_factory), so it reshards across TP."""
        from megatron.core.dist_checkpointing.utils import apply_swiglu_sharded_factory

        sharded_state_dict = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        if self.config.gated_linear_unit:
            for name in ('weight', 'bias'):
                key = f'{prefix}linear_fc1.{name}'
                if key in sharded_state_dict:
                    sharded_state_dict[key] = apply_swiglu_sharded_factory(
                        sharded_state_dict[key], sharded_offsets
                    )
        return sharded_state_dict

    def forward(self, hidden_states: torch.Tensor):
        """hidden_states [s, b, h] -> (output [s, b, h], output_bias [h] or None)."""
        # [s, b, h] -> [s, b, f/p] (2f/p when gated)
        intermediate_parallel, bias_parallel = self.linear_fc1(hidden_states)

        if self.config.bias_activation_fusion:
            if self.activation_func == F.gelu:
                assert self.config.add_bias_linear is True
                intermediate_parallel = bias_gelu_impl(intermediate_parallel, bias_parallel)
            elif self.activation_func == F.silu and self.config.gated_linear_unit:
                intermediate_parallel = bias_swiglu_impl(
                    intermediate_parallel,
                    bias_parallel,
                    self.config.activation_func_fp8_input_store,
                )
            else:
                raise ValueError("Only support fusion of gelu and swiglu")
        else:
            if bias_parallel is not None:
                intermediate_parallel = intermediate_parallel + bias_parallel
            if self.config.gated_linear_unit:

                def glu(x):
                    x = torch.chunk(x, 2, dim=-1)  # [s, b, 2f/p] -> 2 x [s, b, f/p]
                    return self.config.activation_func(x[0]) * x[1]

                intermediate_parallel = glu(intermediate_parallel)
            else:
                intermediate_parallel = self.activation_func(intermediate_parallel)

        # [s, b, f/p] -> [s, b, h]
        output, output_bias = self.linear_fc2(intermediate_parallel)
        return output, output_bias
