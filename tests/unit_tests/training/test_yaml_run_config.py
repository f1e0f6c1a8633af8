"""--yaml-cfg: Megatron's experimental YAML run configuration overlays the command line (top-level
flags, the model in language_model / model_parallel, renamed fields translated), reaches the
TransformerConfig, goes through the usual validation (refused features included) and names a bad
key."""

import re

import pytest
import torch

from megatron.training.arguments import core_transformer_config_from_args, parse_args, validate_args

CONFIG = """
language_model:
  num_layers: 3
  hidden_size: 48
  num_attention_heads: 6
  num_query_groups: 2
  ffn_hidden_size: null
  layernorm_epsilon: 1.e-6
  activation_func: swiglu
  num_moe_experts: null
  init_method_std: 0.01
  init_method: null
  apply_query_key_layer_scaling: False
  params_dtype: null
model_parallel:
  tensor_model_parallel_size: 1
  sequence_parallel: False
  bf16: True
  timers: null
micro_batch_size: 2
global_batch_size: 8
seq_length: 32
max_position_embeddings: 64
position_embedding_type: rope
lr: 2.5e-4
min_lr: 2.5e-5
train_iters: 10
"""


def _args(tmp_path, text, extra=''):
    path = tmp_path / 'run.yaml'
    path.write_text(text)
    args = parse_args(args_list=f'--yaml-cfg {path} --num-layers 9 --lr 1.0 {extra}'.split())
    args.world_size, args.rank = 1, 0
    return validate_args(args, {})


def test_yaml_values_reach_args_and_the_model_config(tmp_path):
    args = _args(tmp_path, CONFIG, '--seed 77')
    assert (args.num_layers, args.hidden_size, args.lr) == (3, 48, 2.5e-4)  # the file wins
    assert args.seed == 77  # a flag the file does not mention keeps its value
    assert args.swiglu and args.group_query_attention and args.num_query_groups == 2
    assert args.norm_epsilon == 1e-6 and args.params_dtype == torch.bfloat16
    config = core_transformer_config_from_args(args)
    assert config.gated_linear_unit and config.num_query_groups == 2
    assert config.layernorm_epsilon == 1e-6 and config.init_method_std == 0.01


@pytest.mark.parametrize(
    'line, message',
    [
        ('not_a_flag: 3', 'not_a_flag is not a flag'),
        ('language_model:\n  activation_func: relu6', "activation_func 'relu6' is not one of"),
        ('language_model:\n  shiny_field: 1', 'language_model.shiny_field is neither a flag'),
        ('fp8_margin: 3', '--fp8-margin (got 3) is not supported by this package'),
        ('- a list', 'expected a mapping of flags at the top level'),
    ],
)
def test_bad_files_stop_start_up_naming_the_key(tmp_path, line, message):
    text = line if line.startswith('-') else CONFIG + line
    if line.startswith('language_model'):
        text = CONFIG.replace('  activation_func: swiglu\n', line.split('\n')[1] + '\n', 1)
    with pytest.raises(ValueError, match=re.escape(message)):
        _args(tmp_path, text)
