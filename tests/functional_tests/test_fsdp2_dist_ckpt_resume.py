"""torch_dist checkpoints of FSDP2-sharded runs, resumed with FSDP2 at another DP size and with
the distributed optimizer, and back (pretrain_gpt.py in-process, one pool of 4 gloo ranks, a
tiny SwiGLU GPT, mock data):

- the reference run, FSDP2 at TP2 x DP2 (`--ckpt-format fsdp_dtensor`, the alias), saves at
  iteration 3; resumed there at the same layout its losses are bit for bit the reference's;
- resumed with FSDP2 at TP1 x DP4 and with the distributed optimizer at TP2 x DP2 (which saves
  again at iteration 4), the losses equal the reference's within reduction noise: weights and
  Adam state moved between the layouts;
- the distributed optimizer's checkpoint resumed with FSDP2 at TP1 x DP4 (iteration 4 -> 6,
  `--ckpt-fully-parallel-load`) follows the reference too;
- uneven shards (3 rows over 4 ranks: one rank holds none) and the SwiGLU fc1 factory, written
  from DTensors, read back as full tensors and into other DTensor shards;
- HSDP (2 replicas x 2 shards) resumes the FSDP2 checkpoint and saves at iteration 4, which
  plain DDP at TP2 x DP2 resumes (both follow the reference);
- a model with a parameter the checkpoint lacks (`--untie-embeddings-and-output-weights` on a
  tied model's checkpoint: the output layer) fails to load under the lenient
  `--dist-ckpt-strictness log_all` (which would drop the key), naming the missing key.
"""

import torch

from tests.functional_tests.test_dist_ckpt_resume import _close, _layout, _merged, _run
from tests.unit_tests.dist_utils import run_distributed

TRAIN_ITERS, STOP_AT, SECOND_STOP = 6, 3, 4
MODEL = ['--num-layers', '2', '--swiglu', '--ffn-hidden-size', '48']
FSDP2 = ['--use-torch-fsdp2']
DISTOPT = ['--use-distributed-optimizer']
HSDP = ['--num-distributed-optimizer-instances', '2']


def _jobs_catching(jobs, failing):
    """Run the jobs in order; for the indices in `failing`, return the error text instead."""
    out = []
    for index, args in enumerate(jobs):
        if index not in failing:
            out.append(_run(args))
            continue
        try:
            _run(args)
            out.append('loaded')
        except ValueError as exc:
            out.append(f'ValueError: {exc}')
    return out


def _check_follows(reference, resumed, start, what):
    assert sorted(resumed) == list(range(start + 1, TRAIN_ITERS + 1)), what
    for it, value in resumed.items():
        assert _close(value, reference[it]), (what, it, value, reference[it])


def test_fsdp2_resume_matrix(tmp_path):
    common = MODEL + ['--train-iters', str(TRAIN_ITERS)]
    fsdp_ckpt, distopt_ckpt = str(tmp_path / 'fsdp2'), str(tmp_path / 'distopt')
    hsdp_ckpt = str(tmp_path / 'hsdp')
    resume = ['--use-dist-ckpt', '--load', fsdp_ckpt, '--ckpt-step', str(STOP_AT)]
    jobs = [
        common
        + _layout(2, 1)
        + FSDP2
        + ['--ckpt-format', 'fsdp_dtensor', '--save', fsdp_ckpt]
        + ['--save-interval', str(STOP_AT)],
        common + _layout(2, 1) + FSDP2 + resume,
        common + _layout(1, 1) + FSDP2 + resume,
        common
        + _layout(2, 1)
        + DISTOPT
        + resume
        + ['--save', distopt_ckpt, '--save-interval', str(SECOND_STOP)],
        common
        + _layout(1, 1)
        + FSDP2
        + ['--use-dist-ckpt', '--load', distopt_ckpt, '--ckpt-step', str(SECOND_STOP)]
        + ['--ckpt-fully-parallel-load'],
        common
        + _layout(2, 1)
        + FSDP2
        + resume
        + ['--untie-embeddings-and-output-weights', '--dist-ckpt-strictness', 'log_all'],
        # HSDP (2 replicas x 2 shards) resumes the FSDP2 checkpoint and saves its own (the first
        # replica writes), which plain DDP at TP2 x DP2 resumes.
        common
        + _layout(1, 1)
        + FSDP2
        + HSDP
        + resume
        + ['--save', hsdp_ckpt]
        + ['--save-interval', str(SECOND_STOP)],
        common
        + _layout(2, 1)
        + ['--use-dist-ckpt', '--load', hsdp_ckpt, '--ckpt-step', str(SECOND_STOP)],
    ]
    failing = {5}
    outs = run_distributed(_jobs_catching, world_size=4, args=(jobs, failing), timeout=900)
    errors = [[rank_out[i] for rank_out in outs] for i in sorted(failing)]
    for i in sorted(failing):
        for rank_out in outs:
            rank_out[i] = {}
    reference, same, dp4, distopt, back_to_fsdp2, _, hsdp, hsdp_to_ddp = _merged(outs)
    assert sorted(reference) == list(range(1, TRAIN_ITERS + 1))
    assert same == {it: reference[it] for it in range(STOP_AT + 1, TRAIN_ITERS + 1)}
    _check_follows(reference, dp4, STOP_AT, 'FSDP2 TP2 DP2 -> FSDP2 TP1 DP4')
    _check_follows(reference, distopt, STOP_AT, 'FSDP2 -> distributed optimizer')
    _check_follows(reference, back_to_fsdp2, SECOND_STOP, 'distributed optimizer -> FSDP2')
    _check_follows(reference, hsdp, STOP_AT, 'FSDP2 TP2 DP2 -> HSDP 2x2')
    _check_follows(reference, hsdp_to_ddp, SECOND_STOP, 'HSDP 2x2 -> DDP TP2 DP2')
    for per_rank in errors:
        for message in per_rank:
            assert message.startswith('ValueError: '), message
            assert 'output_layer.weight' in message, message


def _uneven_shards(ckpt_dir):
    """A [3, 4] weight and a GLU fc1 [6, 2] (gate rows, then up rows) sharded by FSDP2 over 4
    ranks (rows 1/1/1/0 and 2/2/2/0): saved from the DTensors, loaded as plain full tensors and
    into fresh DTensor shards."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as mpu
    from megatron.core.dist_checkpointing.dtensor import shard_dtensor_entries
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.dist_checkpointing.utils import apply_swiglu_sharded_factory

    group = mpu.get_data_parallel_group()
    mesh = DeviceMesh.from_group(group, 'cpu', mesh_dim_names=(f'ckpt_{group.group_name}',))
    rid = (0, 0, mpu.get_data_parallel_rank())

    def sharded(fill):
        module = torch.nn.Sequential(
            torch.nn.Linear(4, 3, bias=False), torch.nn.Linear(2, 6, bias=False)
        )
        with torch.no_grad():
            module[0].weight.copy_(fill(12).view(3, 4))
            module[1].weight.copy_(fill(12).view(6, 2) + 100)
        fully_shard(module, mesh=mesh)
        plain = ShardedTensor.from_rank_offsets('w', module[0].weight, replica_id=rid)
        glu = ShardedTensor.from_rank_offsets('fc1', module[1].weight, replica_id=rid)
        state = {'w': plain, 'fc1': apply_swiglu_sharded_factory(glu, ())}
        shard_dtensor_entries(state)
        return module, state

    module, state = sharded(lambda n: torch.arange(n, dtype=torch.float32))
    local_rows = [module[0].weight.to_local().shape[0], module[1].weight.to_local().shape[0]]
    dist_checkpointing.save(state, ckpt_dir)
    full = {
        'w': ShardedTensor.from_rank_offsets('w', torch.zeros(3, 4), replica_id=rid),
        'fc1': ShardedTensor.from_rank_offsets('fc1', torch.zeros(6, 2), replica_id=rid),
    }
    loaded = dist_checkpointing.load(full, ckpt_dir)
    fresh, request = sharded(lambda n: torch.zeros(n))
    back = dist_checkpointing.load(request, ckpt_dir)
    return (
        local_rows,
        loaded['w'],
        loaded['fc1'],
        # A rank without rows requested nothing: the key is absent there (it keeps its shard).
        back['w'] is fresh[0].weight if 'w' in back else local_rows == [0, 0],
        fresh[0].weight.full_tensor(),
        fresh[1].weight.full_tensor(),
    )


def test_uneven_fsdp2_shards_round_trip(tmp_path):
    outs = run_distributed(_uneven_shards, world_size=4, args=(str(tmp_path),))
    assert [out[0] for out in outs] == [[1, 2], [1, 2], [1, 2], [0, 0]]
    weight = torch.arange(12, dtype=torch.float32).view(3, 4)
    fc1 = torch.arange(12, dtype=torch.float32).view(6, 2) + 100
    for _, w, f, same_object, w_back, f_back in outs:
        assert torch.equal(w, weight) and torch.equal(f, fc1)
        assert same_object  # the merge hands back the module's own DTensor
        assert torch.equal(w_back, weight) and torch.equal(f_back, fc1)
