"""--onnx-safe and --straggler-ctrlr-port: accepted (no longer in the refusal table) and wired
as Megatron r0.8 wires them."""

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
