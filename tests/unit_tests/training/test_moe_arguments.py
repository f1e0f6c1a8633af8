"""MoE flags: each impossible combination stops start-up with one line naming the flags and the
numbers (the rows `moe-*` of docs/errors.md), and the accepted flags reach TransformerConfig."""

import re

import pytest

from megatron.training.arguments import core_transformer_config_from_args, parse_args, validate_args

BASE = [
    '--num-layers',
    '4',
    '--hidden-size',
    '64',
    '--num-attention-heads',
    '4',
    '--seq-length',
    '32',
    '--max-position-embeddings',
    '32',
    '--micro-batch-size',
    '2',
    '--train-iters',
    '10',
    '--lr',
    '1e-3',
    '--num-experts',
    '4',
]


def _validate(extra=(), world_size=1):
    args = parse_args(args_list=BASE + list(extra))
    args.world_size = world_size
    args.rank = 0
    return validate_args(args, {})


#: docs/errors.md id -> (flags, world size, the whole message).
ERRORS = {
    'moe-topk': (
        ['--moe-router-topk', '5'],
        1,
        '--moe-router-topk (5) must be between 1 and --num-experts (4)',
    ),
    'moe-ep-experts': (
        ['--num-experts', '6', '--expert-model-parallel-size', '4'],
        4,
        '--num-experts (6) must be divisible by --expert-model-parallel-size (4)',
    ),
    'moe-ep-tp-sp': (
        ['--expert-model-parallel-size', '2', '--tensor-model-parallel-size', '2'],
        4,
        '--expert-model-parallel-size 2 with --tensor-model-parallel-size 2 needs '
        '--sequence-parallel',
    ),
    'moe-capacity': (
        ['--moe-token-dispatcher-type', 'alltoall', '--moe-expert-capacity-factor', '-1'],
        1,
        '--moe-expert-capacity-factor must be positive, got -1.0',
    ),
    'moe-legacy': (
        ['--use-legacy-models'],
        1,
        '--use-legacy-models: only the megatron.core models exist in this package',
    ),
    'moe-ep-dp': (
        ['--expert-model-parallel-size', '4', '--tensor-model-parallel-size', '2'],
        4,
        'data parallel size (2) x --context-parallel-size (1) must be divisible by '
        '--expert-model-parallel-size (4)',
    ),
    'moe-tp-sp': (
        ['--tensor-model-parallel-size', '2'],
        2,
        'training MoE layers with --tensor-model-parallel-size 2 needs --sequence-parallel '
        '(without it every tensor-parallel rank would add the gradient of the same tokens to the '
        'experts)',
    ),
    'moe-config': (
        ['--moe-expert-capacity-factor', '1.0'],
        1,
        'MoE flags: moe_expert_capacity_factor only works with alltoall token dispatcher',
    ),
}


@pytest.mark.parametrize('case', sorted(ERRORS))
def test_error_before_work(case, capsys):
    flags, world_size, message = ERRORS[case]
    with pytest.raises(ValueError) as err:
        _validate(flags, world_size)
    assert str(err.value) == message
    assert '\n' not in str(err.value)


def test_unknown_dispatcher_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit) as err:
        _validate(['--moe-token-dispatcher-type', 'flex'])
    assert err.value.code == 2
    line = [x for x in capsys.readouterr().err.splitlines() if 'error:' in x]
    assert len(line) == 1
    assert re.search(
        r"error: argument --moe-token-dispatcher-type: invalid choice: '?flex'? \(choose from "
        r"'?allgather'?, '?alltoall'?\)$",
        line[0],
    ), line


def test_more_rules_of_the_model_config():
    for flags, message in (
        (['--moe-router-topk', '1'], 'Please use --moe-router-pre-softmax when topk is 1.'),
        (
            ['--moe-router-load-balancing-type', 'sinkhorn', '--moe-aux-loss-coeff', '1e-2'],
            'Sinkhorn routing does not support aux loss.',
        ),
        (
            ['--moe-pad-expert-input-to-capacity'],
            'moe_expert_capacity_factor must be set to use moe_pad_expert_input_to_capacity',
        ),
        (
            ['--moe-extended-tp', '--moe-token-dispatcher-type', 'alltoall'],
            'Moe extended TP parallelism only applies to allgather based token dispatcher.',
        ),
        (['--moe-layer-freq', '[1,0]'], 'moe_layer_freq as a list needs num_layers (4)'),
        (['--moe-grouped-gemm'], "bias in the expert layer is not supported in Grouped GEMM"),
    ):
        with pytest.raises(ValueError, match=re.escape(message)):
            _validate(flags)


def test_flags_reach_the_model_config():
    args = _validate(
        [
            '--moe-router-topk',
            '1',
            '--moe-router-pre-softmax',
            '--moe-token-dispatcher-type',
            'alltoall',
            '--moe-expert-capacity-factor',
            '1.5',
            '--moe-pad-expert-input-to-capacity',
            '--moe-token-drop-policy',
            'position',
            '--moe-z-loss-coeff',
            '1e-3',
            '--moe-router-score-function',
            'sigmoid',
            '--moe-router-enable-expert-bias',
            '--moe-router-dtype',
            'fp32',
            '--moe-shared-expert-intermediate-size',
            '96',
            '--moe-shared-expert-gate',
            '--moe-ffn-hidden-size',
            '48',
            '--moe-layer-freq',
            '[0]+[1]*3',
            '--disable-bias-linear',
            '--swiglu',
        ]
    )
    config = core_transformer_config_from_args(args)
    assert config.num_moe_experts == 4 and config.moe_router_topk == 1
    assert config.moe_router_pre_softmax and config.moe_token_dispatcher_type == 'alltoall'
    assert config.moe_expert_capacity_factor == 1.5 and config.moe_pad_expert_input_to_capacity
    assert config.moe_token_drop_policy == 'position' and config.moe_z_loss_coeff == 1e-3
    assert config.moe_router_score_function == 'sigmoid' and config.moe_router_enable_expert_bias
    assert config.moe_router_dtype == 'fp32'
    assert config.moe_shared_expert_intermediate_size == 96 and config.moe_shared_expert_gate
    assert config.moe_ffn_hidden_size == 48 and config.ffn_hidden_size == 128
    assert config.moe_layer_freq == [0, 1, 1, 1]
    assert _validate(['--moe-layer-freq', '2']).moe_layer_freq == 2
    assert _validate(['--num-experts', '0']).num_experts is None  # Megatron: 0 means no MoE
    assert core_transformer_config_from_args(_validate()).moe_ffn_hidden_size == 256


def test_bad_layer_freq_expression_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit):
        _validate(['--moe-layer-freq', '__import__("os")'])
    assert '--moe-layer-freq expects an integer or a list expression' in capsys.readouterr().err
