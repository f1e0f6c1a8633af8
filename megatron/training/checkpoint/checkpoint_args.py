"""What a checkpoint records about the run that wrote it, and the checks against this run.

- `CHECKPOINT_VERSION` (3.0, as Megatron) is written into every checkpoint; the version of the
  checkpoint being loaded is recorded (`record_checkpoint_version`, `get_checkpoint_version`).
- `args_for_checkpoint`: the args saved with a checkpoint (plain values only, so the checkpoint
  loads with `torch.load(weights_only=True)`).
- `check_checkpoint_args` / `restore_training_args`: the model-defining args must match the
  run's (every difference named with both values); the consumed-sample counters are restored.
  A torch-format checkpoint must also match the run's (TP, PP); a distributed one reshards.

Used by both checkpoint formats (checkpointing.py, checkpointing_dist.py), which re-export the
names.
"""

import argparse
from typing import Any, Dict, Optional

import torch

from megatron.core.enums import ModelType
from megatron.core.num_microbatches_calculator import update_num_microbatches
from megatron.training.global_vars import get_args


def print_rank_0(message: str) -> None:
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        print(message, flush=True)


#: Version written into every checkpoint, as in Megatron's megatron/training/checkpointing.py:
#: 3.0 means linear_qkv rows are grouped per query group [q heads of the group, k, v].
CHECKPOINT_VERSION = 3.0

_CHECKPOINT_VERSION = None


def set_checkpoint_version(value: float) -> None:
    """Record the version of the checkpoint being loaded (checked once per process)."""
    global _CHECKPOINT_VERSION
    if _CHECKPOINT_VERSION is not None:
        assert _CHECKPOINT_VERSION == value, "checkpoint versions do not match"
    _CHECKPOINT_VERSION = value


def get_checkpoint_version() -> Optional[float]:
    """Version of the last loaded checkpoint (None before any load)."""
    return _CHECKPOINT_VERSION


def record_checkpoint_version(state_dict: Dict[str, Any], checkpoint_name: str) -> None:
    """Record the loaded checkpoint's version (one process may load several: tests, tools)."""
    global _CHECKPOINT_VERSION
    _CHECKPOINT_VERSION = None
    set_checkpoint_version(state_dict.get('checkpoint_version', 0))
    if get_checkpoint_version() < 2.0:
        raise ValueError(
            f'{checkpoint_name} has checkpoint_version {get_checkpoint_version()}; versions before '
            f'2.0 (old QKV layout, legacy models) are not supported by megatron.core models'
        )


_PLAIN_SCALARS = (type(None), bool, int, float, str, torch.dtype, ModelType)


def _is_plain(value: Any) -> bool:
    if isinstance(value, _PLAIN_SCALARS):
        return True
    if isinstance(value, (list, tuple)):
        return all(_is_plain(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, (str, int)) and _is_plain(v) for k, v in value.items())
    return False


def args_for_checkpoint(args: argparse.Namespace) -> argparse.Namespace:
    """A copy of args holding only plain values, so the checkpoint loads with weights_only=True.

    Values of other types (callables, enums, tokenizer objects...) are derived at start-up and are
    dropped; their names are printed once.
    """
    plain, dropped = {}, []
    for name, value in vars(args).items():
        if _is_plain(value):
            plain[name] = value
        else:
            dropped.append(name)
    if dropped and not getattr(args_for_checkpoint, 'warned', False):
        print_rank_0(f'checkpoint args: not saving non-plain values of {sorted(dropped)}')
        args_for_checkpoint.warned = True
    return argparse.Namespace(**plain)


def layout_mismatch_message(checkpoint_args, checkpoint_name: str) -> Optional[str]:
    """Megatron-worded differences of the parallel layout, or None if it matches."""
    args = get_args()
    lines = []
    for name in (
        'tensor_model_parallel_size',
        'pipeline_model_parallel_size',
        'pipeline_model_parallel_split_rank',  # T5: which stages hold the encoder
    ):
        ckpt_value = getattr(checkpoint_args, name, None)
        if ckpt_value is not None and ckpt_value != getattr(args, name, None):
            lines.append(
                f'{name} value from checkpoint ({ckpt_value}) is not equal to the input argument '
                f'value ({getattr(args, name)}).'
            )
    if not lines:
        return None
    return f'checkpoint {checkpoint_name} does not match this run:\n  ' + '\n  '.join(lines)


def check_checkpoint_args(
    checkpoint_args, checkpoint_name: str = 'checkpoint', resharding: bool = False
) -> None:
    """Compare the model-defining args of a checkpoint with the run's.

    Raises:
        ValueError: listing every difference as
            "<arg> value from checkpoint (<a>) is not equal to the input argument value (<b>)."
    """
    args = get_args()
    lines = []

    def _compare(arg_name, old_arg_name=None, default=None):
        ckpt_arg_name = old_arg_name if old_arg_name is not None else arg_name
        if default is not None:
            checkpoint_value = getattr(checkpoint_args, ckpt_arg_name, default)
        else:
            checkpoint_value = getattr(checkpoint_args, ckpt_arg_name)
        args_value = getattr(args, arg_name)
        if checkpoint_value != args_value:
            hint = ''
            if arg_name == 'tokenizer_type':
                hint = (
                    f' The checkpoint was made with {checkpoint_value}: start with '
                    f'--tokenizer-type {checkpoint_value} and its files, or pass --finetune to '
                    f'load only its weights with your tokenizer.'
                )
            lines.append(
                f'{arg_name} value from checkpoint ({checkpoint_value}) is not equal to the input '
                f'argument value ({args_value}).{hint}'
            )

    _compare('num_layers')
    _compare('hidden_size')
    _compare('num_attention_heads')
    _compare('add_position_embedding', default=True)
    if args.vocab_file:
        _compare('max_position_embeddings')
        _compare('make_vocab_size_divisible_by')
        if not resharding:  # the padding follows the TP size; a dist checkpoint adapts it
            _compare('padded_vocab_size')
        _compare('tokenizer_type')
    if args.data_parallel_random_init:
        _compare('data_parallel_random_init')
    if resharding:
        pass  # a distributed checkpoint loads at any TP / PP
    elif get_checkpoint_version() < 3.0:
        _compare('tensor_model_parallel_size', old_arg_name='model_parallel_size')
    else:
        _compare('tensor_model_parallel_size')
        _compare('pipeline_model_parallel_size')
    if lines:
        raise ValueError(f'{checkpoint_name} does not match this run:\n  ' + '\n  '.join(lines))


def restore_training_args(args, state_dict, checkpoint_name: str, dist_format: bool = False):
    """Check the checkpoint's model args against the run and restore the consumed-sample
    counters. The torch format must match the run's (TP, PP); a distributed checkpoint reshards,
    so its TP, PP and padded vocabulary may differ."""
    assert args.consumed_train_samples == 0
    assert args.consumed_valid_samples == 0
    if 'args' not in state_dict:
        print_rank_0('could not find arguments in the checkpoint ...')
        return
    checkpoint_args = state_dict['args']
    if not dist_format:
        layout_message = layout_mismatch_message(checkpoint_args, checkpoint_name)
        if layout_message is not None:
            raise ValueError(layout_message)
    if args.finetune:
        return
    check_checkpoint_args(checkpoint_args, checkpoint_name, resharding=dist_format)
    args.consumed_train_samples = getattr(checkpoint_args, 'consumed_train_samples', 0)
    update_num_microbatches(consumed_samples=args.consumed_train_samples)
    args.consumed_valid_samples = getattr(checkpoint_args, 'consumed_valid_samples', 0)


# Names this module had in checkpointing.py.
_args_for_checkpoint = args_for_checkpoint
_layout_mismatch_message = layout_mismatch_message
