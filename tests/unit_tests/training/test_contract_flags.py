"""--onnx-safe and --straggler-ctrlr-port: accepted (no longer in the refusal table) and wired
as Megatron r0.8 wires them."""

import torch.nn.functional as F

from megatron.training.arguments import core_transformer_config_from_args, parse_args, validate_args
from megatron.training.arguments_unsupported import UNSUPPORTED_FLAGS

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
