"""--use-torch-fsdp2 (TorchFullyShardedDataParallel on FSDP2's fully_shard) against our DDP.

Each job trains the same tiny GPT for a few steps through the real schedule, finalize_model_grads
and the Megatron optimizer, once under DDP (the unsharded reference) and once fully sharded, on
the same global batches; losses and clipped grad norms must agree within fp32 reduction noise.
"""

import pytest
import torch

from megatron.core import parallel_state
from megatron.core.distributed.torch_fully_sharded_data_parallel import (
    TorchFullyShardedDataParallel,
    TorchFullyShardedDataParallelConfig,
)
from tests.unit_tests.dist_utils import run_distributed
from tests.unit_tests.distributed import fsdp_test_utils as U

#: name -> (build overrides, train kwargs, FSDP config kwargs)
SCENARIOS = {
    'plain': ({}, {}, {}),
    'accumulation': ({}, {'num_microbatches': 3}, {}),
    'per-token-loss': (
        {'calculate_per_token_loss': True},
        {'num_microbatches': 2, 'per_token': True},
        {},
    ),
    'recompute-tied': (
        {
            'tied': True,
            'recompute_granularity': 'full',
            'recompute_method': 'uniform',
            'recompute_num_layers': 1,
        },
        {'num_microbatches': 2},
        {},
    ),
    'no-reshard-after-forward': ({}, {'num_microbatches': 2}, {'reshard_after_forward': False}),
}


def _parity(names, sequence_parallel=False):
    out = {}
    extra = {'sequence_parallel': True} if sequence_parallel else {}
    for name in names:
        overrides, train_kwargs, fsdp_kwargs = SCENARIOS[name]
        model, config = U.build(**overrides, **extra)
        ddp = U.wrap_ddp(model, config)
        ref_losses, ref_norms, _ = U.train(ddp, config, **train_kwargs)
        del ddp, model

        model, config = U.build(**overrides, **extra)
        fsdp = TorchFullyShardedDataParallel(
            config, None, model, TorchFullyShardedDataParallelConfig(**fsdp_kwargs)
        )
        losses, norms, _ = U.train(fsdp, config, **train_kwargs)
        out[name] = (ref_losses, ref_norms, losses, norms)
    return out


def _check(outs):
    for out in outs:
        for name, (ref_losses, ref_norms, losses, norms) in out.items():
            assert losses == pytest.approx(ref_losses, rel=2e-6), name
            assert norms == pytest.approx(ref_norms, rel=2e-5), name


def test_fsdp2_dp2_matches_ddp():
    _check(run_distributed(_parity, 2, args=(list(SCENARIOS),)))


def test_fsdp2_dp4_matches_ddp():
    _check(run_distributed(_parity, 4, args=(['accumulation', 'per-token-loss'],)))


def test_fsdp2_tp2_dp2_sequence_parallel_matches_ddp():
    _check(run_distributed(_parity, 4, tp=2, args=(['accumulation'], True)))


def _accumulation_reduces_once():
    """Under no_sync no reduce-scatter runs: the sharded grads appear only on the last
    micro-batch, and then hold the sum over micro-batches."""
    model, config = U.build()
    fsdp = TorchFullyShardedDataParallel(config, None, model)
    tokens = torch.randint(0, 128, (2, U.SEQ + 1))
    position_ids = torch.arange(U.SEQ).unsqueeze(0).expand(2, U.SEQ)

    def backward():
        fsdp(tokens[:, :-1], position_ids, None, labels=tokens[:, 1:]).float().mean().backward()

    with fsdp.no_sync():
        backward()
    after_first = [p.grad is None for p in fsdp.parameters()]
    backward()
    accumulated = {n: p.grad.full_tensor().clone() for n, p in fsdp.named_parameters()}
    fsdp.zero_grad_buffer()
    backward()
    single = {n: p.grad.full_tensor() for n, p in fsdp.named_parameters()}
    return all(after_first), {n: (accumulated[n], 2 * single[n]) for n in single}


def test_fsdp2_no_sync_defers_the_reduction():
    for none_after_first, pairs in run_distributed(_accumulation_reduces_once, 2):
        assert none_after_first
        for name, (got, expected) in pairs.items():
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-7, msg=name)


def _attributes(model):
    names = ('tensor_model_parallel', 'partition_dim', 'sequence_parallel')
    return {n: {a: getattr(p, a, None) for a in names} for n, p in model.named_parameters()}


def _memory_and_attributes(reshard_after_forward):
    model, config = U.build()
    ddp = U.wrap_ddp(model, config)
    _, _, optimizer = U.train(ddp, config, iterations=1)
    ddp_bytes = U.rank_state_bytes(ddp, optimizer)
    del ddp, model, optimizer

    model, config = U.build()
    before = _attributes(model)
    fsdp = TorchFullyShardedDataParallel(
        config, None, model, TorchFullyShardedDataParallelConfig(reshard_after_forward)
    )
    _, _, optimizer = U.train(fsdp, config, iterations=1)
    after = _attributes(fsdp.module)
    return {
        'ddp': ddp_bytes,
        'fsdp_held': U.rank_state_bytes(fsdp, optimizer),
        'attributes_kept': before == after,
        'dp': parallel_state.get_data_parallel_world_size(),
    }


@pytest.mark.parametrize(
    'reshard_after_forward',
    [True, False],
    ids=['optim_grads_params', 'optim_grads (no reshard after forward)'],
)
def test_fsdp2_rank_holds_one_over_dp_of_the_state(reshard_after_forward):
    for out in run_distributed(_memory_and_attributes, 2, args=(reshard_after_forward,)):
        assert out['attributes_kept']
        # Parameters + grads + Adam state + any gathered or kept copy, counted from the
        # tensors this rank holds after a step: 1/DP of DDP's, within padding.
        assert out['fsdp_held'] <= out['ddp'] / out['dp'] * 1.02, out


def _bf16_parity():
    from megatron.core.transformer.module import Float16Module

    out = {}
    model, config = U.build(bf16=True, params_dtype=torch.bfloat16)
    ddp_config = U.DistributedDataParallelConfig(grad_reduce_in_fp32=True)
    ddp = U.DistributedDataParallel(config, ddp_config, Float16Module(config, model))
    out['ddp'] = U.train(ddp, config, bf16=True)[:2]
    del ddp, model

    # Default --bf16 layout: fp32 shards, bf16 compute, fp32 reduce-scatter.
    model, config = U.build(bf16=True, params_dtype=torch.bfloat16)
    model.float()
    policy = TorchFullyShardedDataParallelConfig(
        param_dtype=torch.bfloat16, reduce_dtype=torch.float32, output_dtype=torch.float32
    )
    out['fp32-reduce'] = U.train(
        TorchFullyShardedDataParallel(config, None, model, policy), config, bf16=True
    )[:2]
    del model

    # --torch-fsdp2-reduce-in-bf16: Megatron's layout (bf16 parameters, no policy).
    model, config = U.build(bf16=True, params_dtype=torch.bfloat16)
    fsdp = TorchFullyShardedDataParallel(config, None, Float16Module(config, model))
    out['bf16-reduce'] = U.train(fsdp, config, bf16=True)[:2]
    return out


def test_fsdp2_bf16_layouts_track_ddp():
    for out in run_distributed(_bf16_parity, 2):
        ref_losses, ref_norms = out['ddp']
        for name in ('fp32-reduce', 'bf16-reduce'):
            losses, norms = out[name]
            assert losses == pytest.approx(ref_losses, rel=2e-2), name
            assert norms == pytest.approx(ref_norms, rel=5e-2), name
