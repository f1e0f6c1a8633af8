"""The argparse parser of Megatron's flags: one `_add_*_args(parser)` function per concern
(`arguments_model.py`, `arguments_run.py`, `arguments_unsupported.py`), assembled in Megatron's
order. `arguments.py` re-exports `get_args_parser`; `argument_validation.py` reads the flags'
defaults from here (without importing `arguments.py`, which imports it).
"""

import argparse
import sys

from megatron.training.cli.arguments_fsdp import add_fsdp_args
from megatron.training.cli.arguments_mamba import add_mamba_args
from megatron.training.cli.arguments_mla import _add_mla_args
from megatron.training.cli.arguments_model import (
    _add_experimental_args,
    _add_inference_args,
    _add_initialization_args,
    _add_learning_rate_args,
    _add_mixed_precision_args,
    _add_moe_args,
    _add_network_size_args,
    _add_regularization_args,
    _add_training_args,
    _add_transformer_engine_args,
)
from megatron.training.cli.arguments_muon import _add_muon_args
from megatron.training.cli.arguments_resilience import add_resilience_args
from megatron.training.cli.arguments_run import (
    _add_autoresume_args,
    _add_checkpointing_args,
    _add_data_args,
    _add_distributed_args,
    _add_logging_args,
    _add_straggler_detector_args,
    _add_tokenizer_args,
    _add_validation_args,
)
from megatron.training.cli.arguments_sft_fim import add_sft_and_fim_args
from megatron.training.cli.arguments_unsupported import (
    add_biencoder_args,
    add_one_logger_args,
    add_retro_args,
)
from megatron.training.cli.arguments_vision import add_vision_args


class _OneLineErrorParser(argparse.ArgumentParser):
    """argparse, but a parse error prints one line (not the full usage of every flag), once for
    the job (global rank 0), and exits with argparse's code 2."""

    def error(self, message):
        from megatron.training.run_control.errors import global_rank

        if global_rank() == 0:
            sys.stderr.write(f'{self.prog}: error: {message}\n')
            sys.stderr.flush()
        sys.exit(2)


def get_args_parser(extra_args_provider=None):
    """The full argparse parser (all `_add_*_args` groups plus the script's extra flags)."""
    parser = _OneLineErrorParser(description='Megatron-LM Arguments', allow_abbrev=False)
    parser = _add_network_size_args(parser)
    parser = _add_regularization_args(parser)
    parser = _add_training_args(parser)
    parser = _add_initialization_args(parser)
    parser = _add_learning_rate_args(parser)
    parser = _add_checkpointing_args(parser)
    parser = _add_mixed_precision_args(parser)
    parser = _add_distributed_args(parser)
    parser = _add_validation_args(parser)
    parser = _add_data_args(parser)
    parser = _add_tokenizer_args(parser)
    parser = add_sft_and_fim_args(parser)
    parser = add_fsdp_args(parser)
    parser = _add_autoresume_args(parser)
    parser = add_biencoder_args(parser)
    parser = add_vision_args(parser)
    parser = _add_moe_args(parser)
    parser = _add_mla_args(parser)
    parser = _add_muon_args(parser)
    parser = _add_logging_args(parser)
    parser = _add_straggler_detector_args(parser)
    parser = add_resilience_args(parser)
    parser = _add_inference_args(parser)
    parser = _add_transformer_engine_args(parser)
    parser = add_retro_args(parser)
    parser = _add_experimental_args(parser)
    parser = add_mamba_args(parser)
    parser = add_one_logger_args(parser)
    if extra_args_provider is not None:
        parser = extra_args_provider(parser)
    return parser
