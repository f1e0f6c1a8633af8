"""--use-torch-fsdp2 beyond one data-parallel mesh: HSDP (replicate x shard, from
--num-distributed-optimizer-instances) and expert parallelism (experts sharded over the
expert-data-parallel group), each against our DDP on the same global batches (fp32).
"""

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

from megatron.core import parallel_state
from megatron.core.distributed.torch_fully_sharded_data_parallel import (
    TorchFullyShardedDataParallel,
)
from tests.unit_tests.dist_utils import run_distributed
from tests.unit_tests.distributed import fsdp_test_utils as U


def _ddp_then_fsdp(build_kwargs, train_kwargs):
    model, config = U.build(**build_kwargs)
    ddp = U.wrap_ddp(model, config)
    ref_losses, ref_norms, _ = U.train(ddp, config, **train_kwargs)
    del ddp, model
    model, config = U.build(**build_kwargs)
    fsdp = TorchFullyShardedDataParallel(config, None, model)
    losses, norms, _ = U.train(fsdp, config, **train_kwargs)
    return fsdp, (ref_losses, ref_norms, losses, norms)


def _check_parity(ref_losses, ref_norms, losses, norms):
    assert losses == pytest.approx(ref_losses, rel=2e-6)
    assert norms == pytest.approx(ref_norms, rel=2e-5)


def _hsdp(instances, sequence_parallel):
    """DP as `instances` replicas of DP / instances shards: parity with DDP and the layout."""
    tp = parallel_state.get_tensor_model_parallel_world_size()
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp, num_distributed_optimizer_instances=instances
    )
    build = {'sequence_parallel': True} if sequence_parallel else {}
    fsdp, parity = _ddp_then_fsdp(build, {'num_microbatches': 2})
    shard_group = parallel_state.get_data_parallel_group(
        with_context_parallel=True, partial_data_parallel=True
    )
    shard_ranks = torch.distributed.get_process_group_ranks(shard_group)
    position = shard_ranks.index(torch.distributed.get_rank())
    local = total = 0
    layout_ok = True
    for param in fsdp.parameters():
        layout_ok &= tuple(param.placements) == (Replicate(), Shard(0))
        # This rank's rows are the chunk of its position in its instance of contiguous ranks.
        expected = torch.chunk(param.full_tensor(), len(shard_ranks), dim=0)[position]
        layout_ok &= torch.equal(param.to_local(), expected)
        local += param.to_local().numel()
        total += param.numel()
    return {
        'parity': parity,
        'layout_ok': layout_ok,
        'fraction': local / total,
        'shards': len(shard_ranks),
    }


@pytest.mark.parametrize('tp, shards', [(1, 2), (2, 1)], ids=['dp4-as-2x2', 'tp2-sp-dp2-as-2x1'])
def test_hsdp_matches_ddp_and_holds_one_over_shards(tp, shards):
    for out in run_distributed(_hsdp, 4, tp=tp, args=(2, tp > 1)):
        _check_parity(*out['parity'])
        assert out['layout_ok'] and out['shards'] == shards
        # Each rank keeps 1/shards of the parameters (of its TP piece), within dim-0 padding.
        assert out['fraction'] == pytest.approx(1 / shards, rel=0.02), out


def _moe(per_token):
    build_kwargs = {'num_experts': 4}
    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        build_kwargs['sequence_parallel'] = True  # MoE with TP needs it
    train_kwargs = {'num_microbatches': 2}
    if per_token:
        build_kwargs['calculate_per_token_loss'] = True
        train_kwargs['per_token'] = True
    fsdp, parity = _ddp_then_fsdp(build_kwargs, train_kwargs)
    expert_dp = parallel_state.get_data_modulo_expert_parallel_group(with_context_parallel=True)
    meshes_ok = bool(fsdp.expert_units)
    for name, param in fsdp.named_parameters():
        group = fsdp.expert_mesh if '.experts.' in name else fsdp.mesh
        meshes_ok &= param.device_mesh is group
    return {'parity': parity, 'meshes_ok': meshes_ok, 'expert_dp': expert_dp.size()}


@pytest.mark.parametrize(
    'world, tp, expert_dp',
    [(2, 1, 1), (4, 1, 2), (4, 2, 1)],
    ids=['dp2-ep2', 'dp4-ep2', 'tp2-sp-dp2-ep2'],
)
def test_moe_expert_parallel_matches_ddp(world, tp, expert_dp):
    for out in run_distributed(_moe, world, tp=tp, ep=2, args=(world == 4 and tp == 1,)):
        _check_parity(*out['parity'])
        # Experts on their expert-data-parallel mesh, the rest on the whole data-parallel mesh.
        assert out['meshes_ok']
        assert out['expert_dp'] == expert_dp
