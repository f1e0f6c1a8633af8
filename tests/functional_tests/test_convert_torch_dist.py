"""convert.py reads and writes torch_dist checkpoints (loader_torch_dist / saver_torch_dist).

A torch-format checkpoint trained at TP2 x PP2 is converted to torch_dist, and back to the torch
format at TP1 x PP1: every weight survives bit for bit, and the torch_dist files hold Megatron's
global keys (layers stacked along a leading axis).
"""

import os

import torch

from tests.functional_tests.convert_utils import (
    GPT_ARCH,
    convert,
    full_model,
    make_source_checkpoint,
)


def test_torch_to_torch_dist_and_back(tmp_path):
    from megatron.core import dist_checkpointing

    source, dist, back = (str(tmp_path / n) for n in ('source', 'dist', 'back'))
    layout = ['--tensor-model-parallel-size', '2', '--pipeline-model-parallel-size', '2']
    make_source_checkpoint(source, GPT_ARCH, layout, world_size=4, tp=2, pp=2, iters=2)
    out = convert(
        '--loader', 'mcore', '--saver', 'torch_dist', '--load-dir', source, '--save-dir', dist
    )
    iter_dir = os.path.join(dist, 'iter_0000002')
    assert dist_checkpointing.check_is_distributed_checkpoint(iter_dir), out.stdout
    shapes = {
        k: v.global_shape for k, v in dist_checkpointing.load_tensors_metadata(iter_dir).items()
    }
    original, reader = full_model(source)
    layers = reader.args.num_layers
    qkv = original['decoder.layers.0.self_attention.linear_qkv.weight'].shape
    assert shapes['decoder.layers.self_attention.linear_qkv.weight'] == (layers, *qkv)
    assert 'decoder.layers.self_attention.linear_qkv.layer_norm_weight' in shapes

    convert(
        '--loader',
        'torch_dist',
        '--saver',
        'mcore',
        '--load-dir',
        dist,
        '--save-dir',
        back,
        '--target-tensor-parallel-size',
        '1',
        '--target-pipeline-parallel-size',
        '1',
    )
    converted, back_reader = full_model(back)
    original.pop('output_layer.weight (copy)', None)
    assert back_reader.tp == 1 and back_reader.pp == 1
    assert sorted(converted) == sorted(original)
    for name, tensor in original.items():
        assert torch.equal(converted[name], tensor), name
