"""DistributedDataParallel at DP=2 against one process on the concatenated batch."""

import copy
from contextlib import nullcontext

import pytest
import torch

from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.model_parallel_config import ModelParallelConfig
from tests.unit_tests.dist_utils import run_distributed

IN, HIDDEN, OUT = 8, 24, 4
ROWS_PER_MICROBATCH = 3  # per data-parallel rank


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(IN, HIDDEN)
        self.norm = torch.nn.LayerNorm(HIDDEN)
        self.fc2 = torch.nn.Linear(HIDDEN, OUT)

    def forward(self, x):
        return self.fc2(torch.nn.functional.gelu(self.norm(self.fc1(x))))


def _loss(model, x, y):
    return torch.nn.functional.mse_loss(model(x), y)


def _ddp_vs_single_process(
    overlap, bucket_size, num_microbatches, use_distributed_optimizer=False, explicit_start=False
):
    dp_rank = parallel_state.get_data_parallel_rank()
    dp_size = parallel_state.get_data_parallel_world_size()
    torch.manual_seed(0)
    ref = _Net()
    model = copy.deepcopy(ref)
    ddp_config = DistributedDataParallelConfig(
        overlap_grad_reduce=overlap,
        bucket_size=bucket_size,
        use_distributed_optimizer=use_distributed_optimizer,
    )
    ddp = DistributedDataParallel(ModelParallelConfig(), ddp_config, model)
    num_buckets = sum(len(b.buckets) for b in ddp.buffers)

    out = {'num_buckets': num_buckets, 'iterations': []}
    for iteration in range(2):  # the second iteration checks zero_grad_buffer / bucket reset
        torch.manual_seed(100 + iteration)
        rows = ROWS_PER_MICROBATCH * dp_size
        xs = [torch.randn(rows, IN) for _ in range(num_microbatches)]
        ys = [torch.randn(rows, OUT) for _ in range(num_microbatches)]

        # Reference: one process, whole batch (all microbatches, all DP ranks' rows).
        ref.zero_grad()
        _loss(ref, torch.cat(xs), torch.cat(ys)).backward()

        ddp.zero_grad_buffer()
        issued_before_finish = None
        for m in range(num_microbatches):
            local = slice(dp_rank * ROWS_PER_MICROBATCH, (dp_rank + 1) * ROWS_PER_MICROBATCH)
            ctx = ddp.no_sync() if m < num_microbatches - 1 else nullcontext()
            with ctx:
                (_loss(ddp, xs[m][local], ys[m][local]) / num_microbatches).backward()
            if m < num_microbatches - 1:
                assert not any(b.communication_issued for buf in ddp.buffers for b in buf.buckets)
        issued_before_finish = [b.communication_issued for buf in ddp.buffers for b in buf.buckets]
        assert all(p.grad is None for p in model.parameters()), 'hooks must free param.grad'
        if explicit_start:  # as a pipeline schedule's grad_sync_func does: never reduces twice
            ddp.start_grad_sync()
        ddp.finish_grad_sync()

        if use_distributed_optimizer:
            # Only this rank's shard of each bucket is reduced: compare it with the reference.
            shards = []
            for buffer in ddp.buffers:
                ref_flat = torch.zeros(buffer.numel)
                for param, (start, end, _) in buffer.param_index_map.items():
                    ref_param = dict(ref.named_parameters())[ddp.param_to_name[param]]
                    ref_flat[start:end] = ref_param.grad.view(-1)
                for bucket in buffer.buckets:
                    size = bucket.grad_data.numel() // dp_size
                    lo = bucket.offset + dp_rank * size
                    shards.append(
                        (
                            bucket.grad_data[dp_rank * size : (dp_rank + 1) * size].clone(),
                            ref_flat[lo : lo + size],
                        )
                    )
            out['iterations'].append({'shards': shards, 'issued': issued_before_finish})
        else:
            grads = {
                n: (p.main_grad.clone(), dict(ref.named_parameters())[n].grad.clone())
                for n, p in model.named_parameters()
            }
            out['iterations'].append({'grads': grads, 'issued': issued_before_finish})
    return out


@pytest.mark.parametrize(
    'overlap,bucket_size,num_microbatches',
    [(False, None, 1), (True, 60, 1), (True, 60, 3), (False, 60, 2)],
    ids=['sync', 'overlap-buckets', 'overlap-buckets-accum3', 'sync-accum2'],
)
def test_ddp_matches_single_process(overlap, bucket_size, num_microbatches):
    outs = run_distributed(_ddp_vs_single_process, 2, args=(overlap, bucket_size, num_microbatches))
    for out in outs:
        # Buckets only exist with overlap (as in Megatron); otherwise one bucket per buffer.
        assert (out['num_buckets'] > 1) == (overlap and bucket_size is not None)
        for it in out['iterations']:
            # With overlap every bucket's all-reduce was started by the backward hooks.
            assert all(it['issued']) == overlap
            for name, (got, expected) in it['grads'].items():
                torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize('overlap', [False, True])
def test_explicit_start_grad_sync_does_not_reduce_twice(overlap):
    outs = run_distributed(
        _ddp_vs_single_process, 2, args=(overlap, 60, 1), kwargs={'explicit_start': True}
    )
    for out in outs:
        for it in out['iterations']:
            for name, (got, expected) in it['grads'].items():
                torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6, msg=name)


def test_ddp_reduce_scatter_for_distributed_optimizer():
    outs = run_distributed(_ddp_vs_single_process, 2, args=(True, 60, 2, True))
    for out in outs:
        assert out['num_buckets'] > 1
        for it in out['iterations']:
            for got, expected in it['shards']:
                torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def _broadcast_and_fp32_buffer():
    rank = torch.distributed.get_rank()
    torch.manual_seed(rank)  # replicas start different
    model = _Net().to(torch.bfloat16)
    ddp = DistributedDataParallel(
        ModelParallelConfig(), DistributedDataParallelConfig(grad_reduce_in_fp32=True), model
    )
    ddp.broadcast_params()
    x = torch.randn(2, IN, dtype=torch.bfloat16)
    ddp(x).float().pow(2).mean().backward()
    dtypes = {p.main_grad.dtype for p in model.parameters()}
    ddp.finish_grad_sync()
    return {
        'params': torch.cat([p.detach().float().view(-1) for p in model.parameters()]),
        'dtypes': dtypes,
        'main_grad': torch.cat([p.main_grad.view(-1) for p in model.parameters()]),
    }


def test_broadcast_params_and_fp32_grad_buffer():
    outs = run_distributed(_broadcast_and_fp32_buffer, 2)
    torch.testing.assert_close(outs[0]['params'], outs[1]['params'], rtol=0, atol=0)
    assert outs[0]['dtypes'] == {torch.float32}
    # After the all-reduce both replicas hold the same averaged fp32 gradient.
    torch.testing.assert_close(outs[0]['main_grad'], outs[1]['main_grad'], rtol=0, atol=0)
