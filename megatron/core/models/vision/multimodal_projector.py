"""MultimodalProjector: maps vision features to a language model's hidden size.

`projector_type='mlp'`: an `MLP` (fc1 column-parallel from the vision size to
`config.ffn_hidden_size`, activation, fc2 row-parallel to `config.hidden_size`; keys
`encoder.linear_fc1.*`, `encoder.linear_fc2.*`). Forward: no communication in fc1, an all-reduce
of fc2's partial outputs over the TP group (backward: the all-reduce of fc1's input gradient).
`projector_type='affine'`: one column-parallel linear that gathers its output (keys
`encoder.weight`, `encoder.bias`).
"""

from typing import Optional

import torch

from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import build_module
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import make_viewless_tensor

PROJECTOR_TYPES = ('mlp', 'affine')


class MultimodalProjector(MegatronModule):
    """Vision features [..., input_size] -> [..., config.hidden_size].

    Args:
        config (TransformerConfig): the projection's config (hidden_size = the language model's).
        submodules (MLPSubmodules): linear_fc1 / linear_fc2 classes ('mlp'), linear_fc1 ('affine').
        projector_type (str): 'mlp' or 'affine'.
        input_size (int): the vision encoder's hidden size.
    """

    def __init__(
        self,
        config: TransformerConfig,
        submodules: Optional[MLPSubmodules],
        projector_type: str,
        input_size: int,
    ):
        super().__init__(config=config)
        if submodules is None:
            raise ValueError("MultimodalProjector: MLPSubmodules must be provided")
        if projector_type not in PROJECTOR_TYPES:
            raise ValueError(f"Unsupported multimodal projection type {projector_type}")
        self.projector_type = projector_type
        if projector_type == 'mlp':
            self.encoder = MLP(config=config, submodules=submodules, input_size=input_size)
        else:
            # 'affine': one linear [input_size -> h], its output gathered back to full width on
            # every TP rank; the bias comes back separately and forward adds it.
            self.encoder = build_module(
                submodules.linear_fc1,
                input_size,
                config.hidden_size,
                gather_output=True,
                skip_bias_add=True,
                bias=config.add_bias_linear,
                init_method=config.init_method,
                config=config,
                is_expert=False,
            )

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[..., input_size] -> [..., hidden_size] (the bias added)."""
        output, bias = self.encoder(hidden_states)
        if bias is not None:
            output = output + bias
        return make_viewless_tensor(inp=output, requires_grad=True, keep_graph=True)
