"""Start-up refusals of the MLA / MTP / group-limited routing flags: one ValueError line naming
the flag and the numbers, before any work (the training layer prints it as `error: ...`)."""

import pytest

BASE = [
    '--num-layers',
    '2',
    '--hidden-size',
    '48',
    '--num-attention-heads',
    '6',
    '--seq-length',
    '16',
    '--max-position-embeddings',
    '16',
    '--micro-batch-size',
    '1',
    '--position-embedding-type',
    'rope',
]


def _args(extra):
    from megatron.training.arguments import parse_args

    return parse_args(args_list=BASE + extra)


@pytest.mark.parametrize(
    'extra,message',
    [
        (
            ['--multi-latent-attention', '--tensor-model-parallel-size', '4'],
            r'--num-attention-heads \(6\) must be a multiple of --tensor-model-parallel-size \(4\)',
        ),
        (
            ['--multi-latent-attention', '--context-parallel-size', '2'],
            r'--context-parallel-size \(2\) > 1 is not supported',
        ),
        (
            ['--multi-latent-attention', '--group-query-attention', '--num-query-groups', '2'],
            'excludes --group-query-attention',
        ),
        (
            ['--mtp-num-layers', '1', '--num-layers-per-virtual-pipeline-stage', '1'],
            r'not supported with the interleaved schedule '
            r'\(--num-layers-per-virtual-pipeline-stage 1\)',
        ),
        (['--mtp-num-layers', '1', '--context-parallel-size', '2'], r'\(2\) > 1 is not supported'),
        (
            ['--mtp-num-layers', '1', '--position-embedding-type', 'learned_absolute'],
            'rope or none, got learned_absolute',
        ),
    ],
)
def test_mla_and_mtp_refusals(extra, message):
    from megatron.training.validation.argument_validation_mla import validate_mla_args

    with pytest.raises(ValueError, match=message) as info:
        validate_mla_args(_args(extra))
    assert '\n' not in str(info.value)


def test_valid_mla_mtp_flags_pass_and_build_the_config():
    from megatron.training.mla_config import mla_config_from_args
    from megatron.training.validation.argument_validation_mla import validate_mla_args

    args = _args(
        [
            '--multi-latent-attention',
            '--mtp-num-layers',
            '1',
            '--q-lora-rank',
            '8',
            '--rotary-scaling-factor',
            '4',
            '--mscale-all-dim',
            '1.0',
        ]
    )
    validate_mla_args(args)
    # What validate_args derives before the model provider runs.
    args.params_dtype, args.cp_comm_type = __import__('torch').float32, None
    config = mla_config_from_args(args)
    assert (config.q_lora_rank, config.kv_lora_rank, config.rope_type) == (8, 32, 'yarn')
    assert (config.rotary_scaling_factor, config.mscale_all_dim, config.mtp_num_layers) == (
        4.0,
        1.0,
        1,
    )
    assert config.original_max_position_embeddings == 4096 and config.beta_fast == 32.0


@pytest.mark.parametrize(
    'extra,message',
    [
        (['--moe-router-num-groups', '3', '--moe-router-group-topk', '1'], 'must divide'),
        (['--moe-router-num-groups', '4', '--moe-router-group-topk', '5'], 'between 1 and'),
        (['--moe-router-num-groups', '4'], 'must be set together'),
    ],
)
def test_group_limited_routing_refusals(extra, message):
    from megatron.training.validation.argument_validation_moe import validate_moe_args

    args = _args(['--num-experts', '8', '--moe-router-topk', '2'] + extra)
    with pytest.raises(ValueError, match=message):
        validate_moe_args(args)


@pytest.mark.parametrize(
    'extra,message',
    [
        (['--use-distributed-optimizer'], '--optimizer muon with --use-distributed-optimizer'),
        (['--fp16'], '--optimizer muon with --fp16'),
        (['--qk-clip', '--bf16'], '--qk-clip with --bf16 is not supported'),
        (['--qk-clip', '--qk-clip-alpha', '1.5'], r'--qk-clip-alpha must be in \(0, 1\)'),
    ],
)
def test_muon_and_qk_clip_refuse_incompatible_flags(extra, message):
    from megatron.training.validation.argument_validation_mla import validate_mla_args

    with pytest.raises(ValueError, match=message):
        validate_mla_args(_args(['--optimizer', 'muon'] + extra))
