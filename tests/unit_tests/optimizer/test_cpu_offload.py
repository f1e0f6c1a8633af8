"""--optimizer-cpu-offload: the distributed optimizer with a fraction of its fp32 main params and
Adam state on the host trains exactly like the plain distributed optimizer (DP=2 on gloo, fp32
and bf16 models, fractions 0.5 and 1); on a GPU the offloaded state and step are host tensors and
the rest stays on the device."""

import pytest
import torch

from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.utils import get_current_device
from tests.unit_tests.dist_utils import run_distributed
from tests.unit_tests.optimizer.test_distrib_optimizer import _batch, _flat_params, _Net


def _build(dtype, fraction):
    torch.manual_seed(3)
    model = _Net().to(dtype).to(get_current_device())
    ddp_config = DistributedDataParallelConfig(
        use_distributed_optimizer=True, grad_reduce_in_fp32=True
    )
    chunk = DistributedDataParallel(ModelParallelConfig(), ddp_config, model)
    config = OptimizerConfig(
        lr=1e-2,
        weight_decay=0.1,
        clip_grad=0.5,
        bf16=dtype == torch.bfloat16,
        use_distributed_optimizer=True,
        optimizer_cpu_offload=fraction is not None,
        optimizer_offload_fraction=fraction or 0.0,
    )
    return model, chunk, get_megatron_optimizer(config, [chunk])


def _train(chunk, optimizer, iterations):
    """A few steps, each DP rank on its slice of the global batch (on the model's device)."""
    rank = parallel_state.get_data_parallel_rank()
    size = parallel_state.get_data_parallel_world_size()
    device, dtype = get_current_device(), next(chunk.parameters()).dtype
    norms = []
    for iteration in iterations:
        x, y = _batch(iteration)
        rows = x.shape[0] // size
        x, y = (t[rank * rows : (rank + 1) * rows].to(device) for t in (x, y))
        chunk.zero_grad_buffer()
        optimizer.zero_grad()
        out = chunk(x.to(dtype)).float()
        optimizer.scale_loss(torch.nn.functional.mse_loss(out, y)).backward()
        chunk.finish_grad_sync()
        success, grad_norm, _ = optimizer.step()
        assert success
        norms.append(grad_norm)
    return norms


def _inner_devices(optimizer):
    """(elements of main params on the host, on the device, all state tensors on the host of
    host params)."""
    inner = optimizer.optimizer
    host = device = 0
    state_on_host = True
    for group in inner.param_groups:
        for p in group['params']:
            if p.device.type == 'cpu':
                host += p.numel()
                state = inner.state.get(p, {})
                state_on_host &= all(v.device.type == 'cpu' for v in state.values())
            else:
                device += p.numel()
    return host, device, state_on_host


def _run(dtype, fractions):
    out = {}
    for fraction in fractions:
        model, chunk, optimizer = _build(dtype, fraction)
        norms = _train(chunk, optimizer, range(3))
        # fp32 shard elements still updated in place (views of the parameter buffer).
        views = sum(p.numel() for group in optimizer.shard_fp32_groups for p in group)
        out[fraction] = (_flat_params(model).cpu(), norms, _inner_devices(optimizer), views)
    return out


@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16])
def test_offloaded_optimizer_trains_like_the_distributed_optimizer(dtype):
    (rank0, _) = run_distributed(_run, world_size=2, args=(dtype, [None, 0.5, 1.0]))
    params, norms, _, views = rank0[None]
    for fraction in (0.5, 1.0):
        got_params, got_norms, (host, device, state_on_host), _ = rank0[fraction]
        torch.testing.assert_close(got_params, params, rtol=0, atol=0)
        assert got_norms == norms
        assert state_on_host and host > 0
    if dtype == torch.float32:
        # fp32 shards become host masters (copied back after each step): all at 1, part at 0.5.
        assert views > rank0[0.5][3] > 0 and rank0[1.0][3] == 0


@pytest.mark.gpu
def test_offloaded_state_lives_on_the_host_on_a_gpu():
    (out,) = run_distributed(_run, world_size=1, args=(torch.bfloat16, [None, 0.5]), backend='nccl')
    params, norms, (host, device, _), _ = out[None]
    assert host == 0 and device > 0
    got_params, got_norms, (host, device, state_on_host), _ = out[0.5]
    assert host > 0 and device > 0 and state_on_host
    torch.testing.assert_close(got_params, params, rtol=1e-6, atol=1e-6)
