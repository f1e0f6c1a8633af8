"""DistributedOptimizer at DP=2: same training as the plain optimizer, 1/DP optimizer state, and its
parameter-state checkpoint (round trip at DP=2, loaded again at DP=1)."""

import os

import pytest
import torch

from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.optimizer import DistributedOptimizer, OptimizerConfig, get_megatron_optimizer
from tests.unit_tests.dist_utils import run_distributed

IN, HIDDEN, OUT = 8, 24, 4
GLOBAL_ROWS = 6


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(IN, HIDDEN)
        self.norm = torch.nn.LayerNorm(HIDDEN)
        self.fc2 = torch.nn.Linear(HIDDEN, OUT)

    def forward(self, x):
        return self.fc2(torch.nn.functional.gelu(self.norm(self.fc1(x))))


def _build(dtype, use_distributed_optimizer, seed, wrap_ddp=True, overlap=False, bucket_size=None):
    """Model, chunk (DDP-wrapped or not) and optimizer; `overlap` overlaps grad reduce and param
    gather."""
    torch.manual_seed(seed)
    model = _Net().to(dtype)
    chunk = model
    if wrap_ddp:
        ddp_config = DistributedDataParallelConfig(
            use_distributed_optimizer=use_distributed_optimizer,
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=overlap,
            bucket_size=bucket_size,
        )
        chunk = DistributedDataParallel(ModelParallelConfig(), ddp_config, model)
    config = OptimizerConfig(
        lr=1e-2,
        weight_decay=0.1,
        clip_grad=0.5,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        initial_loss_scale=2.0**8,
        use_distributed_optimizer=use_distributed_optimizer,
        overlap_param_gather=overlap and use_distributed_optimizer,
    )
    return model, chunk, get_megatron_optimizer(config, [chunk])


def _batch(iteration):
    gen = torch.Generator().manual_seed(1000 + iteration)
    return torch.randn(GLOBAL_ROWS, IN, generator=gen), torch.randn(GLOBAL_ROWS, OUT, generator=gen)


def _train(model, chunk, optimizer, iterations, local=True):
    """Train; with `local` each DP rank takes its slice of the global batch."""
    dp_rank = parallel_state.get_data_parallel_rank()
    dp_size = parallel_state.get_data_parallel_world_size()
    norms = []
    for iteration in iterations:
        x, y = _batch(iteration)
        if local:
            rows = GLOBAL_ROWS // dp_size
            x, y = (
                x[dp_rank * rows : (dp_rank + 1) * rows],
                y[dp_rank * rows : (dp_rank + 1) * rows],
            )
        if hasattr(chunk, 'zero_grad_buffer'):
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        out = chunk(x.to(next(model.parameters()).dtype)).float()
        optimizer.scale_loss(torch.nn.functional.mse_loss(out, y)).backward()
        if hasattr(chunk, 'finish_grad_sync'):
            chunk.finish_grad_sync()
        success, grad_norm, _ = optimizer.step()
        assert success
        norms.append(grad_norm)
    return norms


def _flat_params(model):
    return torch.cat([p.detach().float().view(-1) for p in model.parameters()])


def _state_bytes(optimizer):
    """Bytes of optimizer state plus fp32 main params that are not the model params themselves."""
    total = 0
    for state in optimizer.optimizer.state.values():
        for value in state.values():
            if torch.is_tensor(value) and value.dim() > 0:
                total += value.numel() * value.element_size()
    if isinstance(optimizer, DistributedOptimizer):
        main_groups = optimizer.shard_fp32_from_float16_groups
    else:
        main_groups = getattr(optimizer, 'fp32_from_float16_groups', [])
    total += sum(p.numel() * p.element_size() for group in main_groups for p in group)
    return total


def _parity_and_memory(dtype, overlap, bucket_size):
    model, chunk, optimizer = _build(dtype, True, seed=1, overlap=overlap, bucket_size=bucket_size)
    assert isinstance(optimizer, DistributedOptimizer)
    ref_model, ref_chunk, ref_optimizer = _build(dtype, False, seed=1, wrap_ddp=False)
    norms = _train(model, chunk, optimizer, range(4))
    # With overlap_param_gather the last step's all-gathers may still be in flight; the state dict
    # (like a module's forward) waits for them.
    gathers_issued_async = any(
        b.param_gather_handle is not None for buf in chunk.buffers for b in buf.buckets
    )
    state_dict_params = torch.cat([v.float().view(-1) for v in chunk.state_dict().values()])
    ref_norms = _train(ref_model, ref_chunk, ref_optimizer, range(4), local=False)
    numel = sum(p.numel() for p in model.parameters())
    return {
        'params': _flat_params(model),
        'ref_params': _flat_params(ref_model),
        'norms': norms,
        'ref_norms': ref_norms,
        'state_bytes': _state_bytes(optimizer),
        'ref_state_bytes': _state_bytes(ref_optimizer),
        'numel': numel,
        'buckets': len(chunk.buffers[0].buckets),
        'gathers_issued_async': gathers_issued_async,
        'state_dict_params': state_dict_params,
    }


@pytest.mark.parametrize(
    'dtype,overlap,bucket_size',
    [
        (torch.float32, False, None),
        (torch.float32, True, 100),
        (torch.bfloat16, False, None),
        (torch.float16, True, 100),
    ],
    ids=['fp32', 'fp32-overlap-grad-reduce-and-param-gather', 'bf16', 'fp16-overlap'],
)
def test_distributed_optimizer_matches_plain_optimizer(dtype, overlap, bucket_size):
    outs = run_distributed(_parity_and_memory, 2, args=(dtype, overlap, bucket_size))
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for out in outs:
        assert (out['buckets'] > 1) == overlap
        assert out['gathers_issued_async'] == overlap
        assert torch.equal(out['state_dict_params'], out['params'])
        torch.testing.assert_close(out['params'], out['ref_params'], **tol)
        assert out['norms'] == pytest.approx(
            out['ref_norms'], rel=1e-4 if dtype == torch.float32 else 5e-2
        )
    # Every DP rank ends with the full, identical model (the all-gather after the step).
    assert torch.equal(outs[0]['params'], outs[1]['params'])
    if not overlap:
        # Optimizer state is split: the ranks' shares add up to the plain optimizer's, each <= 1/DP
        # plus the 128-element bucket-end padding.
        bytes_per_elem = 8 if dtype == torch.float32 else 12  # exp_avg + exp_avg_sq (+ fp32 main)
        full = outs[0]['ref_state_bytes']
        assert full == outs[0]['numel'] * bytes_per_elem
        assert sum(out['state_bytes'] for out in outs) == full
        for out in outs:
            assert out['state_bytes'] <= full / 2 + 128 * bytes_per_elem


def _save_then_resume(dtype, directory):
    model, chunk, optimizer = _build(dtype, True, seed=1)
    _train(model, chunk, optimizer, range(2))
    rank = torch.distributed.get_rank()
    tag = str(dtype).split('.')[-1]
    param_state_file = os.path.join(directory, f'distrib_optim_{tag}.pt')
    optimizer.save_parameter_state(param_state_file)
    if rank == 0:
        torch.save(chunk.state_dict(), os.path.join(directory, f'model_{tag}.pt'))
        torch.save(optimizer.state_dict(), os.path.join(directory, f'optim_{tag}.pt'))
    torch.distributed.barrier()
    _train(model, chunk, optimizer, range(2, 4))
    uninterrupted = _flat_params(model)

    # A fresh model / optimizer (different init) restored from the files continues identically.
    model2, chunk2, optimizer2 = _build(dtype, True, seed=99)
    _load(chunk2, optimizer2, directory, tag)
    _train(model2, chunk2, optimizer2, range(2, 4))
    # Without the model file the model weights differ from the loaded main params: the load must
    # not skip the parameter all-gather then (it is skipped only when every rank's weights
    # already agree with the file).
    model3, chunk3, optimizer3 = _build(dtype, True, seed=98)
    _load(chunk3, optimizer3, directory, tag, model_weights=False)
    _train(model3, chunk3, optimizer3, range(2, 4))
    return {
        'uninterrupted': uninterrupted,
        'resumed': _flat_params(model2),
        'resumed_without_model_file': _flat_params(model3),
    }


def _load(chunk, optimizer, directory, tag, model_weights=True):
    if model_weights:
        chunk.load_state_dict(
            torch.load(os.path.join(directory, f'model_{tag}.pt'), weights_only=True)
        )
    optimizer.load_state_dict(
        torch.load(os.path.join(directory, f'optim_{tag}.pt'), weights_only=True)
    )
    optimizer.load_parameter_state(os.path.join(directory, f'distrib_optim_{tag}.pt'))


def _resume_at_other_dp(dtype, directory):
    assert parallel_state.get_data_parallel_world_size() == 1
    model, chunk, optimizer = _build(dtype, True, seed=99)
    _load(chunk, optimizer, directory, str(dtype).split('.')[-1])
    _train(model, chunk, optimizer, range(2, 4))
    return _flat_params(model)


def test_parameter_state_round_trip_and_other_dp_size(tmp_path):
    directory = str(tmp_path)
    # bf16: the fp32 main params must come from the file, not from the bf16 model weights.
    for dtype in (torch.bfloat16, torch.float32):
        outs = run_distributed(_save_then_resume, 2, args=(dtype, directory))
        for out in outs:
            assert torch.equal(out['resumed'], out['uninterrupted']), dtype
            assert torch.equal(out['resumed_without_model_file'], out['uninterrupted']), dtype
    # The DP=2 fp32 files loaded at DP=1 (world 2 as TP=2, plain replicated model) continue the run.
    outs_dp1 = run_distributed(_resume_at_other_dp, 2, tp=2, args=(torch.float32, directory))
    for params in outs_dp1:
        torch.testing.assert_close(params, outs[0]['uninterrupted'], rtol=1e-5, atol=1e-6)


def _mismatched_layout(directory):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 5)
    ddp = DistributedDataParallel(
        ModelParallelConfig(), DistributedDataParallelConfig(use_distributed_optimizer=True), model
    )
    optimizer = get_megatron_optimizer(
        OptimizerConfig(lr=0.1, use_distributed_optimizer=True), [ddp]
    )
    try:
        optimizer.load_parameter_state(os.path.join(directory, 'distrib_optim_float32.pt'))
    except ValueError as exc:
        return str(exc)
    return None


def test_load_parameter_state_rejects_other_model(tmp_path):
    directory = str(tmp_path)
    run_distributed(_save_then_resume, 2, args=(torch.float32, directory))
    messages = run_distributed(_mismatched_layout, 2, args=(directory,))
    for message in messages:
        assert message is not None and 'per_bucket_numel_unpadded' in message
