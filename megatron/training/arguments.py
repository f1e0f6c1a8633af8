"""Megatron's command-line arguments: the parser, the cross-flag checks and the args -> config
bridge.

`parse_args()` builds the argparse parser from one `_add_*_args(parser)` function per concern
(`arguments_model.py`, `arguments_run.py`), with Megatron core_v0.8.0 flag names and defaults.
`validate_args(args, defaults)` (in `argument_validation.py`, re-exported here) checks every
cross-flag rule before any work starts (one-line `ValueError`s naming the flags and the numbers)
and derives the values the rest of the training layer reads (`data_parallel_size`,
`params_dtype`, ...).
`core_transformer_config_from_args(args)` is the one place where args become a `TransformerConfig`.
"""

import dataclasses
import os

import torch
import torch.nn.functional as F

from megatron.core.transformer.utils import openai_gelu, squared_relu
from megatron.training.cli.arguments_parser import (  # noqa: F401 (re-exported)
    _OneLineErrorParser,
    get_args_parser,
)
from megatron.training.validation.argument_validation import validate_args  # noqa: F401 (re-exported)


def parse_args(extra_args_provider=None, ignore_unknown_args=False, args_list=None):
    """Parse Megatron's command-line arguments.

    Args:
        extra_args_provider: optional callable(parser) -> parser adding script-specific flags.
        ignore_unknown_args: if True, unknown flags are dropped instead of failing.
        args_list: argument strings to parse instead of `sys.argv[1:]` (tests, notebooks).

    Returns:
        argparse.Namespace with `rank` and `world_size` filled from torchrun's environment (or from
        the already-initialized default process group).
    """
    parser = get_args_parser(extra_args_provider)
    if ignore_unknown_args:
        args, _ = parser.parse_known_args(args_list)
    else:
        args = parser.parse_args(args_list)

    if torch.distributed.is_available() and torch.distributed.is_initialized():
        args.rank = torch.distributed.get_rank()
        args.world_size = torch.distributed.get_world_size()
    else:
        args.rank = int(os.getenv('RANK', '0'))
        args.world_size = int(os.getenv('WORLD_SIZE', '1'))
    if args.local_rank is None:
        args.local_rank = int(os.getenv('LOCAL_RANK', '0'))
    if args.yaml_cfg is not None:  # Megatron's experimental YAML run configuration
        from megatron.training.yaml_run_config import apply_yaml_config

        apply_yaml_config(args)
    return args


def core_transformer_config_from_args(args, config_class=None):
    """Build the core `TransformerConfig` from args: the one place args become a model config.

    Every dataclass field with a same-named arg is copied; the remaining fields are mapped from
    Megatron's differently named flags.
    """
    if config_class is None:
        from megatron.core.transformer.transformer_config import TransformerConfig

        config_class = TransformerConfig
    kw_args = {}
    for f in dataclasses.fields(config_class):
        if hasattr(args, f.name):
            kw_args[f.name] = getattr(args, f.name)
    names = {f.name for f in dataclasses.fields(config_class)}

    def put(name, value):
        if name in names:
            kw_args[name] = value

    put('persist_layer_norm', not args.no_persist_layer_norm)
    put('layernorm_zero_centered_gamma', args.apply_layernorm_1p)
    put('layernorm_epsilon', args.norm_epsilon)
    put('deallocate_pipeline_outputs', True)
    put('pipeline_dtype', args.params_dtype)
    put('batch_p2p_comm', not args.overlap_p2p_comm)
    put('num_moe_experts', args.num_experts)
    put('rotary_interleaved', args.rotary_interleaved)
    if args.swiglu:
        put('activation_func', F.silu)
        put('gated_linear_unit', True)
        put('bias_activation_fusion', args.bias_swiglu_fusion)
    else:
        put('bias_activation_fusion', args.bias_gelu_fusion)
    if args.squared_relu:
        if args.swiglu:
            raise ValueError('--squared-relu and --swiglu are mutually exclusive')

        put('activation_func', squared_relu)
    if args.openai_gelu:
        put('activation_func', openai_gelu)
    if args.init_method_xavier_uniform:
        put('init_method', torch.nn.init.xavier_uniform_)
        put('scaled_init_method', torch.nn.init.xavier_uniform_)
    put('num_query_groups', args.num_query_groups if args.group_query_attention else None)
    # validate_args turns --standalone-embedding-stage into a first stage of 0 layers.
    put('first_pipeline_num_layers', args.decoder_first_pipeline_num_layers)
    put('last_pipeline_num_layers', args.decoder_last_pipeline_num_layers)
    return config_class(**kw_args)


# ---------------------------------------------------------------------------------------------
# argument groups
