"""Megatron core_r0.8.0 flags: unsupported features stop start-up with one line; the flags of
features this package has reach the code that uses them."""

import argparse

import pytest
import torch

from megatron.training.arguments import (
    core_transformer_config_from_args,
    get_args_parser,
    parse_args,
    validate_args,
)
from megatron.training.cli.arguments_unsupported import UNSUPPORTED_FLAGS

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


def _validate(extra=(), world_size=1):
    args = parse_args(args_list=BASE + list(extra))
    args.world_size = world_size
    args.rank = 0
    return validate_args(args, {})


def _non_default_command_line(action):
    """Strings that set `action` to a value other than its default."""
    flag = action.option_strings[0]
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        return [flag]
    if action.choices is not None:
        return [flag, next(str(c) for c in action.choices if c != action.default)]
    if isinstance(action.default, list):
        return [flag, '3', '5']
    if action.type is int:
        value = 7 if action.default is None else action.default + 3
    elif action.type is float:
        value = 0.5 if action.default is None else action.default + 0.25
    else:
        value = 'some/path'
    return [flag, str(value)]


def _actions_by_flag():
    return {opt: a for a in get_args_parser()._actions for opt in a.option_strings}


def test_table_lists_only_real_flags_with_reasons():
    actions = _actions_by_flag()
    for flag, reason in UNSUPPORTED_FLAGS.items():
        assert flag in actions, flag
        assert reason and '\n' not in reason


@pytest.mark.parametrize('flag', sorted(UNSUPPORTED_FLAGS))
def test_unsupported_flag_with_non_default_value_stops_start_up(flag, capsys):
    extra = _non_default_command_line(_actions_by_flag()[flag])
    with pytest.raises(ValueError) as err:
        _validate(extra)
    message = str(err.value)
    assert '\n' not in message
    assert message.startswith(f'{flag} (got ') and 'is not supported by this package' in message
    # Refused before any other work: not even the world-size line is printed.
    assert 'using world size' not in capsys.readouterr().out


def test_unsupported_flags_at_default_values_are_accepted():
    # Spelling out a default is not a request for the feature.
    args = _validate(
        [
            '--moe-router-topk',
            '2',
            '--img-h',
            '224',
            '--fp8-margin',
            '0',
            '--retro-encoder-layers',
            '2',
            '--no-one-logger',
        ]
    )
    assert args.enable_one_logger is False


def test_use_cpu_initialization_reaches_the_model_config():
    assert _validate().use_cpu_initialization is None
    config = core_transformer_config_from_args(_validate(['--use-cpu-initialization']))
    assert config.use_cpu_initialization is True


def test_fp8_and_fully_parallel_save_use_megatron_attribute_names(capsys):
    args = _validate(['--ckpt-fully-parallel-save', '--async-save'])
    assert args.fp8 is None and args.fp8_wgrad is True
    assert args.ckpt_fully_parallel_save is True and args.ckpt_fully_parallel_save_deprecated
    assert args.async_save is True
    out = capsys.readouterr().out
    assert '--ckpt-fully-parallel-save flag is deprecated and has no effect' in out
    assert _validate(['--no-ckpt-fully-parallel-save']).ckpt_fully_parallel_save is False
    assert _validate().async_save is None


def test_defer_embedding_wgrad_compute_validated_as_megatron_does():
    # Without pipeline parallelism there is no flush to defer to: Megatron turns it off.
    assert _validate(['--defer-embedding-wgrad-compute']).defer_embedding_wgrad_compute is False
    pp = ['--pipeline-model-parallel-size', '2', '--defer-embedding-wgrad-compute']
    with pytest.raises(ValueError, match='gradient accumulation fusion is not used'):
        _validate(pp + ['--no-gradient-accumulation-fusion'], world_size=2)
    with pytest.raises(ValueError, match=r'--wgrad-deferral-limit \(-1\) should be greater'):
        _validate(pp + ['--wgrad-deferral-limit', '-1'], world_size=2)
    with pytest.raises(ValueError, match='--defer-embedding-wgrad-compute is not supported'):
        _validate(pp, world_size=2)


def test_other_wired_flags_validate():
    args = _validate(
        [
            '--no-data-sharding',
            '--empty-unused-memory-level',
            '2',
            '--check-weight-hash-across-dp-replicas-interval',
            '5',
            '--log-straggler',
            '--straggler-minmax-count',
            '4',
            '--disable-straggler-on-startup',
        ]
    )
    assert args.data_sharding is False and args.empty_unused_memory_level == 2
    assert args.check_weight_hash_across_dp_replicas_interval == 5
    with pytest.raises(ValueError, match='--check-weight-hash-across-dp-replicas-interval'):
        _validate(['--check-weight-hash-across-dp-replicas-interval', '0'])
    with pytest.raises(SystemExit):  # argparse choices, as in Megatron
        parse_args(args_list=BASE + ['--empty-unused-memory-level', '3'])


def test_empty_unused_memory_is_a_no_op_on_cpu():
    from megatron.training.utils import empty_unused_memory

    args = argparse.Namespace(empty_unused_memory_level=2)
    empty_unused_memory(args, level=1)  # must not touch CUDA on a CPU host
    if not torch.cuda.is_available():
        assert not torch.cuda.is_initialized()
