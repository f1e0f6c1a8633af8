"""`--yaml-cfg FILE`: Megatron core_r0.8.0's experimental YAML run configuration.

The file nests the model in `language_model:` (TransformerConfig fields, `activation_func` and
`init_method` by name) and `model_parallel:` (ModelParallelConfig fields) and holds every other
training flag at the top level under its attribute name (Megatron's
`examples/gpt3/gpt_config.yaml`).
`apply_yaml_config` overlays it on the parsed command line before validation: top-level keys and
the model sections' fields set the same-named args (a section field whose flag has another name is
translated: `layernorm_epsilon` -> `--norm-epsilon`, `num_moe_experts` -> `--num-experts`,
`activation_func: swiglu` -> `--swiglu`, ...). Fields of the core configs without a flag are
carried on args for `core_transformer_config_from_args`; a null one means its default. A key that
is neither a flag nor a config field stops start-up naming it. The usual validation then runs on
the result, the refusal table included.

Megatron replaces the whole namespace by the file ("argparse arguments will be ignored", and a
flag the file lacks does not exist); here the file's values replace the command line's and flags
it does not mention keep theirs.
"""

import dataclasses

import yaml

from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.transformer.transformer_config import TransformerConfig

#: Section fields whose flag has another attribute name: field -> (attribute, value mapping).
_RENAMED = {
    'layernorm_epsilon': ('norm_epsilon', None),
    'layernorm_zero_centered_gamma': ('apply_layernorm_1p', None),
    'num_moe_experts': ('num_experts', None),
    'persist_layer_norm': ('no_persist_layer_norm', lambda v: not v),
    'bias_activation_fusion': ('bias_gelu_fusion', None),
}
#: Section fields the training layer derives (from fp16/bf16, the schedule): ignored.
_DERIVED = {'params_dtype', 'pipeline_dtype', 'deallocate_pipeline_outputs', 'batch_p2p_comm'}
_SECTIONS = ('language_model', 'model_parallel')


def _config_fields():
    return {f.name for f in dataclasses.fields(TransformerConfig)} | {
        f.name for f in dataclasses.fields(ModelParallelConfig)
    }


def _apply_activation(args, value, path):
    if value not in ('swiglu', 'squaredrelu', 'gelu'):
        raise ValueError(
            f'--yaml-cfg {path}: language_model.activation_func {value!r} is not one of swiglu, '
            'squaredrelu, gelu'
        )
    args.swiglu = value == 'swiglu'
    args.squared_relu = value == 'squaredrelu'


def _apply_section(args, name, section, path, fields):
    for key, value in (section or {}).items():
        where = f'{name}.{key}'
        if key == 'activation_func':
            _apply_activation(args, value, path)
        elif key in ('init_method', 'embedding_init_method', 'output_layer_init_method'):
            if value not in (None, 'xavier_uniform') or (
                value is not None and key == 'output_layer_init_method'
            ):
                raise ValueError(f'--yaml-cfg {path}: {where} {value!r}: only xavier_uniform')
            if value is not None:
                args.init_method_xavier_uniform = True
        elif key == 'num_query_groups':
            if value is not None:
                args.group_query_attention, args.num_query_groups = True, value
        elif key in _RENAMED:
            attribute, mapping = _RENAMED[key]
            setattr(args, attribute, mapping(value) if mapping else value)
        elif key in _DERIVED or (value is None and not hasattr(args, key)):
            continue  # a null config-only field: its default
        elif hasattr(args, key) or key in fields:
            setattr(args, key, value)
        else:
            raise ValueError(
                f'--yaml-cfg {path}: {where} is neither a flag nor a field of TransformerConfig '
                'or ModelParallelConfig'
            )


def apply_yaml_config(args) -> None:
    """Overlay `args.yaml_cfg` on `args` (in place); ValueError naming a bad file or key."""
    path = args.yaml_cfg
    try:
        with open(path) as f:
            config = yaml.safe_load(f)
    except (OSError, yaml.YAMLError) as exc:
        raise ValueError(f'--yaml-cfg {path} cannot be read as YAML: {exc}') from exc
    if not isinstance(config, dict):
        raise ValueError(f'--yaml-cfg {path}: expected a mapping of flags at the top level')
    if args.rank == 0:
        print(
            f'NOTE: --yaml-cfg {path} (experimental, as in Megatron): its values replace those '
            'of the same flags on the command line',
            flush=True,
        )
    fields = _config_fields()
    for name in _SECTIONS:
        section = config.get(name)
        if section is not None and not isinstance(section, dict):
            raise ValueError(f'--yaml-cfg {path}: {name} must be a mapping')
        _apply_section(args, name, section, path, fields)
    for key, value in config.items():
        if key in _SECTIONS or key == 'yaml_cfg':
            continue
        if not hasattr(args, key):
            raise ValueError(f'--yaml-cfg {path}: {key} is not a flag (attribute name expected)')
        setattr(args, key, value)
