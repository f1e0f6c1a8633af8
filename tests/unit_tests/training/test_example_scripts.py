"""The cluster-size example scripts pass start-up validation at the world size they describe:
their `flags=(...)` block (comments dropped, the positional arguments filled in) is parsed and
validated as on a rank of that job, so a renamed or refused flag, or a layout the model cannot
take, fails here and not on the cluster."""

import os
import shlex

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

#: script -> world size its header describes
SCRIPTS = {
    'examples/mixtral/train_mixtral_8x7b_distributed.sh': 32,
    'examples/deepseek_v3/train_deepseek_v3_distributed.sh': 1024,
}


def _flags(path):
    text = open(os.path.join(REPO, path)).read()
    start = text.index('flags=(') + len('flags=(')
    body = text[start : text.index('\n)\n', start)]
    lines = ['' if line.strip().startswith('#') else line for line in body.splitlines()]
    body = '\n'.join(lines)
    for var in ('ckpt_dir', 'tokenizer_model', 'tokenizer_dir', 'data_prefix', 'tb_dir'):
        body = body.replace(f'"${var}"', f'/tmp/{var}')
    return shlex.split(body)


@pytest.mark.parametrize('path', sorted(SCRIPTS))
def test_cluster_script_validates_at_its_world_size(path):
    from megatron.training.arguments import parse_args, validate_args

    args = parse_args(args_list=_flags(path))
    args.world_size, args.rank = SCRIPTS[path], 1
    validate_args(args, {})
    assert args.data_parallel_size >= 1


def test_deepseek_v3_layout():
    from megatron.core.transformer.pipeline_layer_split import pipeline_stage_layer_counts
    from megatron.training.arguments import (
        core_transformer_config_from_args,
        parse_args,
        validate_args,
    )

    path = 'examples/deepseek_v3/train_deepseek_v3_distributed.sh'
    args = parse_args(args_list=_flags(path))
    args.world_size, args.rank = SCRIPTS[path], 1
    validate_args(args, {})
    assert args.data_parallel_size == 64 and args.expert_model_parallel_size == 64
    assert pipeline_stage_layer_counts(61, 16, 4, 1) == [4] * 15 + [1]
    assert core_transformer_config_from_args(args).first_pipeline_num_layers == 4
