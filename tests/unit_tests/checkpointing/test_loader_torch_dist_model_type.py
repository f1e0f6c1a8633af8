"""tools/checkpoint/loader_torch_dist.py names the model a torch_dist checkpoint holds.

A torch_dist checkpoint stores every stage's tensors under global keys, so a T5 one holds both
`encoder.` and `decoder.` keys; the loader used to call any checkpoint with an encoder BERT,
which sent a T5 through the BERT conversion. Checkpoints here are written with
megatron.core.dist_checkpointing in one process (tiny tensors, the key names are what matters).
"""

import argparse
import os
import sys

import pytest
import torch

from tests.unit_tests.dist_utils import run_distributed

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

KEYS = {
    'GPT': ['embedding.word_embeddings.weight', 'decoder.final_layernorm.weight'],
    'BERT': ['embedding.word_embeddings.weight', 'encoder.final_layernorm.weight'],
    'T5': [
        'embedding.word_embeddings.weight',
        'encoder.final_layernorm.weight',
        'decoder.final_layernorm.weight',
    ],
}


def _write_and_read(load_dir, keys):
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor

    iter_dir = os.path.join(load_dir, 'iter_0000001')
    os.makedirs(iter_dir, exist_ok=True)
    state = {k: ShardedTensor.from_rank_offsets(k, torch.zeros(2), replica_id=0) for k in keys}
    state['args'] = argparse.Namespace(num_layers=2)
    dist_checkpointing.save(state, iter_dir)
    with open(os.path.join(load_dir, 'latest_checkpointed_iteration.txt'), 'w') as f:
        f.write('1')
    tools = os.path.join(REPO, 'tools', 'checkpoint')
    if tools not in sys.path:
        sys.path.insert(0, tools)
    import loader_torch_dist

    model_type = loader_torch_dist._reader(argparse.Namespace(load_dir=load_dir)).model_type
    try:
        loader_torch_dist.check_arguments(argparse.Namespace(load_dir=load_dir, model_type='T5'))
        refusal = None
    except ValueError as exc:
        refusal = str(exc)
    return model_type, refusal


@pytest.mark.parametrize('expected', ['GPT', 'BERT', 'T5'])
def test_model_type_of_a_torch_dist_checkpoint(tmp_path, expected):
    model_type, refusal = run_distributed(
        _write_and_read, world_size=1, args=(str(tmp_path / expected), KEYS[expected])
    )[0]
    assert model_type == expected
    if expected == 'T5':
        # Named T5, and refused with the way out (this loader has no T5 path).
        assert 'holds a T5 model' in refusal and '--loader mcore' in refusal
    else:
        assert f'holds a {expected} model' in refusal
