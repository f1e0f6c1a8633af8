"""Megatron's experimental YAML configuration: the model part.

Megatron core_r0.8.0's YAML run configuration (`--yaml-cfg`, see its
`examples/gpt3/gpt_config.yaml`) nests the model in two sections:

    language_model:          # TransformerConfig fields, plus activation_func / init_method names
      num_layers: 24
      hidden_size: 1024
      activation_func: swiglu   # swiglu | squaredrelu | gelu
      ...
    model_parallel:          # ModelParallelConfig fields, plus fp16 / bf16
      tensor_model_parallel_size: 1
      bf16: True
      ...

`load_yaml(path)` reads such a file into nested namespaces and
`core_transformer_config_from_yaml(args, "language_model")` turns them into a `TransformerConfig`,
as Megatron's `megatron/training/yaml_arguments.py` does. Running a whole job from a YAML file
(`--yaml-cfg`) is not supported: the flag is refused at start-up.
"""

import dataclasses
import json
from types import SimpleNamespace

import torch
import torch.nn.functional as F
import yaml

from megatron.training.arguments import squared_relu

ACTIVATIONS = ('swiglu', 'squaredrelu', 'gelu')


def load_yaml(yaml_path):
    """The YAML file as nested SimpleNamespaces, with `yaml_cfg` set to its path."""
    print(
        'warning using experimental yaml arguments feature, argparse arguments will be ignored',
        flush=True,
    )
    with open(yaml_path, 'r') as f:
        config = yaml.safe_load(f)
    namespace = json.loads(json.dumps(config), object_hook=lambda item: SimpleNamespace(**item))
    namespace.yaml_cfg = yaml_path
    return namespace


def _params_dtype(model_parallel):
    # The YAML leaves params_dtype null; Megatron derives it from fp16 / bf16.
    dtype = getattr(model_parallel, 'params_dtype', None)
    if isinstance(dtype, torch.dtype):
        return dtype
    if getattr(model_parallel, 'fp16', False):
        return torch.half
    if getattr(model_parallel, 'bf16', False):
        return torch.bfloat16
    return torch.float


def core_transformer_config_from_yaml(args, transfomer_key='language_model', config_class=None):
    """Build a `TransformerConfig` from the `transfomer_key` and `model_parallel` sections.

    Args:
        args: the namespace of `load_yaml` (not modified).
        transfomer_key: the section holding the transformer fields (Megatron's spelling).
        config_class: the config dataclass (default TransformerConfig).

    Raises:
        ValueError: an `activation_func` other than swiglu, squaredrelu or gelu.
    """
    if config_class is None:
        from megatron.core.transformer.transformer_config import TransformerConfig

        config_class = TransformerConfig
    section = vars(getattr(args, transfomer_key))
    model_parallel = args.model_parallel
    merged = SimpleNamespace(**section, **vars(model_parallel))

    kw_args = {}
    for f in dataclasses.fields(config_class):
        if hasattr(merged, f.name):
            kw_args[f.name] = getattr(merged, f.name)

    kw_args['params_dtype'] = _params_dtype(model_parallel)
    kw_args['deallocate_pipeline_outputs'] = True
    kw_args['pipeline_dtype'] = kw_args['params_dtype']
    kw_args['batch_p2p_comm'] = not getattr(merged, 'overlap_p2p_comm', False)

    activation = getattr(merged, 'activation_func', 'gelu')
    if activation not in ACTIVATIONS:
        raise ValueError(
            f'{transfomer_key}.activation_func: {activation!r} is not a supported activation '
            f'function (one of {", ".join(ACTIVATIONS)})'
        )
    if activation == 'swiglu':
        kw_args['activation_func'] = F.silu
        kw_args['gated_linear_unit'] = True
        kw_args['bias_activation_fusion'] = getattr(merged, 'bias_swiglu_fusion', True)
    elif activation == 'squaredrelu':
        kw_args['activation_func'] = squared_relu
    else:
        kw_args['activation_func'] = F.gelu
        # Megatron's rule: the bias-GeLU fusion is off whenever the linear layers have biases.
        if getattr(merged, 'add_bias_linear', True):
            kw_args['bias_activation_fusion'] = False
        else:
            kw_args['bias_activation_fusion'] = getattr(merged, 'bias_activation_fusion', False)

    if getattr(merged, 'init_method', None) == 'xavier_uniform':
        kw_args['init_method'] = torch.nn.init.xavier_uniform_
        # Megatron also passes `scaled_init_method`, which is not a TransformerConfig field; as
        # in core_transformer_config_from_args, output layers keep their scaled normal init.
    elif isinstance(kw_args.get('init_method'), str):
        raise ValueError(
            f'{transfomer_key}.init_method: {kw_args["init_method"]!r} is not supported '
            '(null or xavier_uniform)'
        )
    return config_class(**kw_args)
