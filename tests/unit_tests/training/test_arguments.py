"""parse_args / validate_args: defaults, derived args and one-line errors naming flags and
numbers."""

import pytest
import torch

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
]


def _args(extra=(), world_size=1, rank=0):
    args = parse_args(args_list=BASE + list(extra))
    args.world_size = world_size
    args.rank = rank
    return args


def _validate(extra=(), world_size=1, defaults={}):
    return validate_args(_args(extra, world_size), defaults)


def test_derived_values(capsys):
    args = _validate(
        ['--tensor-model-parallel-size', '2', '--pipeline-model-parallel-size', '2'], world_size=8
    )
    assert args.data_parallel_size == 2
    assert args.global_batch_size == 2 * 2  # micro batch x data parallel
    assert args.ffn_hidden_size == 4 * 64
    assert args.kv_channels == 64 // 4
    assert args.params_dtype == torch.float
    assert args.encoder_seq_length == 32
    assert args.start_weight_decay == args.end_weight_decay == 0.01
    assert args.consumed_train_samples == 0 and args.consumed_valid_samples == 0
    out = capsys.readouterr().out
    assert (
        'using world size: 8, data-parallel size: 2, context-parallel size: 1 '
        'tensor-model-parallel size: 2, pipeline-model-parallel size: 2 '
    ) in out
    assert '------------------------ arguments ------------------------' in out
    assert '  data_parallel_size .............................. 2' in out


def test_bf16_sets_dtype_and_fp32_grad_accumulation():
    args = _validate(['--bf16'])
    assert args.params_dtype == torch.bfloat16
    assert args.accumulate_allreduce_grads_in_fp32
    assert _validate(['--fp16']).params_dtype == torch.half


def test_swiglu_ffn_size():
    assert _validate(['--swiglu']).ffn_hidden_size == int((4 * 64 * 2 / 3) / 64) * 64


def test_script_defaults_fill_only_none_args():
    args = _validate(defaults={'tokenizer_type': 'GPT2BPETokenizer'})
    assert args.tokenizer_type == 'GPT2BPETokenizer'
    args = _validate(
        ['--tokenizer-type', 'NullTokenizer', '--vocab-size', '100'],
        defaults={'tokenizer_type': 'GPT2BPETokenizer'},
    )
    assert args.tokenizer_type == 'NullTokenizer'


@pytest.mark.skipif(torch.cuda.is_available(), reason='the gloo fallback applies without CUDA')
def test_backend_falls_back_to_gloo_without_cuda(capsys):
    args = _validate()
    assert args.distributed_backend == 'gloo'
    assert 'nccl -> gloo' in capsys.readouterr().out


def test_split_default_with_data_path():
    args = _validate(['--data-path', 'some_prefix'])
    assert args.split == '969, 30, 1'
    assert args.dataloader_type == 'single'


def test_virtual_pipeline_size_derived():
    args = _validate(
        ['--pipeline-model-parallel-size', '2', '--num-layers-per-virtual-pipeline-stage', '1'],
        world_size=2,
    )
    assert args.virtual_pipeline_model_parallel_size == 2


@pytest.mark.parametrize(
    'extra, world_size, pattern',
    [
        (
            ['--tensor-model-parallel-size', '2', '--pipeline-model-parallel-size', '2'],
            6,
            r'world size \(6\) is not divisible by --tensor-model-parallel-size \(2\) x '
            r'--pipeline-model-parallel-size \(2\) x --context-parallel-size \(1\) = 4',
        ),
        (
            ['--global-batch-size', '6'],
            2,
            r'--global-batch-size \(6\) is not divisible by --micro-batch-size \(2\) x data '
            r'parallel size \(2\) = 4',
        ),
        (
            ['--max-position-embeddings', '16'],
            1,
            r'--max-position-embeddings \(16\) must be >= --seq-length \(32\)',
        ),
        (['--fp16', '--bf16'], 1, r'--fp16 and --bf16 are mutually exclusive'),
        (
            ['--train-samples', '100'],
            1,
            r'--train-iters \(10\) and --train-samples \(100\) are mutually exclusive',
        ),
        (
            ['--rampup-batch-size', '2', '2', '100'],
            1,
            r'--rampup-batch-size is only supported with --train-samples',
        ),
        (
            ['--lr-warmup-fraction', '0.1', '--lr-warmup-iters', '5'],
            1,
            r'--lr-warmup-fraction \(0.1\) and --lr-warmup-iters \(5\) are mutually exclusive',
        ),
        (['--min-lr', '0.1'], 1, r'--min-lr \(0.1\) must be <= --lr \(0.001\)'),
        (['--save', '/tmp/x'], 1, r'--save requires --save-interval'),
        (
            ['--num-attention-heads', '3'],
            1,
            r'--hidden-size \(64\) is not divisible by --num-attention-heads \(3\)',
        ),
        (
            ['--tensor-model-parallel-size', '8'],
            8,
            r'--num-attention-heads \(4\) is not divisible by --tensor-model-parallel-size \(8\)',
        ),
        (
            ['--pipeline-model-parallel-size', '3'],
            3,
            r'--num-layers \(4\) is not divisible by --pipeline-model-parallel-size \(3\)',
        ),
        (
            ['--num-layers-per-virtual-pipeline-stage', '1'],
            1,
            r'--num-layers-per-virtual-pipeline-stage needs --pipeline-model-parallel-size > 1, '
            r'got 1',
        ),
        (
            ['--pipeline-model-parallel-size', '2', '--num-layers-per-virtual-pipeline-stage', '3'],
            2,
            r'is not divisible by --num-layers-per-virtual-pipeline-stage \(3\)',
        ),
        (['--fp16-lm-cross-entropy'], 1, r'--fp16-lm-cross-entropy requires --fp16'),
        (
            ['--weight-decay-incr-style', 'linear'],
            1,
            r'--weight-decay-incr-style linear requires both --start-weight-decay and '
            r'--end-weight-decay',
        ),
        (
            ['--recompute-granularity', 'full'],
            1,
            r'--recompute-granularity full requires --recompute-method',
        ),
        (
            ['--overlap-param-gather'],
            1,
            r'--overlap-param-gather requires --use-distributed-optimizer',
        ),
        (['--micro-batch-size', '0'], 1, r'--micro-batch-size must be a positive integer, got 0'),
        (['--checkpoint-activations'], 1, r'--checkpoint-activations is no longer supported'),
    ],
)
def test_validate_args_errors(extra, world_size, pattern):
    with pytest.raises(ValueError, match=pattern) as info:
        _validate(extra, world_size=world_size)
    assert '\n' not in str(info.value)


def test_missing_required_sizes():
    args = parse_args(args_list=['--micro-batch-size', '1', '--train-iters', '1'])
    args.world_size, args.rank = 1, 0
    with pytest.raises(ValueError, match='--num-layers is required'):
        validate_args(args)


def test_sequence_parallel_off_with_tp1(capsys):
    args = _validate(['--sequence-parallel'])
    assert args.sequence_parallel is False
    assert '--sequence-parallel has no effect' in capsys.readouterr().out


def test_core_transformer_config_from_args():
    tc = pytest.importorskip('megatron.core.transformer.transformer_config')
    args = _validate(['--hidden-dropout', '0.0', '--norm-epsilon', '1e-6', '--apply-layernorm-1p'])
    config = core_transformer_config_from_args(args)
    assert isinstance(config, tc.TransformerConfig)
    assert config.num_layers == 4 and config.hidden_size == 64 and config.num_attention_heads == 4
    assert config.ffn_hidden_size == 256
    assert config.hidden_dropout == 0.0
    assert config.layernorm_epsilon == 1e-6
    assert config.layernorm_zero_centered_gamma is True
    assert config.params_dtype == torch.float
