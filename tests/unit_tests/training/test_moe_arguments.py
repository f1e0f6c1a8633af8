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
        'data parallel size (2 = world size 4 / (TP 2 x PP 1 x CP 1)) is not divisible by '
        '--expert-model-parallel-size (4); expert parallelism splits the data-parallel ranks, '
        'not the context-parallel ones',
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
    'moe-cp-capacity': (
        [
            '--context-parallel-size',
            '2',
            '--moe-token-dispatcher-type',
            'alltoall',
            '--moe-expert-capacity-factor',
            '1.0',
        ],
        2,
        '--moe-expert-capacity-factor 1.0 with --context-parallel-size 2: each context-parallel '
        'rank would choose the dropped tokens among its own 1/2 of the sequence, not among the '
        'whole sequence, so training would differ from --context-parallel-size 1; use dropless '
        'MoE (no capacity factor) with context parallelism',
    ),
    'moe-cp-sinkhorn': (
        ['--context-parallel-size', '2', '--moe-router-load-balancing-type', 'sinkhorn'],
        2,
        '--moe-router-load-balancing-type sinkhorn with --context-parallel-size 2: Sinkhorn '
        'balances the routing over the tokens of one rank, which holds only 1/2 of the sequence, '
        'so training would differ from --context-parallel-size 1; use aux_loss or none',
    ),
    'moe-ep-stage-without-experts': (
        [
            '--moe-layer-freq',
            '[0,0,1,1]',
            '--pipeline-model-parallel-size',
            '2',
            '--expert-model-parallel-size',
            '2',
        ],
        4,
        '--moe-layer-freq [0, 0, 1, 1] leaves pipeline stage 0 (layers 0-1) without an MoE '
        'layer, which --expert-model-parallel-size 2 with --pipeline-model-parallel-size 2 '
        'cannot run (its expert optimizer reductions span every stage): give each stage an MoE '
        'layer (e.g. --decoder-first-pipeline-num-layers) or use --expert-model-parallel-size 1',
    ),
}


def test_an_uneven_split_that_gives_every_stage_an_expert_layer_is_accepted():
    flags = ['--moe-layer-freq', '[0,0,1,1]', '--pipeline-model-parallel-size', '2']
    flags += ['--expert-model-parallel-size', '2', '--decoder-first-pipeline-num-layers', '3']
    assert _validate(flags, 4).decoder_first_pipeline_num_layers == 3


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


def test_expert_parallelism_splits_data_not_context_parallelism():
    """As Megatron core_r0.8: EP must divide DP = world / (TP x PP x CP); DP x CP is not enough.
    The argument check and the rank layout (`generate_model_parallel_groups`) accept and refuse
    the same sizes, with the same reason."""
    from megatron.core.parallel_layout import generate_model_parallel_groups

    flags = ['--context-parallel-size', '2', '--expert-model-parallel-size', '2']
    with pytest.raises(ValueError) as err:
        _validate(flags, 2)  # DP 1: DP x CP = 2 would have passed the old rule
    assert str(err.value) == (
        'data parallel size (1 = world size 2 / (TP 1 x PP 1 x CP 2)) is not divisible by '
        '--expert-model-parallel-size (2); expert parallelism splits the data-parallel ranks, not '
        'the context-parallel ones'
    )
    assert _validate(flags, 4).data_parallel_size == 2
    for world in (2, 4, 8, 12, 16):
        for tp, cp, ep in ((1, 2, 2), (2, 2, 2), (1, 2, 4), (1, 4, 2), (2, 1, 4), (1, 3, 2)):
            if world % (tp * cp):
                continue
            extra = ['--tensor-model-parallel-size', str(tp), '--sequence-parallel']
            extra += ['--context-parallel-size', str(cp), '--expert-model-parallel-size', str(ep)]
            extra += ['--num-experts', '8', '--seq-length', '48', '--max-position-embeddings', '48']
            try:
                _validate(extra, world)
                accepted = True
            except ValueError as exc:
                assert 'expert parallelism splits the data-parallel ranks' in str(exc), exc
                accepted = False
            try:
                generate_model_parallel_groups(
                    world,
                    tensor_model_parallel_size=tp,
                    context_parallel_size=cp,
                    expert_model_parallel_size=ep,
                )
                laid_out = True
            except ValueError as exc:
                assert 'expert parallelism splits the data-parallel ranks' in str(exc), exc
                laid_out = False
            assert accepted == laid_out == (world // (tp * cp) % ep == 0), (world, tp, cp, ep)
