"""--use-torch-fsdp2 flags: each combination that could not be exact stops start-up with one line
naming the flags (the fsdp* rows of docs/errors.md), and the accepted ones set up the wrapper's
config."""

import pytest
import torch

from megatron.training.arguments import parse_args, validate_args
from megatron.training.loop.fsdp_wrapping import fsdp2_config_from_args, keeps_fp32_params

BASE = [
    '--num-layers', '2', '--hidden-size', '32', '--num-attention-heads', '4',
    '--seq-length', '16', '--max-position-embeddings', '16', '--micro-batch-size', '2',
    '--train-iters', '4', '--lr', '1e-3',
]  # fmt: skip


def _validate(extra=(), world_size=4):
    args = parse_args(args_list=BASE + list(extra))
    args.world_size = world_size
    args.rank = 0
    return validate_args(args, {})


REFUSED = {
    'pipeline': (['--pipeline-model-parallel-size', '2'], 'pipeline parallelism'),
    'experts-extended-tp': (
        ['--num-experts', '4', '--expert-model-parallel-size', '2', '--moe-extended-tp'],
        '--moe-extended-tp (--expert-model-parallel-size 2)',
    ),
    'hsdp-not-dividing': (
        ['--num-distributed-optimizer-instances', '3'],
        '--num-distributed-optimizer-instances 3 must divide the data x context parallel size 4',
    ),
    'distributed-optimizer': (['--use-distributed-optimizer'], '--use-distributed-optimizer'),
    'fp16': (['--fp16'], '--fp16'),
    'bf16-reduce-needs-bf16': (['--torch-fsdp2-reduce-in-bf16'], 'requires --bf16'),
    'legacy-checkpoint': (['--save', '/nonexistent/ckpt'], 'requires --ckpt-format torch_dist'),
    'legacy-checkpoint-load': (
        ['--load', '/nonexistent/ckpt', '--ckpt-format', 'torch'],
        'the legacy torch format is refused',
    ),
}


@pytest.mark.parametrize('name', sorted(REFUSED))
def test_refused_combinations_are_one_line_errors(name):
    extra, text = REFUSED[name]
    with pytest.raises(ValueError) as err:
        _validate(['--use-torch-fsdp2'] + extra)
    message = str(err.value)
    assert '\n' not in message and text in message, message


@pytest.mark.parametrize(
    'extra',
    [
        [],
        ['--use-distributed-optimizer'],
        ['--use-megatron-fsdp', '--data-parallel-sharding-strategy', 'optim'],
    ],
    ids=['ddp', 'distributed-optimizer', 'megatron-fsdp-optim'],
)
def test_hsdp_needs_an_fsdp2_engine(extra):
    with pytest.raises(ValueError) as err:
        _validate(['--num-distributed-optimizer-instances', '2'] + extra)
    message = str(err.value)
    assert '\n' not in message and 'requires --use-torch-fsdp2 (HSDP)' in message, message


def test_hsdp_is_accepted_with_fsdp2_engines():
    args = _validate(['--use-torch-fsdp2', '--num-distributed-optimizer-instances', '2'])
    assert args.num_distributed_optimizer_instances == 2
    args = _validate(['--use-megatron-fsdp', '--num-distributed-optimizer-instances', '4'])
    assert args.use_torch_fsdp2


def test_expert_parallelism_is_accepted():
    args = _validate(
        ['--use-torch-fsdp2', '--num-experts', '4', '--expert-model-parallel-size', '2']
    )
    assert args.use_torch_fsdp2 and args.expert_model_parallel_size == 2


@pytest.mark.parametrize(
    'flag', ['--torch-fsdp2-no-reshard-after-forward', '--torch-fsdp2-reduce-in-bf16']
)
def test_options_need_use_torch_fsdp2(flag):
    with pytest.raises(ValueError, match=f'{flag} requires --use-torch-fsdp2'):
        _validate([flag, '--bf16'])


def test_accepted_flags_give_the_wrapper_config():
    args = _validate(['--use-torch-fsdp2', '--bf16', '--tensor-model-parallel-size', '2'])
    assert not args.gradient_accumulation_fusion  # the fused wgrad needs DDP's main_grad
    assert keeps_fp32_params(args)
    config = fsdp2_config_from_args(args)
    assert config.reshard_after_forward
    assert (config.param_dtype, config.reduce_dtype) == (torch.bfloat16, torch.float32)

    args = _validate(
        ['--use-torch-fsdp2', '--bf16', '--torch-fsdp2-reduce-in-bf16']
        + ['--torch-fsdp2-no-reshard-after-forward']
    )
    assert not keeps_fp32_params(args)
    config = fsdp2_config_from_args(args)
    assert not config.reshard_after_forward and config.reduce_dtype is None


@pytest.mark.parametrize(
    'fmt', [['--ckpt-format', 'torch_dist'], ['--ckpt-format', 'fsdp_dtensor'], ['--use-dist-ckpt']]
)
def test_fsdp2_checkpoints_in_the_distributed_format(fmt):
    save = ['--save', '/nonexistent/ckpt', '--save-interval', '2']
    args = _validate(['--use-torch-fsdp2'] + save + fmt)
    # fsdp_dtensor is later Megatron's name for the same files.
    assert (args.ckpt_format, args.use_dist_ckpt) == ('torch_dist', True)
    strategy = ['--use-megatron-fsdp', '--data-parallel-sharding-strategy', 'optim_grads']
    args = _validate(strategy + ['--load', '/nonexistent/ckpt'] + fmt)
    assert args.use_torch_fsdp2 and args.use_dist_ckpt


#: strategy -> (use_distributed_optimizer, use_torch_fsdp2, reshard_after_forward)
STRATEGIES = {
    'no_shard': (False, False, True),
    'optim': (True, False, True),
    'optim_grads': (False, True, False),
    'optim_grads_params': (False, True, True),
}


@pytest.mark.parametrize('strategy', sorted(STRATEGIES))
def test_megatron_fsdp_strategies_map_onto_our_engines(strategy):
    # Megatron's runs pass --use-distributed-optimizer with every strategy; it is accepted.
    args = _validate(
        ['--use-megatron-fsdp', '--data-parallel-sharding-strategy', strategy]
        + ['--use-distributed-optimizer']
    )
    got = (
        args.use_distributed_optimizer,
        args.use_torch_fsdp2,
        args.torch_fsdp2_reshard_after_forward,
    )
    assert got == STRATEGIES[strategy]


def test_megatron_fsdp_refusals_name_the_strategy():
    with pytest.raises(ValueError) as err:
        _validate(['--use-megatron-fsdp', '--pipeline-model-parallel-size', '2'])
    assert str(err.value).startswith(
        '--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params is not '
        'supported with pipeline parallelism'
    )
    with pytest.raises(ValueError, match='contradicts --use-megatron-fsdp'):
        _validate(['--use-megatron-fsdp', '--use-torch-fsdp2'])


def test_theoretical_memory_accounts_for_each_strategy():
    from megatron.training.theoretical_memory_usage import compute_weight_and_optimizer_memory

    memory = {}
    for strategy in STRATEGIES:
        args = _validate(['--use-megatron-fsdp', '--data-parallel-sharding-strategy', strategy])
        args.padded_vocab_size = 1024  # set by the tokenizer in a run
        memory[strategy] = compute_weight_and_optimizer_memory(args)
    dp = 4
    # Bytes per parameter: 18 replicated, 6 + 12 / DP with the optimizer state sharded, 16 / DP
    # with everything sharded.
    assert memory['optim'] / memory['no_shard'] == pytest.approx((6 + 12 / dp) / 18)
    assert memory['optim_grads'] / memory['no_shard'] == pytest.approx(16 / dp / 18)
    assert memory['optim_grads_params'] == memory['optim_grads']
    args = _validate(['--use-torch-fsdp2', '--num-distributed-optimizer-instances', '2'])
    args.padded_vocab_size = 1024
    # HSDP: each of the 2 replicas shards over DP / 2 ranks.
    hsdp = compute_weight_and_optimizer_memory(args)
    assert hsdp / memory['no_shard'] == pytest.approx(16 / (dp / 2) / 18)


def test_theoretical_memory_of_fsdp2_experts():
    from megatron.training.theoretical_memory_usage import compute_weight_and_optimizer_memory

    moe = ['--num-experts', '4', '--expert-model-parallel-size', '2']
    memory = {}
    for name, extra in (('ddp', []), ('fsdp2', ['--use-torch-fsdp2'])):
        args = _validate(moe + extra)
        args.padded_vocab_size = 1024
        memory[name] = compute_weight_and_optimizer_memory(args)
    # DP4 x EP2: dense state over 4 ranks, expert state over the 2 expert-data-parallel ranks,
    # so FSDP2 holds between 16 / 4 and 16 / 2 bytes for each of DDP's 18.
    assert 16 / 4 / 18 < memory['fsdp2'] / memory['ddp'] < 16 / 2 / 18
