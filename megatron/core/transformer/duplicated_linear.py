"""A linear layer whose whole weight lives on every tensor-parallel rank.

Multi-latent attention's down projections are small ([rank, h]); Megatron keeps them whole on
each TP rank ("duplicated") instead of splitting them. The layer runs no collective itself: its
output feeds ColumnParallelLinear up projections (whose backward all-reduces the input gradient
over TP), so without sequence parallelism every rank computes the same full weight gradient. Under
sequence parallelism each rank projects its own s/tp tokens, so the weight gradient is a partial
sum: the parameters carry `sequence_parallel = True` and `finalize_model_grads` all-reduces them
over TP.
"""

from typing import Callable, Optional, Tuple

import torch
from torch import Tensor

from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.transformer.module import MegatronModule
from megatron.core.utils import get_current_device


class DuplicatedLinear(MegatronModule):
    """y = x W^T (+ b) with W [output_size, input_size] replicated over TP.

    Args:
        input_size (int): input features.
        output_size (int): output features.
        config (ModelParallelConfig): reads params_dtype, perform_initialization,
            use_cpu_initialization and sequence_parallel.
        init_method (Callable): weight initialiser (run on the default RNG, so every TP rank
            draws the same values).
        bias (bool): add a bias (zero-initialised).
        skip_bias_add (bool): return the bias separately instead of adding it.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        config: ModelParallelConfig,
        init_method: Callable,
        bias: bool = False,
        skip_bias_add: bool = False,
        **unused_kwargs,
    ):
        super().__init__(config=config)
        device = 'cpu' if config.use_cpu_initialization else get_current_device()
        self.skip_bias_add = skip_bias_add
        self.weight = torch.nn.Parameter(
            torch.empty(output_size, input_size, dtype=config.params_dtype, device=device)
        )
        if config.perform_initialization:
            with torch.no_grad():
                init_method(self.weight)
        self.bias = None
        if bias:
            self.bias = torch.nn.Parameter(
                torch.zeros(output_size, dtype=config.params_dtype, device=device)
            )
        for param in self.parameters():
            setattr(param, 'sequence_parallel', config.sequence_parallel)

    def forward(self, x: Tensor) -> Tuple[Tensor, Optional[Tensor]]:
        """x [s, b, input_size] -> (y [s, b, output_size], bias or None)."""
        if self.skip_bias_add:
            return torch.nn.functional.linear(x, self.weight), self.bias
        return torch.nn.functional.linear(x, self.weight, self.bias), None
