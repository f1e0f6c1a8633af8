"""tools/checkpoint/convert.py --model-type BERT: TP2xPP2 -> TP1xPP1 -> TP4xPP1 -> TP2xPP2.

The source is a BertModel (token types, tied output layer with a bias, pooler, LM head, binary
head) built at TP2 x PP2 on 4 gloo ranks with weights that depend only on each tensor's global
name, saved in Megatron's layout with its args. Every tensor survives every step bit for bit,
including the token-type embeddings and the output-layer bias that Megatron's converter drops,
and the TP1 result loads strictly into a TP1 BertModel built from its saved args, where it equals
that model given the same name-seeded weights directly.
"""

import os

import pytest
import torch

from tests.functional_tests import convert_utils as cu
from tests.unit_tests.dist_utils import run_distributed

BERT_ARGS = [
    '--num-layers', '4', '--hidden-size', '32', '--num-attention-heads', '4',
    '--seq-length', '16', '--max-position-embeddings', '16', '--micro-batch-size', '1',
    '--mock-data', '--tokenizer-type', 'NullTokenizer', '--vocab-size', '4095',
]  # fmt: skip


def _bert_args(extra):
    from megatron.training.arguments import parse_args
    from megatron.training.validation.argument_validation import validate_args

    args = parse_args(args_list=BERT_ARGS + list(extra))
    args.world_size, args.rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    validate_args(args)
    args.padded_vocab_size = 4096
    return args


def _build_bert(args):
    from megatron.core import parallel_state as ps
    from megatron.core.models.bert.bert_layer_specs import bert_layer_local_spec
    from megatron.core.models.bert.bert_model import BertModel
    from megatron.training.arguments import core_transformer_config_from_args
    from tests.functional_tests.gpt_utils import set_reference_weights

    model = BertModel(
        config=core_transformer_config_from_args(args),
        num_tokentypes=2,
        transformer_layer_spec=bert_layer_local_spec,
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=True,
        add_binary_head=True,
    )
    offset = ps.get_pipeline_model_parallel_rank() * (
        args.num_layers // ps.get_pipeline_model_parallel_world_size()
    )
    set_reference_weights(model, args.num_layers, offset)
    return model


def _write_source(save_dir):
    from megatron.core import parallel_state as ps
    from megatron.training.checkpointing import _args_for_checkpoint, get_checkpoint_name

    args = _bert_args(['--tensor-model-parallel-size', '2', '--pipeline-model-parallel-size', '2'])
    model = _build_bert(args)
    name = get_checkpoint_name(
        save_dir,
        7,
        pipeline_parallel=True,
        tensor_rank=ps.get_tensor_model_parallel_rank(),
        pipeline_rank=ps.get_pipeline_model_parallel_rank(),
        expert_parallel=False,
        expert_rank=0,
    )
    os.makedirs(os.path.dirname(name), exist_ok=True)
    torch.save(
        {
            'args': _args_for_checkpoint(args),
            'checkpoint_version': 3.0,
            'iteration': 7,
            'model': model.state_dict_for_save_checkpoint(),
        },
        name,
    )
    torch.distributed.barrier()
    if torch.distributed.get_rank() == 0:
        with open(os.path.join(save_dir, 'latest_checkpointed_iteration.txt'), 'w') as f:
            f.write('7')


def _tp1_against_reference(load_dir):
    """Strict load of the converted TP1 file into a BertModel built from its saved args."""
    from megatron.training.checkpoint.checkpoint_conversion import (
        CheckpointReader,
        torch_load_weights_only,
    )
    from megatron.training.checkpointing import load_args_from_checkpoint

    args = _bert_args(['--load', load_dir, '--use-checkpoint-args'])
    load_args_from_checkpoint(args)
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size) == (1, 1)
    reference = _build_bert(args)
    converted = _build_bert(args)
    state = torch_load_weights_only(CheckpointReader(load_dir).rank_file(0, 0), mmap=False)
    converted.load_state_dict(state['model'], strict=True)
    ref_sd, conv_sd = reference.state_dict(), converted.state_dict()
    return [
        k
        for k, v in ref_sd.items()
        if isinstance(v, torch.Tensor) and not torch.equal(v, conv_sd[k])
    ]


@pytest.fixture(scope='module')
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp('convert_bert')
    src, tp1, tp4, back = (str(root / n) for n in ('src', 'tp1', 'tp4', 'tp2pp2'))
    run_distributed(_write_source, world_size=4, tp=2, pp=2, args=(src,))
    common = ['--model-type', 'BERT', '--loader', 'mcore', '--saver', 'mcore']
    cu.convert(
        *common,
        '--load-dir',
        src,
        '--save-dir',
        tp1,
        '--target-tensor-parallel-size',
        '1',
        '--target-pipeline-parallel-size',
        '1',
        model_type=None,
    )
    cu.convert(
        *common,
        '--load-dir',
        tp1,
        '--save-dir',
        tp4,
        '--target-tensor-parallel-size',
        '4',
        model_type=None,
    )
    proc = cu.convert(
        *common,
        '--load-dir',
        tp4,
        '--save-dir',
        back,
        '--target-tensor-parallel-size',
        '2',
        '--target-pipeline-parallel-size',
        '2',
        model_type=None,
    )
    return dict(src=src, tp1=tp1, tp4=tp4, back=back, log=proc.stdout)


def test_bert_round_trip_is_bitwise_exact(checkpoints):
    source, _ = cu.full_model(checkpoints['src'])
    for name in (
        'embedding.tokentype_embeddings.weight',
        'output_layer.bias',
        'pooler.dense.weight',
        'lm_head.dense.weight',
        'lm_head.layer_norm.bias',
        'binary_head.weight',
        'encoder.final_layernorm.weight',
        'encoder.layers.3.mlp.linear_fc1.weight',
    ):
        assert name in source, name
    names = sorted(k for k in source if not k.endswith('(copy)'))
    for key in ('tp1', 'tp4', 'back'):
        converted, reader = cu.full_model(checkpoints[key])
        assert sorted(k for k in converted if not k.endswith('(copy)')) == names, key
        for name in names:
            assert torch.equal(converted[name], source[name]), f'{key}: {name} differs'
        assert reader.iteration == 7
    sent = [
        line[len('sending ') :]
        for line in checkpoints['log'].splitlines()
        if line.startswith('sending ')
    ]
    assert sent[-4:] == ['final norm', 'pooler', 'lm head', 'binary head']


def test_bert_tp1_loads_strictly_and_equals_the_reference_weights(checkpoints):
    (differing,) = run_distributed(_tp1_against_reference, world_size=1, args=(checkpoints['tp1'],))
    assert differing == []
