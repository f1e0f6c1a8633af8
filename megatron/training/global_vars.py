"""The training layer's process-wide state: args, tokenizer, timers, TensorBoard writer, signal
handler.

Only the training layer reads these (megatron/core takes configs). `set_global_variables(args)`
fills them once per run; `destroy_global_vars()` clears them so several runs can share one process
(tests).
"""

import os

from megatron.core import num_microbatches_calculator
from megatron.core.num_microbatches_calculator import (  # noqa: F401  (re-exported, as Megatron does)
    get_current_global_batch_size,
    get_num_microbatches,
    init_num_microbatches_calculator,
    update_num_microbatches,
)
from megatron.core.timers import Timers

_GLOBAL_ARGS = None
_GLOBAL_TOKENIZER = None
_GLOBAL_TENSORBOARD_WRITER = None
_GLOBAL_WANDB_WRITER = None
_GLOBAL_ONE_LOGGER = None
_GLOBAL_ADLR_AUTORESUME = None
_GLOBAL_TIMERS = None
_GLOBAL_SIGNAL_HANDLER = None


def get_args():
    """The parsed and validated args."""
    _ensure_var_is_initialized(_GLOBAL_ARGS, 'args')
    return _GLOBAL_ARGS


def get_tokenizer():
    """The tokenizer built from the args."""
    _ensure_var_is_initialized(_GLOBAL_TOKENIZER, 'tokenizer')
    return _GLOBAL_TOKENIZER


def get_tensorboard_writer():
    """The TensorBoard SummaryWriter (last rank only, with --tensorboard-dir) or None."""
    return _GLOBAL_TENSORBOARD_WRITER


def get_wandb_writer():
    """The `wandb` module after `wandb.init` (last rank, with --wandb-project) or None."""
    return _GLOBAL_WANDB_WRITER


def set_wandb_writer(writer):
    """Set the W&B writer (`scalar_writers.build_wandb_writer`); None for none."""
    global _GLOBAL_WANDB_WRITER
    _ensure_var_is_not_initialized(_GLOBAL_WANDB_WRITER, 'wandb writer')
    _GLOBAL_WANDB_WRITER = writer


def get_one_logger():
    """OneLogger is not supported here: always None."""
    return _GLOBAL_ONE_LOGGER


def get_adlr_autoresume():
    """ADLR autoresume is not supported here: always None."""
    return _GLOBAL_ADLR_AUTORESUME


def get_timers():
    """The `Timers` object."""
    _ensure_var_is_initialized(_GLOBAL_TIMERS, 'timers')
    return _GLOBAL_TIMERS


def get_signal_handler():
    """The distributed SIGTERM handler (with --exit-signal-handler)."""
    _ensure_var_is_initialized(_GLOBAL_SIGNAL_HANDLER, 'signal handler')
    return _GLOBAL_SIGNAL_HANDLER


def _set_signal_handler():
    global _GLOBAL_SIGNAL_HANDLER
    _ensure_var_is_not_initialized(_GLOBAL_SIGNAL_HANDLER, 'signal handler')
    from megatron.training import dist_signal_handler  # H7's module; imported only when asked for

    _GLOBAL_SIGNAL_HANDLER = dist_signal_handler.DistributedSignalHandler().__enter__()


def set_global_variables(args, build_tokenizer=True):
    """Set args, the micro-batch calculator, tokenizer, TensorBoard writer, timers, signal
    handler."""
    assert args is not None
    _ensure_var_is_not_initialized(_GLOBAL_ARGS, 'args')
    set_args(args)

    num_microbatches_calculator.reconfigure_num_microbatches_calculator(
        rank=args.rank,
        rampup_batch_size=args.rampup_batch_size,
        global_batch_size=args.global_batch_size,
        micro_batch_size=args.micro_batch_size,
        data_parallel_size=args.data_parallel_size,
    )
    if build_tokenizer and getattr(args, 'tokenizer_type', None) is not None:
        _ = _build_tokenizer(args)
    _set_tensorboard_writer(args)
    _set_timers(args)
    if args.exit_signal_handler:
        _set_signal_handler()


def set_args(args):
    """Set the global args."""
    global _GLOBAL_ARGS
    _GLOBAL_ARGS = args


def _build_tokenizer(args):
    """Build the tokenizer (this also sets args.padded_vocab_size)."""
    global _GLOBAL_TOKENIZER
    _ensure_var_is_not_initialized(_GLOBAL_TOKENIZER, 'tokenizer')
    from megatron.training.tokenizer import build_tokenizer

    _GLOBAL_TOKENIZER = build_tokenizer(args)
    return _GLOBAL_TOKENIZER


def rebuild_tokenizer(args):
    """Drop and rebuild the tokenizer."""
    global _GLOBAL_TOKENIZER
    _GLOBAL_TOKENIZER = None
    return _build_tokenizer(args)


def _set_tensorboard_writer(args):
    """A SummaryWriter on the last rank, which prints the training log too."""
    global _GLOBAL_TENSORBOARD_WRITER
    _ensure_var_is_not_initialized(_GLOBAL_TENSORBOARD_WRITER, 'tensorboard writer')
    if getattr(args, 'tensorboard_dir', None) and args.rank == (args.world_size - 1):
        from torch.utils.tensorboard import SummaryWriter

        os.makedirs(args.tensorboard_dir, exist_ok=True)
        print('> setting tensorboard ...', flush=True)
        _GLOBAL_TENSORBOARD_WRITER = SummaryWriter(
            log_dir=args.tensorboard_dir, max_queue=args.tensorboard_queue_size
        )


def _set_timers(args):
    global _GLOBAL_TIMERS
    _ensure_var_is_not_initialized(_GLOBAL_TIMERS, 'timers')
    _GLOBAL_TIMERS = Timers(args.timing_log_level, args.timing_log_option)


def destroy_global_vars():
    """Reset every global (closing the TensorBoard writer, the W&B run and the signal
    handler)."""
    global _GLOBAL_ARGS, _GLOBAL_TOKENIZER, _GLOBAL_TENSORBOARD_WRITER, _GLOBAL_WANDB_WRITER
    global _GLOBAL_ONE_LOGGER, _GLOBAL_ADLR_AUTORESUME, _GLOBAL_TIMERS, _GLOBAL_SIGNAL_HANDLER
    if _GLOBAL_TENSORBOARD_WRITER is not None:
        _GLOBAL_TENSORBOARD_WRITER.close()
    if _GLOBAL_SIGNAL_HANDLER is not None:
        _GLOBAL_SIGNAL_HANDLER.__exit__(None, None, None)
    if _GLOBAL_WANDB_WRITER is not None:
        _GLOBAL_WANDB_WRITER.finish()
    _GLOBAL_ARGS = None
    _GLOBAL_TOKENIZER = None
    _GLOBAL_TENSORBOARD_WRITER = None
    _GLOBAL_WANDB_WRITER = None
    _GLOBAL_ONE_LOGGER = None
    _GLOBAL_ADLR_AUTORESUME = None
    _GLOBAL_TIMERS = None
    _GLOBAL_SIGNAL_HANDLER = None
    num_microbatches_calculator.destroy_num_microbatches_calculator()


def _ensure_var_is_initialized(var, name):
    if var is None:
        raise RuntimeError(f'{name} is not initialized: call initialize_megatron() first')


def _ensure_var_is_not_initialized(var, name):
    assert var is None, '{} is already initialized.'.format(name)
