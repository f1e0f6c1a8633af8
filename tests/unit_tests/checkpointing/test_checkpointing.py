"""save_checkpoint / load_checkpoint: layout, exact round trip, crash safety, mismatch errors.

Every distributed test builds the real pieces (GPTModel, DistributedDataParallel, the Megatron
optimizer and scheduler) from real parsed args in spawned gloo ranks. Training steps are replaced by
optimizer steps on deterministic synthetic gradients written into the DDP grad buffers
(`main_grad`), which gives non-trivial Adam state without running the schedules; the end-to-end
resume through the training loop is in tests/functional_tests/test_resume.py.
"""

import argparse
import contextlib
import functools
import glob
import io
import os
import random
import shutil
import signal
import zlib

import numpy as np
import pytest
import torch

from megatron.training import checkpointing
from tests.unit_tests.dist_utils import run_distributed

TINY_ARGS = [
    '--num-layers',
    '2',
    '--hidden-size',
    '32',
    '--num-attention-heads',
    '4',
    '--seq-length',
    '16',
    '--max-position-embeddings',
    '16',
    '--micro-batch-size',
    '1',
    '--global-batch-size',
    '4',
    '--train-iters',
    '8',
    '--lr',
    '1e-2',
    '--min-lr',
    '1e-3',
    '--lr-decay-style',
    'cosine',
    '--lr-warmup-iters',
    '2',
    '--distributed-backend',
    'gloo',
    '--seed',
    '1234',
]
PADDED_VOCAB = 128


# ---------------------------------------------------------------------------------------------
# helpers run inside the ranks


def _clean_globals(fn):
    """Run a rank body, then clear the training globals it set (pool workers are reused)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        from megatron.training import global_vars

        try:
            return fn(*args, **kwargs)
        finally:
            global_vars.destroy_global_vars()

    return wrapper


def _setup_args(ckpt_dir, extra=()):
    """Parse + validate real args, then install them as the run's globals."""
    from megatron.core import parallel_state as mpu
    from megatron.training import global_vars
    from megatron.training.arguments import parse_args, validate_args

    argv = (
        TINY_ARGS
        + [
            '--save',
            ckpt_dir,
            '--load',
            ckpt_dir,
            '--save-interval',
            '1',
            '--tensor-model-parallel-size',
            str(mpu.get_tensor_model_parallel_world_size()),
            '--pipeline-model-parallel-size',
            str(mpu.get_pipeline_model_parallel_world_size()),
        ]
        + list(extra)
    )
    with contextlib.redirect_stdout(io.StringIO()):
        args = validate_args(parse_args(args_list=argv))
    args.padded_vocab_size = PADDED_VOCAB
    global_vars.destroy_global_vars()
    global_vars.set_global_variables(args, build_tokenizer=False)
    return args


def _build(args, seed=1234):
    """GPTModel chunk wrapped in DDP, its optimizer and scheduler, initialised from `seed`."""
    from megatron.core import parallel_state as mpu
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.training.arguments import core_transformer_config_from_args

    # As initialize._set_random_seed does: data-parallel replicas share every RNG state.
    seed = seed + 100 * mpu.get_pipeline_model_parallel_rank()
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    config = core_transformer_config_from_args(args)
    model = GPTModel(
        config,
        get_gpt_layer_local_spec(),
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=mpu.is_pipeline_first_stage(),
        post_process=mpu.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
    )
    ddp = DistributedDataParallel(
        config,
        DistributedDataParallelConfig(use_distributed_optimizer=args.use_distributed_optimizer),
        model,
    )
    opt_config = OptimizerConfig(
        optimizer='adam',
        lr=args.lr,
        min_lr=args.min_lr,
        weight_decay=args.weight_decay,
        clip_grad=args.clip_grad,
        use_distributed_optimizer=args.use_distributed_optimizer,
        params_dtype=args.params_dtype,
    )
    optimizer = get_megatron_optimizer(opt_config, [ddp])
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=args.lr,
        min_lr=args.min_lr,
        lr_warmup_steps=args.lr_warmup_iters * args.global_batch_size,
        lr_decay_steps=args.train_iters * args.global_batch_size,
        lr_decay_style=args.lr_decay_style,
        start_wd=args.start_weight_decay,
        end_wd=args.end_weight_decay,
        wd_incr_steps=args.train_iters * args.global_batch_size,
        wd_incr_style=args.weight_decay_incr_style,
    )
    return [ddp], optimizer, scheduler


def _fake_step(model, optimizer, scheduler, args, step):
    """One optimizer step on synthetic gradients that depend only on (param name, step)."""
    for chunk in model:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    for chunk in model:
        for name, param in chunk.module.named_parameters():
            gen = torch.Generator().manual_seed(zlib.crc32(f'{name}/{step}'.encode()))
            param.main_grad.copy_(torch.randn(param.shape, generator=gen) * 0.1)
    update_successful, _, _ = optimizer.step()
    assert update_successful
    scheduler.step(increment=args.global_batch_size)
    args.consumed_train_samples += args.global_batch_size


def _params(model):
    return {n: p.detach().clone() for n, p in model[0].module.named_parameters()}


def _rng_draws():
    """One draw from every RNG the checkpoint restores."""
    from megatron.core import tensor_parallel

    with tensor_parallel.get_cuda_rng_tracker().fork():
        tracker_draw = torch.rand(3)
    return {
        'python': random.random(),
        'numpy': float(np.random.rand()),
        'torch': torch.rand(3),
        'tracker': tracker_draw,
    }


def _assert_same(a, b, what):
    assert a.keys() == b.keys(), what
    for key in a:
        if isinstance(a[key], torch.Tensor):
            assert torch.equal(a[key], b[key]), f'{what}: {key} differs'
        else:
            assert a[key] == b[key], f'{what}: {key}: {a[key]} != {b[key]}'


# ---------------------------------------------------------------------------------------------
# names and tracker (no processes)


def test_checkpoint_names_and_tracker(tmp_path):
    path = str(tmp_path)
    name = checkpointing.get_checkpoint_name(
        path, 500, pipeline_parallel=False, tensor_rank=1, pipeline_rank=0, expert_parallel=False
    )
    assert name == os.path.join(path, 'iter_0000500', 'mp_rank_01', 'model_optim_rng.pt')
    name = checkpointing.get_checkpoint_name(
        path,
        7,
        pipeline_parallel=True,
        tensor_rank=1,
        pipeline_rank=3,
        expert_parallel=True,
        expert_rank=2,
    )
    assert name == os.path.join(path, 'iter_0000007', 'mp_rank_01_003_002', 'model_optim_rng.pt')
    assert checkpointing.get_distributed_optimizer_checkpoint_name(name).endswith(
        os.path.join('mp_rank_01_003_002', 'distrib_optim.pt')
    )
    release_dir = checkpointing.get_checkpoint_name(path, 3, release=True, return_base_dir=True)
    assert release_dir == os.path.join(path, 'release')

    assert checkpointing.find_checkpoint_rank_0(path, 7) is None
    rank0 = checkpointing.get_checkpoint_name(
        path, 7, pipeline_parallel=True, tensor_rank=0, pipeline_rank=0, expert_parallel=False
    )
    checkpointing.ensure_directory_exists(rank0)
    open(rank0, 'wb').close()
    assert checkpointing.find_checkpoint_rank_0(path, 7) == rank0

    tracker = checkpointing.get_checkpoint_tracker_filename(path)
    assert not checkpointing.checkpoint_exists(path)
    checkpointing._write_tracker_atomically(path, 42)
    assert checkpointing.checkpoint_exists(path)
    assert open(tracker).read() == '42'  # Megatron writes no newline
    assert checkpointing.read_metadata(tracker) == (42, False)
    with open(tracker, 'w') as f:
        f.write('release\n')
    assert checkpointing.read_metadata(tracker) == (0, True)
    with open(tracker, 'w') as f:
        f.write('latest')
    with pytest.raises(ValueError, match="'latest'"):
        checkpointing.read_metadata(tracker)


# ---------------------------------------------------------------------------------------------
# exact round trip


@_clean_globals
def _roundtrip_body(ckpt_dir, extra):
    from megatron.core import parallel_state as mpu

    args = _setup_args(ckpt_dir, extra)
    model, optimizer, scheduler = _build(args)
    for step in range(3):
        _fake_step(model, optimizer, scheduler, args, step)
    checkpointing.save_checkpoint(
        3, model, optimizer, scheduler, num_floating_point_operations_so_far=1.5e9
    )
    saved_params = _params(model)
    saved_scheduler = scheduler.state_dict()
    draws_after_save = _rng_draws()
    # What the uninterrupted run does next.
    _fake_step(model, optimizer, scheduler, args, 3)
    params_after_next_step = _params(model)

    # A restarted run: different init, fresh RNGs, counters at zero.
    args = _setup_args(ckpt_dir, extra)
    model, optimizer, scheduler = _build(args, seed=999)
    random.seed(5)
    np.random.seed(5)
    iteration, flops = checkpointing.load_checkpoint(model, optimizer, scheduler)
    assert (iteration, flops) == (3, 1.5e9)
    assert args.consumed_train_samples == 3 * args.global_batch_size
    _assert_same(_params(model), saved_params, 'model parameters after load')
    assert scheduler.state_dict() == saved_scheduler
    _assert_same(_rng_draws(), draws_after_save, 'RNG draws after load')
    _fake_step(model, optimizer, scheduler, args, 3)
    _assert_same(_params(model), params_after_next_step, 'parameters one step after resume')

    # What is on disk: Megatron's layout and keys, loadable with weights_only=True.
    state = checkpointing._torch_load(checkpointing.get_checkpoint_name(ckpt_dir, 3))
    expected_keys = {
        'args',
        'checkpoint_version',
        'iteration',
        'model',
        'optimizer',
        'opt_param_scheduler',
        'rng_state',
        'num_floating_point_operations_so_far',
    }
    assert set(state) == expected_keys
    assert isinstance(state['args'], argparse.Namespace)
    assert state['args'].consumed_train_samples == 3 * args.global_batch_size
    assert state['checkpoint_version'] == 3.0 and state['iteration'] == 3
    return {
        'files': sorted(
            os.path.relpath(os.path.join(root, f), ckpt_dir)
            for root, _, files in os.walk(ckpt_dir)
            for f in files
        ),
        'dp_rank': mpu.get_data_parallel_rank(),
    }


def test_roundtrip_pipeline_parallel(tmp_path):
    """PP=2: every stage saves its own file; a restart resumes bit-exactly."""
    outs = run_distributed(_roundtrip_body, world_size=2, pp=2, args=(str(tmp_path), []))
    assert outs[0]['files'] == [
        'iter_0000003/mp_rank_00_000/model_optim_rng.pt',
        'iter_0000003/mp_rank_00_001/model_optim_rng.pt',
        'latest_checkpointed_iteration.txt',
    ]


def test_roundtrip_tensor_parallel(tmp_path):
    outs = run_distributed(_roundtrip_body, world_size=2, tp=2, args=(str(tmp_path), []))
    assert outs[0]['files'] == [
        'iter_0000003/mp_rank_00/model_optim_rng.pt',
        'iter_0000003/mp_rank_01/model_optim_rng.pt',
        'latest_checkpointed_iteration.txt',
    ]


def test_roundtrip_distributed_optimizer(tmp_path):
    """DP=2 with --use-distributed-optimizer: each DP rank writes its own Adam state shard."""
    outs = run_distributed(
        _roundtrip_body, world_size=2, args=(str(tmp_path), ['--use-distributed-optimizer'])
    )
    # Data-parallel rank 0 writes the model file, every DP rank its optimizer shard; no
    # temporary files are left behind.
    assert outs[0]['files'] == [
        'iter_0000003/mp_rank_00/distrib_optim_dp000.pt',
        'iter_0000003/mp_rank_00/distrib_optim_dp001.pt',
        'iter_0000003/mp_rank_00/model_optim_rng.pt',
        'latest_checkpointed_iteration.txt',
    ]


@_clean_globals
def _dist_opt_save_body(ckpt_dir):
    args = _setup_args(ckpt_dir, ['--use-distributed-optimizer'])
    model, optimizer, scheduler = _build(args)
    for step in range(3):
        _fake_step(model, optimizer, scheduler, args, step)
    checkpointing.save_checkpoint(3, model, optimizer, scheduler, 0)
    _fake_step(model, optimizer, scheduler, args, 3)
    return _params(model)


@_clean_globals
def _dist_opt_load_body(ckpt_dir):
    args = _setup_args(ckpt_dir, ['--use-distributed-optimizer'])
    model, optimizer, scheduler = _build(args, seed=999)
    assert checkpointing.load_checkpoint(model, optimizer, scheduler)[0] == 3
    _fake_step(model, optimizer, scheduler, args, 3)
    return _params(model)


def test_distributed_optimizer_checkpoint_at_other_dp_size(tmp_path):
    """Optimizer shards saved at DP=2 resume at DP=1 (same step up to the grad-norm sum order)."""
    dp2 = run_distributed(_dist_opt_save_body, world_size=2, args=(str(tmp_path),))
    (dp1,) = run_distributed(_dist_opt_load_body, world_size=1, args=(str(tmp_path),))
    for name, value in dp2[0].items():
        torch.testing.assert_close(dp1[name], value, msg=lambda m: f'{name}: {m}')


def test_distributed_optimizer_shards_saved_at_dp4_load_at_dp2_and_dp1(tmp_path):
    """Four per-rank shards (each rank wrote its own) resume at DP=2 and DP=1: every rank copies
    the saved ranges overlapping its new shard."""
    dp4 = run_distributed(_dist_opt_save_body, world_size=4, args=(str(tmp_path),))
    files = sorted(os.listdir(tmp_path / 'iter_0000003' / 'mp_rank_00'))
    assert files == [f'distrib_optim_dp00{r}.pt' for r in range(4)] + ['model_optim_rng.pt']
    for world_size in (2, 1):
        outs = run_distributed(_dist_opt_load_body, world_size=world_size, args=(str(tmp_path),))
        for out in outs:
            for name, value in dp4[0].items():
                torch.testing.assert_close(out[name], value, msg=lambda m: f'{name}: {m}')


@_clean_globals
def _legacy_dist_opt_save_body(ckpt_dir):
    """Save, then replace the per-rank shards with Megatron's single gathered distrib_optim.pt."""
    from megatron.core import parallel_state as mpu

    params = _dist_opt_save_body.__wrapped__(ckpt_dir)
    name = checkpointing.get_checkpoint_name(ckpt_dir, 3)
    args = _setup_args(ckpt_dir, ['--use-distributed-optimizer'])
    model, optimizer, scheduler = _build(args, seed=999)
    assert checkpointing.load_checkpoint(model, optimizer, scheduler)[0] == 3
    optimizer.save_parameter_state(checkpointing.get_distributed_optimizer_checkpoint_name(name))
    torch.distributed.barrier()
    if mpu.get_data_parallel_rank() == 0:
        for path in glob.glob(os.path.join(os.path.dirname(name), 'distrib_optim_dp*.pt')):
            os.remove(path)
    torch.distributed.barrier()
    return params


def test_legacy_distrib_optim_file_still_loads(tmp_path):
    """A folder holding only Megatron's gathered distrib_optim.pt (saved at DP=2) loads at DP=1."""
    dp2 = run_distributed(_legacy_dist_opt_save_body, world_size=2, args=(str(tmp_path),))
    files = sorted(os.listdir(tmp_path / 'iter_0000003' / 'mp_rank_00'))
    assert files == ['distrib_optim.pt', 'model_optim_rng.pt']
    (dp1,) = run_distributed(_dist_opt_load_body, world_size=1, args=(str(tmp_path),))
    for name, value in dp2[0].items():
        torch.testing.assert_close(dp1[name], value, msg=lambda m: f'{name}: {m}')


# ---------------------------------------------------------------------------------------------
# crash safety


class _Bomb:
    """Pickling this object runs `action` in the middle of torch.save."""

    def __init__(self, action):
        self.action = action

    def __reduce__(self):
        if self.action == 'kill':
            os.kill(os.getpid(), signal.SIGKILL)
        raise OSError('simulated I/O error while writing the checkpoint')


class _BombModule(torch.nn.Module):
    """A submodule whose extra state (part of the model state dict) explodes when pickled."""

    def __init__(self, action):
        super().__init__()
        self.action = action

    def get_extra_state(self):
        return _Bomb(self.action)

    def set_extra_state(self, state):
        pass


@_clean_globals
def _failing_save_body(ckpt_dir):
    args = _setup_args(ckpt_dir)
    model, optimizer, scheduler = _build(args)
    _fake_step(model, optimizer, scheduler, args, 0)
    checkpointing.save_checkpoint(1, model, optimizer, scheduler, 0)
    params_at_1 = _params(model)
    _fake_step(model, optimizer, scheduler, args, 1)
    if torch.distributed.get_rank() == 1:
        model[0].module.bomb = _BombModule('raise')
    expected = r'failed on rank\(s\) \[1\]; latest_checkpointed_iteration.txt was not updated'
    with pytest.raises(RuntimeError, match=expected):
        checkpointing.save_checkpoint(2, model, optimizer, scheduler, 0)
    tracker = checkpointing.get_checkpoint_tracker_filename(ckpt_dir)
    assert open(tracker).read() == '1'
    torch.distributed.barrier()

    args = _setup_args(ckpt_dir)
    model, optimizer, scheduler = _build(args, seed=7)
    iteration, _ = checkpointing.load_checkpoint(model, optimizer, scheduler)
    assert iteration == 1
    _assert_same(_params(model), params_at_1, 'parameters loaded after a failed save')
    leftovers = [f for _, _, files in os.walk(ckpt_dir) for f in files if '.tmp' in f]
    assert leftovers == []


def test_failed_save_keeps_previous_checkpoint(tmp_path):
    """An exception while rank 1 writes: every rank raises, the tracker still names iteration 1."""
    run_distributed(_failing_save_body, world_size=2, tp=2, args=(str(tmp_path),))


@_clean_globals
def _killed_save_body(ckpt_dir, reference_file):
    args = _setup_args(ckpt_dir)
    model, optimizer, scheduler = _build(args)
    _fake_step(model, optimizer, scheduler, args, 0)
    checkpointing.save_checkpoint(1, model, optimizer, scheduler, 0)
    torch.save(_params(model), reference_file % torch.distributed.get_rank())
    _fake_step(model, optimizer, scheduler, args, 1)
    if torch.distributed.get_rank() == 1:
        model[0].module.bomb = _BombModule('kill')
    checkpointing.save_checkpoint(2, model, optimizer, scheduler, 0)  # rank 1 dies in here


@_clean_globals
def _load_after_kill_body(ckpt_dir, reference_file):
    args = _setup_args(ckpt_dir)
    model, optimizer, scheduler = _build(args, seed=7)
    iteration, _ = checkpointing.load_checkpoint(model, optimizer, scheduler)
    reference = torch.load(reference_file % torch.distributed.get_rank(), weights_only=True)
    _assert_same(_params(model), reference, 'parameters loaded after a killed save')
    # The next save removes the partial file the killed one left behind.
    checkpointing.save_checkpoint(2, model, optimizer, scheduler, 0)
    leftovers = [f for _, _, files in os.walk(ckpt_dir) for f in files if '.tmp' in f]
    assert leftovers == [], leftovers
    # The tracker never moves backwards.
    with pytest.raises(ValueError, match='names iteration 2; saving iteration 1 would move it'):
        checkpointing.save_checkpoint(1, model, optimizer, scheduler, 0)
    assert open(checkpointing.get_checkpoint_tracker_filename(ckpt_dir)).read() == '2'
    return iteration


def test_killed_save_keeps_previous_checkpoint(tmp_path):
    """SIGKILL of rank 1 in the middle of torch.save: iteration 1 stays the loadable checkpoint."""
    ckpt_dir = str(tmp_path / 'ckpt')
    reference_file = str(tmp_path / 'params_rank%d.pt')
    # Rank 1 vanishes; rank 0 then fails in the save's agreement collective (or is reported dead).
    with pytest.raises(RuntimeError, match=r'_killed_save_body'):
        run_distributed(
            _killed_save_body, world_size=2, tp=2, args=(ckpt_dir, reference_file), timeout=60
        )
    assert open(checkpointing.get_checkpoint_tracker_filename(ckpt_dir)).read() == '1'
    rank1_dir = tmp_path / 'ckpt' / 'iter_0000002' / 'mp_rank_01'
    assert not (rank1_dir / 'model_optim_rng.pt').exists()
    assert any('.tmp' in p.name for p in rank1_dir.iterdir())  # the partial write, never renamed
    outs = run_distributed(
        _load_after_kill_body, world_size=2, tp=2, args=(ckpt_dir, reference_file)
    )
    assert outs == [1, 1]


# ---------------------------------------------------------------------------------------------
# mismatches and flags


@_clean_globals
def _save_only_body(ckpt_dir, extra, iterations=(1,)):
    args = _setup_args(ckpt_dir, extra)
    model, optimizer, scheduler = _build(args)
    for it in iterations:
        _fake_step(model, optimizer, scheduler, args, it)
        checkpointing.save_checkpoint(it, model, optimizer, scheduler, 0)


@_clean_globals
def _expect_load_error_body(ckpt_dir, extra):
    args = _setup_args(ckpt_dir, extra)
    model, optimizer, scheduler = _build(args)
    with pytest.raises(ValueError) as excinfo:
        checkpointing.load_checkpoint(model, optimizer, scheduler)
    return str(excinfo.value)


def _fsdp2_legacy_load_body(ckpt_dir):
    _save_only_body(ckpt_dir, [])
    return _expect_load_error_body(ckpt_dir, ['--use-torch-fsdp2', '--use-dist-ckpt'])


def test_fsdp2_refuses_a_legacy_checkpoint(tmp_path):
    """FSDP2 shards cannot take a legacy torch-format file: one line, before anything is read."""
    (msg,) = run_distributed(_fsdp2_legacy_load_body, world_size=1, args=(str(tmp_path),))
    assert msg == (
        f'--use-torch-fsdp2: {tmp_path}/iter_0000001/mp_rank_00/model_optim_rng.pt is a legacy '
        'torch-format checkpoint, which FSDP2-sharded models cannot load; save it with '
        '--ckpt-format torch_dist'
    )


def test_mismatched_tensor_parallel_size(tmp_path):
    """TP=2 checkpoint into a TP=1 run and TP=1 checkpoint into a TP=2 run: both sizes named."""
    tp2_dir, tp1_dir = str(tmp_path / 'tp2'), str(tmp_path / 'tp1')
    run_distributed(_save_only_body, world_size=2, tp=2, args=(tp2_dir, []))
    (msg,) = run_distributed(_expect_load_error_body, world_size=1, args=(tp2_dir, []))
    assert (
        'tensor_model_parallel_size value from checkpoint (2) is not equal to the input '
        'argument value (1)' in msg
    )

    run_distributed(_save_only_body, world_size=1, args=(tp1_dir, []))
    msgs = run_distributed(_expect_load_error_body, world_size=2, tp=2, args=(tp1_dir, []))
    for msg in msgs:  # rank 1 has no mp_rank_01 file: it reads rank 0's args to explain
        assert (
            'tensor_model_parallel_size value from checkpoint (1) is not equal to the input '
            'argument value (2)' in msg
        )


@_clean_globals
def _flags_body(ckpt_dir):
    """Single rank: hidden-size / ffn mismatch, --no-save-optim, --finetune, --ckpt-step, no
    checkpoint, --pretrained-checkpoint and a release checkpoint."""
    results = {}
    hidden_dir, plain_dir, noopt_dir = (os.path.join(ckpt_dir, d) for d in ('h', 'p', 'n'))
    _save_only_body(hidden_dir, [])
    results['hidden'] = _expect_load_error_body(hidden_dir, ['--hidden-size', '64'])
    results['ffn'] = _expect_load_error_body(hidden_dir, ['--ffn-hidden-size', '64'])

    _save_only_body(noopt_dir, ['--no-save-optim', '--no-save-rng'])
    results['noopt'] = _expect_load_error_body(noopt_dir, [])
    args = _setup_args(noopt_dir, ['--no-load-optim', '--no-load-rng'])
    model, optimizer, scheduler = _build(args)
    results['noopt_ok'] = checkpointing.load_checkpoint(model, optimizer, scheduler)

    _save_only_body(plain_dir, [], iterations=(1, 2))
    args = _setup_args(plain_dir, ['--finetune'])
    model, optimizer, scheduler = _build(args)
    results['finetune'] = checkpointing.load_checkpoint(model, optimizer, scheduler)
    results['finetune_consumed'] = args.consumed_train_samples
    args = _setup_args(plain_dir, ['--ckpt-step', '1'])
    model, optimizer, scheduler = _build(args)
    results['ckpt_step'] = checkpointing.load_checkpoint(model, optimizer, scheduler)
    results['ckpt_step_consumed'] = args.consumed_train_samples

    args = _setup_args(os.path.join(ckpt_dir, 'missing'))
    model, optimizer, scheduler = _build(args)
    results['missing'] = checkpointing.load_checkpoint(model, optimizer, scheduler)

    # --pretrained-checkpoint while --load has nothing yet: finetune from it.
    args = _setup_args(os.path.join(ckpt_dir, 'fresh'), ['--pretrained-checkpoint', plain_dir])
    model, optimizer, scheduler = _build(args, seed=3)
    results['pretrained'] = checkpointing.load_checkpoint(model, optimizer, scheduler)
    results['pretrained_finetune'] = args.finetune
    params_from_pretrained = _params(model)

    # A release checkpoint: iteration 0, model only.
    release_dir = os.path.join(ckpt_dir, 'r')
    shutil.copytree(os.path.join(plain_dir, 'iter_0000002'), os.path.join(release_dir, 'release'))
    with open(checkpointing.get_checkpoint_tracker_filename(release_dir), 'w') as f:
        f.write('release')
    args = _setup_args(release_dir)
    model, optimizer, scheduler = _build(args, seed=4)
    results['release'] = checkpointing.load_checkpoint(model, optimizer, scheduler)
    _assert_same(_params(model), params_from_pretrained, 'release checkpoint parameters')
    return results


def test_load_flags_and_model_mismatch(tmp_path):
    (res,) = run_distributed(_flags_body, world_size=1, args=(str(tmp_path),))
    assert (
        'hidden_size value from checkpoint (32) is not equal to the input argument value (64)'
        in res['hidden']
    )
    # ffn_hidden_size is not a compared arg: the shape check names the tensor and both shapes.
    assert (
        'decoder.layers.0.mlp.linear_fc1.weight: shape in checkpoint [128, 32] != '
        'shape in model [64, 32]' in res['ffn']
    )
    assert 'Specify --no-load-optim or --finetune' in res['noopt']
    assert res['noopt_ok'] == (1, 0)
    assert res['finetune'] == (0, 0) and res['finetune_consumed'] == 0
    assert res['ckpt_step'] == (1, 0) and res['ckpt_step_consumed'] == 4
    assert res['missing'] == (0, 0)
    assert res['pretrained'] == (0, 0) and res['pretrained_finetune']
    assert res['release'] == (0, 0)


def test_use_checkpoint_args_and_exit_on_missing(tmp_path):
    """--use-checkpoint-args fills model args from the checkpoint, without a process group."""
    ckpt_dir = str(tmp_path)
    run_distributed(_save_only_body, world_size=1, args=(ckpt_dir, ['--ffn-hidden-size', '48']))

    from megatron.training.arguments import parse_args

    args = parse_args(args_list=['--use-checkpoint-args', '--load', ckpt_dir])
    args, checkpoint_args = checkpointing.load_args_from_checkpoint(args)
    shape = (args.num_layers, args.hidden_size, args.ffn_hidden_size, args.num_attention_heads)
    assert shape == (2, 32, 48, 4)
    assert args.padded_vocab_size == PADDED_VOCAB and args.iteration == 1
    assert checkpoint_args.ffn_hidden_size == 48

    args = parse_args(args_list=['--load', str(tmp_path / 'nothing-here')])
    with pytest.raises(SystemExit, match='exit-on-missing-checkpoint'):
        checkpointing.load_args_from_checkpoint(args, exit_on_missing_checkpoint=True)


# ---------------------------------------------------------------------------------------------
# signal handler


def _signal_body():
    from megatron.training.dist_signal_handler import DistributedSignalHandler

    before = signal.getsignal(signal.SIGTERM)
    with DistributedSignalHandler(signal.SIGTERM) as handler:
        first = handler.signals_received()
        if torch.distributed.get_rank() == 1:
            os.kill(os.getpid(), signal.SIGTERM)  # survives: the handler only records it
        second = handler.signals_received()
    assert signal.getsignal(signal.SIGTERM) is before
    return first, second


def test_signal_handler_all_gathers_flags():
    outs = run_distributed(_signal_body, world_size=2)
    assert outs == [([0, 0], [0, 1]), ([0, 0], [0, 1])]
