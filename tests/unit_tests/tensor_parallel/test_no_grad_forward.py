"""Without gradients, the tensor parallel mappings, the linear layers' function and the bias-GeLU
run their forward outside autograd (`apply_function`): the same values, bit for bit, and the same
collectives as the recorded path, and no graph."""

import torch

from megatron.core import parallel_state as ps
from megatron.core import tensor_parallel as tp_api
from megatron.core.fusions.fused_bias_gelu import bias_gelu_impl
from megatron.core.tensor_parallel.layers import linear_with_grad_accumulation_and_async_allreduce
from tests.unit_tests.dist_utils import run_distributed


def _randn(seed, *shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _forwards(group):
    """name -> a function of x [s, b, h] that runs one forward of the path under test."""
    weight, bias = _randn(3, 6, 12), _randn(4, 6)
    return {
        "copy": tp_api.copy_to_tensor_model_parallel_region,
        "reduce": lambda x: tp_api.reduce_from_tensor_model_parallel_region(x.clone()),
        "scatter": tp_api.scatter_to_tensor_model_parallel_region,
        "gather": tp_api.gather_from_tensor_model_parallel_region,
        "sp scatter": tp_api.scatter_to_sequence_parallel_region,
        "sp gather": tp_api.gather_from_sequence_parallel_region,
        "sp reduce-scatter": tp_api.reduce_scatter_to_sequence_parallel_region,
        "linear": lambda x: linear_with_grad_accumulation_and_async_allreduce(
            x, weight, bias, False, allreduce_dgrad=True, tp_group=group
        ),
        "linear sp": lambda x: linear_with_grad_accumulation_and_async_allreduce(
            x, weight, None, False, sequence_parallel=True, tp_group=group
        ),
        "bias gelu": lambda x: bias_gelu_impl(x, bias[:1].expand(12).contiguous()),
    }


def _compare():
    group = ps.get_tensor_model_parallel_group()
    x = _randn(10 + group.rank(), 8, 2, 12)
    out = {}
    for name, forward in _forwards(group).items():
        recorded = forward(x.clone().requires_grad_(True))
        with torch.no_grad():
            plain = forward(x.clone().requires_grad_(True))
        out[name] = (
            recorded.grad_fn is not None,
            plain.grad_fn is None,
            torch.equal(recorded.detach(), plain),
        )
    return out


def test_no_grad_forward_equals_the_recorded_forward_without_a_graph():
    for result in run_distributed(_compare, 2, tp=2):
        for name, (has_graph, no_graph, equal) in result.items():
            assert has_graph, name
            assert no_graph, name
            assert equal, name
