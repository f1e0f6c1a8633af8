"""--onnx-safe, --straggler-ctrlr-port, --standalone-embedding-stage and --test-mode: accepted
(no longer in the refusal table) and wired as Megatron r0.8 wires them."""

import pytest
import torch.nn.functional as F

from megatron.training.arguments import core_transformer_config_from_args, parse_args, validate_args
from megatron.training.cli.arguments_unsupported import UNSUPPORTED_FLAGS

BASE = [
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
    '2',
    '--train-iters',
    '4',
    '--lr',
    '1e-3',
]


def _validate(extra=()):
    args = parse_args(args_list=BASE + list(extra))
    args.world_size, args.rank = 1, 0
    return validate_args(args, {})


def test_onnx_safe_is_accepted_and_leaves_the_model_as_megatron_core_does():
    assert '--onnx-safe' not in UNSUPPORTED_FLAGS
    args = _validate(['--onnx-safe', 'True'])
    assert args.onnx_safe is True
    # Megatron's core models never read it (only its legacy models swapped in erf-GeLU); the
    # export itself goes through the mapping functions' `symbolic` methods.
    assert core_transformer_config_from_args(args).activation_func is F.gelu


def _get(port: int) -> str:
    import socket

    with socket.create_connection(('127.0.0.1', port), timeout=5) as conn:
        conn.sendall(b'GET / HTTP/1.0\r\n\r\n')
        conn.settimeout(5)
        reply = b''
        while chunk := conn.recv(1024):
            reply += chunk
    return reply.decode()


def test_straggler_ctrlr_port_is_accepted_and_reaches_the_detector(monkeypatch):
    from megatron.core.utils import StragglerDetector
    from megatron.training import utils as training_utils

    assert '--straggler-ctrlr-port' not in UNSUPPORTED_FLAGS
    args = _validate(
        ['--log-straggler', '--straggler-ctrlr-port', '0', '--disable-straggler-on-startup']
    )
    assert args.straggler_ctrlr_port == 0
    monkeypatch.setattr(training_utils.torch.distributed, 'get_world_size', lambda: 1)
    monkeypatch.setattr(training_utils.torch.distributed, 'get_rank', lambda: 0)
    detector = StragglerDetector()
    try:
        training_utils.configure_straggler_detector(args)
        assert not detector.enabled and detector.controller.running
        host, port = detector.controller._sock.getsockname()
        assert host == '127.0.0.1' and port == detector.controller.port > 0
        assert 'Will turn StragglerDetector ON at next logging interval' in _get(port)
        assert not detector.enabled  # the flip waits for the next report
        detector.report(0.0, 1)
        assert detector.enabled
        assert 'Will turn StragglerDetector OFF' in _get(port)
        detector.report(1.0, 1)  # reports this interval, then switches off
        assert not detector.enabled
        detector.report(1.0, 1)  # nothing requested: stays off
        assert not detector.enabled
    finally:
        detector.stop_controller()
        detector.configure(1, 0, port=None)  # back to the idle default
    assert detector.controller is None


def _pp_validate(extra):
    args = parse_args(args_list=BASE + list(extra))
    args.world_size, args.rank = args.pipeline_model_parallel_size, 0
    return validate_args(args, {})


def test_standalone_embedding_stage_gives_stage_zero_no_layer():
    assert '--standalone-embedding-stage' not in UNSUPPORTED_FLAGS
    args = _pp_validate(['--pipeline-model-parallel-size', '3', '--standalone-embedding-stage'])
    # r0.8's derived count of the stages holding transformer layers.
    assert args.transformer_pipeline_model_parallel_size == 2
    config = core_transformer_config_from_args(args)
    assert (config.first_pipeline_num_layers, config.last_pipeline_num_layers) == (0, None)
    even = _pp_validate(['--pipeline-model-parallel-size', '2'])
    assert even.transformer_pipeline_model_parallel_size == 2
    assert core_transformer_config_from_args(even).first_pipeline_num_layers is None


@pytest.mark.parametrize(
    'extra, message',
    [
        (
            ['--standalone-embedding-stage'],
            r'--standalone-embedding-stage needs --pipeline-model-parallel-size > 1 \(got 1\)',
        ),
        (
            ['--pipeline-model-parallel-size', '4', '--standalone-embedding-stage'],
            r'--num-layers \(2\) minus the layers fixed by --standalone-embedding-stage \(0\) '
            'must split evenly over the other 3 pipeline stages',
        ),
        (
            [
                '--pipeline-model-parallel-size',
                '2',
                '--standalone-embedding-stage',
                '--decoder-first-pipeline-num-layers',
                '1',
            ],
            'contradicts --decoder-first-pipeline-num-layers 1',
        ),
        (
            [
                '--pipeline-model-parallel-size',
                '2',
                '--standalone-embedding-stage',
                '--num-layers-per-virtual-pipeline-stage',
                '1',
            ],
            'not supported with the interleaved schedule',
        ),
        (
            ['--pipeline-model-parallel-size', '2', '--decoder-last-pipeline-num-layers', '3'],
            'must split evenly over the other 1 pipeline stages',
        ),
    ],
)
def test_impossible_pipeline_splits_fail_before_work(extra, message):
    with pytest.raises(ValueError, match=message):
        _pp_validate(extra)


def test_uneven_last_stage_is_accepted():
    args = _pp_validate(
        ['--num-layers', '4', '--pipeline-model-parallel-size', '3']
        + ['--decoder-last-pipeline-num-layers', '2']
    )
    assert core_transformer_config_from_args(args).last_pipeline_num_layers == 2


def test_test_mode_reaches_the_config():
    assert '--test-mode' not in UNSUPPORTED_FLAGS
    assert core_transformer_config_from_args(_validate(['--test-mode'])).test_mode is True
    assert core_transformer_config_from_args(_validate()).test_mode is False
