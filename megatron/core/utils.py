"""Small utilities shared by every part of megatron.core.

The device policy (`uses_cuda`, `get_current_device`) lives in `megatron.core.device` and is
re-exported here, where Megatron's code looks for it: core code never calls `.cuda()` directly,
so the same code runs on CPU with gloo and on GPU with NCCL.
"""

import hashlib
import logging
import math
from typing import Any, List, Optional, Union

import torch

from megatron.core.device import (  # noqa: F401 (re-exported)
    get_current_device,
    get_current_device_type,
    uses_cuda,
)
from megatron.core.global_memory_buffer import GlobalMemoryBuffer  # noqa: F401 (Megatron's home)
from megatron.core.group_fallbacks import (  # noqa: F401 (later Megatron's home)
    get_context_parallel_group_if_none,
    get_data_modulo_expert_parallel_group_if_none,
    get_data_parallel_group_gloo_if_none,
    get_data_parallel_group_if_none,
    get_data_parallel_group_with_cp_if_none,
    get_embedding_group_if_none,
    get_expert_model_parallel_group_if_none,
    get_hierarchical_context_parallel_groups_if_none,
    get_model_parallel_group_if_none,
    get_pipeline_model_parallel_group_if_none,
    get_position_embedding_group_if_none,
    get_tensor_and_context_parallel_group_if_none,
    get_tensor_and_data_parallel_group_if_none,
    get_tensor_and_expert_parallel_group_if_none,
    get_tensor_model_parallel_group_if_none,
)
from megatron.core.straggler_detector import StragglerDetector  # noqa: F401 (Megatron's home)

logger = logging.getLogger(__name__)


def ensure_divisibility(numerator: int, denominator: int) -> None:
    """Assert an internal invariant: numerator is divisible by denominator."""
    assert numerator % denominator == 0, f"{numerator} is not divisible by {denominator}"


def divide(numerator: int, denominator: int) -> int:
    """Integer division that asserts the division is exact."""
    ensure_divisibility(numerator, denominator)
    return numerator // denominator


def init_method_normal(sigma: float):
    """Init method based on N(0, sigma)."""

    def init_(tensor):
        return torch.nn.init.normal_(tensor, mean=0.0, std=sigma)

    return init_


def scaled_init_method_normal(sigma: float, num_layers: int):
    """Init method based on N(0, sigma / sqrt(2 * num_layers)), for output projections."""
    std = sigma / math.sqrt(2.0 * num_layers)

    def init_(tensor):
        return torch.nn.init.normal_(tensor, mean=0.0, std=std)

    return init_


def get_attr_wrapped_model(
    model, attr: str, allow_none: bool = True, return_model_obj: bool = False
):
    """Get an attribute from a model that may be wrapped (DDP, Float16Module, ...).

    Unwraps `.module` until the attribute is found.
    """
    if isinstance(model, list):
        raise RuntimeError("get_attr_wrapped_model given a list of models")

    if allow_none:

        def condition(m, a):
            return not hasattr(m, a)

    else:

        def condition(m, a):
            return getattr(m, a, None) is None

    while condition(model, attr):
        if not hasattr(model, "module"):
            raise RuntimeError(f"No attribute {attr} in the model or any wrapped module")
        model = model.module

    if return_model_obj:
        return model
    return getattr(model, attr)


def get_model_type(model):
    """The `model_type` (ModelType) of a possibly wrapped model."""
    return get_attr_wrapped_model(model, "model_type")


def get_model_config(model):
    """The `config` (TransformerConfig / ModelParallelConfig) of a possibly wrapped model."""
    return get_attr_wrapped_model(model, "config", allow_none=False)


def unwrap_model(model: Union[torch.nn.Module, List[torch.nn.Module]], module_instances=None):
    """Strip wrapper modules (those with a `.module` attribute) off a model or a list of models."""
    return_list = True
    if not isinstance(model, list):
        model = [model]
        return_list = False
    unwrapped = []
    for model_module in model:
        if module_instances is None:
            while hasattr(model_module, "module"):
                model_module = model_module.module
        else:
            while isinstance(model_module, module_instances):
                model_module = model_module.module
        unwrapped.append(model_module)
    if not return_list:
        return unwrapped[0]
    return unwrapped


def _kernel_make_viewless_tensor(inp: torch.Tensor, requires_grad: bool) -> torch.Tensor:
    out = torch.empty((1,), dtype=inp.dtype, device=inp.device, requires_grad=requires_grad)
    out.data = inp.data
    return out


class MakeViewlessTensor(torch.autograd.Function):
    """Autograd function that makes a viewless tensor while keeping the graph."""

    @staticmethod
    def forward(ctx, inp, requires_grad):
        return _kernel_make_viewless_tensor(inp, requires_grad)

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output, None


def make_viewless_tensor(inp: torch.Tensor, requires_grad: bool, keep_graph: bool) -> torch.Tensor:
    """Return a tensor that is not a view, sharing the same data.

    Pipeline stages free their output tensors' data after sending them (`deallocate_output_tensor`);
    a view would keep its base alive, so outputs are made viewless first.
    """
    if inp._base is None:
        return inp
    if keep_graph:
        return MakeViewlessTensor.apply(inp, requires_grad)
    return _kernel_make_viewless_tensor(inp, requires_grad)


def assert_viewless_tensor(tensor: Any, extra_msg: str = None):
    """Internal invariant check: `tensor` must not be a view."""
    if isinstance(tensor, list):
        for item in tensor:
            assert_viewless_tensor(item, extra_msg)
        return tensor
    if not isinstance(tensor, torch.Tensor):  # nothing to check
        return tensor
    assert tensor._base is None, (
        "Ensure tensor._base is None before setting tensor.data or storing tensor to memory "
        f"buffer. Found tensor._base={tensor._base}. {extra_msg}"
    )
    return tensor


def safely_set_viewless_tensor_data(tensor: torch.Tensor, new_data_tensor: torch.Tensor):
    """Set tensor.data after checking that the tensor is viewless."""
    assert_viewless_tensor(
        tensor,
        extra_msg="FYI, tensor._base has shape %s, and new_data_tensor has shape %s."
        % ("--" if tensor._base is None else tensor._base.shape, new_data_tensor.shape),
    )
    tensor.data = new_data_tensor


def check_param_hashes_across_dp_replicas(
    model: List[torch.nn.Module], dp_group: Optional[torch.distributed.ProcessGroup] = None
) -> bool:
    """True if every parameter is bit-identical to its copy on data-parallel rank 0.

    Each parameter's sha256 digest (over its fp32 CPU copy) is all-gathered over the gloo copy of
    the data-parallel group; mismatching parameters are logged with their model chunk and name.
    A collective over `dp_group` (default: the global data-parallel gloo group).

    Args:
        model: the model chunks of this rank.
        dp_group: a gloo data-parallel group, or None for the global one.
    """

    # Hashes travel as CPU uint8 tensors, so the gloo copy of the group is the one to use.
    dp_group = get_data_parallel_group_gloo_if_none(dp_group)
    params, local_hashes = [], []
    for chunk_id, chunk in enumerate(model):
        for name, param in chunk.named_parameters():
            digest = hashlib.sha256(param.data.detach().to('cpu', torch.float32).numpy().tobytes())
            local_hashes.append(torch.frombuffer(bytearray(digest.digest()), dtype=torch.uint8))
            params.append((chunk_id, name))
    local = torch.stack(local_hashes)  # [num_params, 32]
    gathered = [torch.zeros_like(local) for _ in range(torch.distributed.get_world_size(dp_group))]
    torch.distributed.all_gather(gathered, local, group=dp_group)
    match = torch.equal(local, gathered[0])
    if not match:
        rank = torch.distributed.get_rank()
        for i, (chunk_id, name) in enumerate(params):
            if not torch.equal(local[i], gathered[0][i]):
                logger.info(f'[Model chunk {chunk_id}, rank {rank}] Hash not matching for {name}')
    return match
