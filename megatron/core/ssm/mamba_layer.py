"""One Mamba layer of a hybrid stack: residual + dropout(mixer(norm(x)))."""

from dataclasses import dataclass, field
from typing import Dict, Optional, Union

import torch
from torch import Tensor

from megatron.core.process_groups_config import ProcessGroupCollection, resolve_process_groups
from megatron.core.transformer.identity_op import IdentityFuncOp, IdentityOp
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import make_viewless_tensor


@dataclass
class MambaLayerSubmodules:
    """Specs of a Mamba layer: the norm (identity when fused into the mixer's in_proj), the
    mixer and the bias-dropout-add."""

    norm: Union[ModuleSpec, type] = IdentityOp
    mixer: Union[ModuleSpec, type] = IdentityOp
    mamba_bda: Union[ModuleSpec, type] = IdentityFuncOp
    sharded_state_dict_keys_map: Dict[str, str] = field(default_factory=dict)


class MambaLayer(MegatronModule):
    """x -> x + dropout(mixer(norm(x))), [s, b, H] -> [s, b, H].

    The residual stays in the input dtype unless config.fp32_residual_connection (which
    Megatron core_r0.8.0 ignores here; later versions honour it, as this one does); the mixer
    input is cast to params_dtype.

    Args:
        config (TransformerConfig): the model config.
        submodules (MambaLayerSubmodules): the parts.
        layer_number (int): 1-based global layer number (keys the inference cache).
        pg_collection (ProcessGroupCollection, optional): groups (tp splits the mixer).
    """

    def __init__(
        self,
        config: TransformerConfig,
        submodules: MambaLayerSubmodules,
        layer_number: int = 1,
        residual_in_fp32: bool = False,
        pg_collection: Optional[ProcessGroupCollection] = None,
    ):
        super().__init__(config=config)
        self.pg_collection = resolve_process_groups(pg_collection, ("tp",))
        self.layer_number = layer_number
        self.residual_in_fp32 = residual_in_fp32 or config.fp32_residual_connection
        self.hidden_dropout = config.hidden_dropout
        self.mixer = build_module(
            submodules.mixer,
            config=self.config,
            d_model=self.config.hidden_size,
            layer_number=layer_number,
            pg_collection=self.pg_collection,
        )
        self.norm = build_module(
            submodules.norm, self.config, self.config.hidden_size, eps=config.layernorm_epsilon
        )
        self.mamba_bda = build_module(submodules.mamba_bda)

    def forward(
        self,
        hidden_states: Tensor,
        attention_mask: Optional[Tensor] = None,
        inference_params=None,
        rotary_pos_emb: Optional[Tensor] = None,
        seq_idx: Optional[Tensor] = None,
        packed_seq_params=None,
    ) -> Tensor:
        """hidden_states [s, b, H] -> [s, b, H]; attention_mask / rotary_pos_emb are unused
        (documents are cut by seq_idx [b, s], or under context parallelism by the packed
        sequences of packed_seq_params, see MambaMixer.forward)."""
        residual = hidden_states
        if self.residual_in_fp32:
            residual = residual.to(torch.float32)
        hidden_states = hidden_states.to(dtype=self.config.params_dtype)
        hidden_states = self.norm(hidden_states)
        mixer_out_with_bias = self.mixer(
            hidden_states,
            inference_params=inference_params,
            seq_idx=seq_idx,
            packed_seq_params=packed_seq_params,
        )
        hidden_states = self.mamba_bda(self.training, self.config.bias_dropout_fusion)(
            mixer_out_with_bias, residual, self.hidden_dropout
        )
        return make_viewless_tensor(
            inp=hidden_states, requires_grad=hidden_states.requires_grad, keep_graph=True
        )
