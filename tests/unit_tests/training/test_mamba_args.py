"""Hybrid Mamba flags: each combination that core_r0.8.0 would build wrongly (or fail on in a
bare assert) is refused before any work with one line naming the flag and the numbers."""

import pytest

from megatron.training.cli.arguments_parser import get_args_parser
from megatron.training.validation.argument_validation_mamba import validate_mamba_args

GPT = ['--num-layers', '4', '--hidden-size', '64', '--num-attention-heads', '4']
BASE = GPT + ['--mamba-head-dim', '16', '--mamba-num-groups', '2']
MAMBA = BASE + ['--spec', 'megatron.core.models.mamba.mamba_layer_specs', 'mamba_stack_spec']


def _validate(argv, **overrides):
    args = get_args_parser().parse_args(argv)
    for key, value in overrides.items():
        setattr(args, key, value)
    validate_mamba_args(args)
    return args


def test_valid_runs_pass():
    _validate(MAMBA + ['--hybrid-override-pattern', 'M*M-'])
    _validate(BASE + ['--hybrid-attention-ratio', '0.25'], is_hybrid_model=True)
    _validate(GPT)  # a GPT run with default Mamba flags
    # Context parallelism: heads split over CP ranks, groups split or replicated.
    _validate(MAMBA, context_parallel_size=2)
    _validate(MAMBA, context_parallel_size=4, tensor_model_parallel_size=2)
    _validate(MAMBA + ['--hybrid-override-pattern', '**--'], context_parallel_size=16)
    # Packed sequences: the mixers reorder by the per-sequence split.
    _validate(MAMBA + ['--hybrid-override-pattern', 'M*M-'], context_parallel_size=2, sft=True)


@pytest.mark.parametrize(
    'argv,overrides,message',
    [
        (GPT + ['--hybrid-attention-ratio', '0.25'], {}, r'--hybrid-attention-ratio .* needs a'),
        (GPT + ['--mamba-state-dim', '16'], {}, '--mamba-state-dim .* needs a hybrid'),
        (MAMBA + ['--use-legacy-models'], {}, 'Mamba only supported in Mcore'),
        (MAMBA + ['--hybrid-override-pattern', 'M*M'], {}, 'wrong length: got 3, expected 4'),
        (MAMBA + ['--hybrid-override-pattern', 'M*MX'], {}, "'X' is not one of"),
        (MAMBA + ['--hybrid-attention-ratio', '1.5'], {}, r'hybrid_attention_ratio \(1.5\)'),
        (
            MAMBA + ['--hybrid-attention-ratio', '0.6', '--hybrid-mlp-ratio', '0.6'],
            {},
            'must not exceed 1.0',
        ),
        (
            MAMBA + ['--hybrid-attention-ratio', '0.25', '--hybrid-override-pattern', 'M**M'],
            {},
            'must match the number',
        ),
        (
            MAMBA,
            {'tensor_model_parallel_size': 3},
            r'Mamba heads \(8\) must be divisible by '
            r'tensor_model_parallel_size \(3\)',
        ),
        (MAMBA, {'tensor_model_parallel_size': 4}, r'mamba_num_groups \(2\) must be divisible'),
        (
            MAMBA + ['--mamba-num-groups', '3'],
            {},
            r'Mamba heads \(8\) must be divisible by '
            r'mamba_num_groups \(3\)',
        ),
        (MAMBA + ['--mamba-head-dim', '48'], {}, r'2 \* hidden_size \(128\) must be divisible'),
        (MAMBA, {'pipeline_model_parallel_size': 3}, r'--num-layers \(4\) .* divisible by'),
        (MAMBA, {'virtual_pipeline_model_parallel_size': 2}, 'virtual/interleaved'),
        (
            MAMBA,
            {'context_parallel_size': 16},
            r'Mamba heads per tensor-parallel rank \(8 / 1 = 8\) must be divisible by '
            r'context_parallel_size \(16\)',
        ),
        (
            MAMBA + ['--mamba-num-heads', '12', '--mamba-num-groups', '3'],
            {'context_parallel_size': 4},
            r'context_parallel_size \(4\) must be divisible by mamba_num_groups per '
            r'tensor-parallel rank \(3 / 1 = 3\)',
        ),
        (
            MAMBA
            + [
                '--reset-attention-mask',
                '--hybrid-override-pattern',
                'M*M-',
                '--no-create-attention-mask-in-dataloader',
            ],
            {},
            "needs the dataloader's",
        ),
        (
            MAMBA + ['--reset-attention-mask'],
            {'pipeline_model_parallel_size': 4},
            r'--pipeline-model-parallel-size \(4\) > 2',
        ),
    ],
)
def test_refused_before_work(argv, overrides, message):
    with pytest.raises(ValueError, match=message) as info:
        _validate(argv, **overrides)
    assert '\n' not in str(info.value)


def test_reset_attention_mask_under_cp_only_without_attention():
    """The Mamba layers take the document ids under CP; attention layers' per-document mask
    cannot be split over the sequence, so a pattern with '*' is still refused."""
    from megatron.training.validation.context_parallel_checks import (
        validate_context_parallel_args,
    )

    def check(pattern):
        args = get_args_parser().parse_args(
            MAMBA + ['--reset-attention-mask', '--hybrid-override-pattern', pattern]
        )
        args.context_parallel_size, args.seq_length = 2, 32
        validate_context_parallel_args(args)
        validate_mamba_args(args)

    check('M-M-')
    with pytest.raises(ValueError, match='--reset-attention-mask: its per-document attention'):
        check('M*M-')
