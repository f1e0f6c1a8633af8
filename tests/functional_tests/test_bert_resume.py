"""BERT checkpoints through pretrain_bert.py: exact resume and megatron-core's state-dict keys.

TP=2 x PP=2 on 4 gloo ranks: an uninterrupted reference run; a run stopped by `--exit-interval`
(which saves before leaving); the same command again with `--load`. The resumed iterations'
`lm loss` and `sop loss` equal the reference's bit for bit (compared through `float.hex`). Each
rank's saved `model_optim_rng.pt` holds megatron-core BERT's flat keys for its stage: the
embedding (with token types) and layer 0 on stage 0; layer 0, the final norm, the LM head, the
output layer (the last stage's copy of the tied word embedding plus the bias), the binary head and
the pooler on stage 1.
"""

import os

import torch

from tests.functional_tests.bert_utils import run_bert_pretrain
from tests.functional_tests.test_resume import _check_resume
from tests.unit_tests.dist_utils import run_distributed

_LAYER0 = [
    'encoder.layers.0.input_layernorm.weight',
    'encoder.layers.0.input_layernorm.bias',
    'encoder.layers.0.self_attention.linear_proj.weight',
    'encoder.layers.0.self_attention.linear_proj.bias',
    'encoder.layers.0.self_attention.linear_proj._extra_state',
    'encoder.layers.0.self_attention.linear_qkv.weight',
    'encoder.layers.0.self_attention.linear_qkv.bias',
    'encoder.layers.0.self_attention.linear_qkv._extra_state',
    'encoder.layers.0.pre_mlp_layernorm.weight',
    'encoder.layers.0.pre_mlp_layernorm.bias',
    'encoder.layers.0.mlp.linear_fc1.weight',
    'encoder.layers.0.mlp.linear_fc1.bias',
    'encoder.layers.0.mlp.linear_fc1._extra_state',
    'encoder.layers.0.mlp.linear_fc2.weight',
    'encoder.layers.0.mlp.linear_fc2.bias',
    'encoder.layers.0.mlp.linear_fc2._extra_state',
]
STAGE0_KEYS = [
    'embedding.word_embeddings.weight',
    'embedding.position_embeddings.weight',
    'embedding.tokentype_embeddings.weight',
] + _LAYER0
STAGE1_KEYS = _LAYER0 + [
    'encoder.final_layernorm.weight',
    'encoder.final_layernorm.bias',
    'lm_head.dense.weight',
    'lm_head.dense.bias',
    'lm_head.layer_norm.weight',
    'lm_head.layer_norm.bias',
    'output_layer.weight',
    'output_layer.bias',
    'output_layer._extra_state',
    'binary_head.weight',
    'binary_head.bias',
    'pooler.dense.weight',
    'pooler.dense.bias',
]


def _hex_losses(result):
    return {
        int(it): tuple(float(losses[m]).hex() for m in ('lm loss', 'sop loss'))
        for it, losses in result['train_losses'].items()
    }


def _stop_and_resume(work_dir, data_prefix, train_iters, stop_at):
    from megatron.training import checkpointing

    common = [
        '--tensor-model-parallel-size',
        '2',
        '--pipeline-model-parallel-size',
        '2',
        '--micro-batch-size',
        '2',
        '--global-batch-size',
        '4',
        '--eval-iters',
        '1',
        '--train-iters',
        str(train_iters),
        '--data-path',
        data_prefix,
        '--data-cache-path',
        os.path.join(work_dir, 'cache'),
        '--save-interval',
        '1000',
    ]
    reference = _hex_losses(run_bert_pretrain(common + ['--save', os.path.join(work_dir, 'ref')]))
    resume_dir = os.path.join(work_dir, 'resume')
    stopped = _hex_losses(
        run_bert_pretrain(
            common + ['--save', resume_dir, '--load', resume_dir, '--exit-interval', str(stop_at)]
        )
    )
    saved = torch.load(checkpointing.get_checkpoint_name(resume_dir, stop_at), weights_only=False)
    keys = list(saved['model'].keys())
    resumed = _hex_losses(run_bert_pretrain(common + ['--save', resume_dir, '--load', resume_dir]))
    return reference, stopped, resumed, keys


def test_bert_exact_resume_tp2_pp2_and_checkpoint_keys(bert_data_prefix, tmp_path):
    train_iters, stop_at = 5, 3
    outs = run_distributed(
        _stop_and_resume,
        world_size=4,
        tp=2,
        pp=2,
        args=(str(tmp_path), bert_data_prefix, train_iters, stop_at),
        timeout=600,
    )
    # tp fastest: ranks 0, 1 are stage 0, ranks 2, 3 stage 1 (which has the losses).
    assert outs[0][3] == STAGE0_KEYS and outs[1][3] == STAGE0_KEYS
    assert outs[2][3] == STAGE1_KEYS and outs[3][3] == STAGE1_KEYS
    reference, stopped, resumed, _ = outs[-1]
    _check_resume(reference, stopped, resumed, train_iters, stop_at)
