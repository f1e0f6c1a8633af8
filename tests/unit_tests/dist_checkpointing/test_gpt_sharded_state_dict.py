"""GPTModel.sharded_state_dict: Megatron's keys and global shapes, and resharding on load.

- The worked example (2 layers, h 64, 4 heads, ffn 256, biases, learned positions, tied
  embeddings, padded vocabulary 128) at TP2 x PP2: every ShardedTensor key, global shape, local
  shape, offset, replica id and fragmentation, and the ShardedObject unique keys, literally as
  megatron-core 0.8.0 writes them.
- A checkpoint saved at TP2 x PP2 loads at TP1 x PP1, TP4, PP4 and TP1 x PP2 (GPT-2 like) and a
  GQA + SwiGLU model saved at TP2 loads at TP1 / TP4: the full (TP=1) weights equal the saved
  ones bit for bit (fused QKV with query groups, GLU halves), and the stored global tensors are
  the TP=1 layout.
"""

import os

import pytest
import torch

from tests.unit_tests.dist_utils import run_distributed

WORLD = 4

# (key, global shape, local shape, global offset as a function of (pp, tp), replica id of
# (pp, tp), axis fragmentations, allow_shape_mismatch) of the worked example.
L = 'decoder.layers.'


def _expected(pp, tp):
    """Megatron's table for the rank at (pp, tp): {(dict key): (key, global, local, offset,
    replica id, fragmentations, asm)}; the layer index L equals pp here."""
    g = pp  # global layer index (one layer per stage)
    rows = {}
    if pp == 0:
        rows['embedding.word_embeddings.weight'] = (
            'embedding.word_embeddings.weight',
            (128, 64),
            (64, 64),
            (64 * tp, 0),
            (0, 0, 0),
            (2, 1),
            True,
        )
        rows['embedding.position_embeddings.weight'] = (
            'embedding.position_embeddings.weight',
            (32, 64),
            (32, 64),
            (0, 0),
            (0, tp, 0),
            (1, 1),
            False,
        )
    else:
        rows['output_layer.weight'] = (
            'embedding.word_embeddings.weight',
            (128, 64),
            (64, 64),
            (64 * tp, 0),
            (1, 0, 0),
            (2, 1),
            True,
        )
        for name in ('weight', 'bias'):
            rows[f'decoder.final_layernorm.{name}'] = (
                f'decoder.final_layernorm.{name}',
                (64,),
                (64,),
                (0,),
                (0, tp, 0),
                (1,),
                False,
            )
    d = 'decoder.layers.0.'
    for local_name, key in (
        ('input_layernorm.weight', 'self_attention.linear_qkv.layer_norm_weight'),
        ('input_layernorm.bias', 'self_attention.linear_qkv.layer_norm_bias'),
        ('pre_mlp_layernorm.weight', 'mlp.linear_fc1.layer_norm_weight'),
        ('pre_mlp_layernorm.bias', 'mlp.linear_fc1.layer_norm_bias'),
        ('self_attention.linear_proj.bias', 'self_attention.linear_proj.bias'),
        ('mlp.linear_fc2.bias', 'mlp.linear_fc2.bias'),
    ):
        rows[d + local_name] = (L + key, (2, 64), (64,), (g, 0), (0, tp, 0), (2, 1), False)
    rows[d + 'self_attention.linear_qkv.weight'] = (
        L + 'self_attention.linear_qkv.weight',
        (2, 192, 64),
        (96, 64),
        (g, 96 * tp, 0),
        (0, 0, 0),
        (2, 2, 1),
        False,
    )
    rows[d + 'self_attention.linear_qkv.bias'] = (
        L + 'self_attention.linear_qkv.bias',
        (2, 192),
        (96,),
        (g, 96 * tp),
        (0, 0, 0),
        (2, 2),
        False,
    )
    rows[d + 'self_attention.linear_proj.weight'] = (
        L + 'self_attention.linear_proj.weight',
        (2, 64, 64),
        (64, 32),
        (g, 0, 32 * tp),
        (0, 0, 0),
        (2, 1, 2),
        False,
    )
    rows[d + 'mlp.linear_fc1.weight'] = (
        L + 'mlp.linear_fc1.weight',
        (2, 256, 64),
        (128, 64),
        (g, 128 * tp, 0),
        (0, 0, 0),
        (2, 2, 1),
        False,
    )
    rows[d + 'mlp.linear_fc1.bias'] = (
        L + 'mlp.linear_fc1.bias',
        (2, 256),
        (128,),
        (g, 128 * tp),
        (0, 0, 0),
        (2, 2),
        False,
    )
    rows[d + 'mlp.linear_fc2.weight'] = (
        L + 'mlp.linear_fc2.weight',
        (2, 64, 256),
        (64, 128),
        (g, 0, 128 * tp),
        (0, 0, 0),
        (2, 1, 2),
        False,
    )
    return rows


def _expected_objects(pp, tp):
    return {
        f'decoder.layers.0.{m}._extra_state': (
            f'decoder.layers.{m}._extra_state/shard_{pp}_2',
            (0, tp, 0),
        )
        for m in (
            'self_attention.linear_qkv',
            'self_attention.linear_proj',
            'mlp.linear_fc1',
            'mlp.linear_fc2',
        )
    }


def _worked_example_entries():
    from megatron.core import parallel_state
    from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor
    from tests.unit_tests.models.gpt_test_utils import build_gpt, gpt2_like_kwargs

    model, _ = build_gpt(
        gpt2_like_kwargs(hidden_size=64, num_attention_heads=4, ffn_hidden_size=256)
    )
    tensors, objects = {}, {}
    for name, sh in model.sharded_state_dict().items():
        if isinstance(sh, ShardedTensor):
            assert sh.data is dict(model.named_parameters())[name]  # the Parameter itself
            tensors[name] = (
                sh.key,
                sh.global_shape,
                sh.local_shape,
                sh.global_offset,
                sh.replica_id,
                sh.axis_fragmentations,
                sh.allow_shape_mismatch,
            )
        else:
            assert isinstance(sh, ShardedObject) and sh.data is None
            objects[name] = (sh.unique_key, sh.replica_id)
    pp = parallel_state.get_pipeline_model_parallel_rank()
    tp = parallel_state.get_tensor_model_parallel_rank()
    return pp, tp, tensors, objects


def test_worked_example_tp2_pp2_keys_and_global_shapes():
    outs = run_distributed(_worked_example_entries, world_size=WORLD, tp=2, pp=2)
    for rank, (pp, tp, tensors, objects) in enumerate(outs):
        assert rank == tp + 2 * pp  # Megatron's rank order (tp fastest)
        assert tensors == _expected(pp, tp)
        assert objects == _expected_objects(pp, tp)


# ---------------------------------------------------------------------------------------------
# resharding on load


def _full_weights(model, config):
    """{name with the global layer index: full (TP=1) tensor} of this rank's stage."""
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset
    from tests.unit_tests.models.gpt_test_utils import gather_full

    params = {n: p for n, p in model.named_parameters() if n != 'output_layer.weight'}
    full = gather_full(params, config)
    offset = get_transformer_layer_offset(config)
    out = {}
    for name, tensor in full.items():
        if name.startswith('decoder.layers.'):
            index, rest = name[len('decoder.layers.') :].split('.', 1)
            name = f'decoder.layers.{int(index) + offset}.{rest}'
        out[name] = tensor
    if 'output_layer.weight' in dict(model.named_parameters()) and model.pre_process is False:
        out['tied output copy'] = gather_full(
            {'output_layer.weight': model.output_layer.weight}, config
        )['output_layer.weight']
    return out


def _save_or_load(kind, arch, ckpt_dir, seed):
    from megatron.core import dist_checkpointing
    from tests.unit_tests.models.gpt_test_utils import (
        build_gpt,
        gpt2_like_kwargs,
        llama_like_kwargs,
    )

    torch.manual_seed(seed)
    kwargs = gpt2_like_kwargs(num_layers=4) if arch == 'gpt2' else llama_like_kwargs(num_layers=4)
    model, config = build_gpt(kwargs, arch=arch)
    if kind == 'save':
        if torch.distributed.get_rank() == 0:
            os.makedirs(ckpt_dir)
        torch.distributed.barrier()
        dist_checkpointing.save(model.sharded_state_dict(), ckpt_dir)
    else:
        dist_checkpointing.load(model.sharded_state_dict(), ckpt_dir)
    return _full_weights(model, config)


def _merge_stages(outs):
    merged = {}
    for out in outs:
        for name, tensor in out.items():
            if name in merged and name != 'tied output copy':
                assert torch.equal(merged[name], tensor), name
            merged[name] = tensor
    return merged


@pytest.mark.parametrize(
    'arch,save_layout,load_layouts',
    [
        ('gpt2', (2, 2), [(1, 1), (4, 1), (1, 4), (1, 2)]),
        ('llama', (2, 1), [(1, 1), (4, 1)]),
    ],
)
def test_reshard_on_load_keeps_every_weight(tmp_path, arch, save_layout, load_layouts):
    ckpt = str(tmp_path / 'ckpt')
    tp, pp = save_layout
    saved = _merge_stages(
        run_distributed(_save_or_load, world_size=WORLD, tp=tp, pp=pp, args=('save', arch, ckpt, 1))
    )
    # The stored global tensors are the TP=1 layout (Megatron's): fused QKV rows per query
    # group, GLU fc1 as [W; V], layers stacked along a leading axis.
    from megatron.core import dist_checkpointing

    plain = dist_checkpointing.load_plain_tensors(ckpt)
    for name in ('self_attention.linear_qkv.weight', 'mlp.linear_fc1.weight'):
        stacked = plain[f'decoder.layers.{name}']
        assert stacked.shape[0] == 4
        for layer in range(4):
            assert torch.equal(stacked[layer], saved[f'decoder.layers.{layer}.{name}']), name
    for tp, pp in load_layouts:
        world = WORLD if tp * pp <= WORLD else tp * pp
        outs = run_distributed(
            _save_or_load, world_size=world, tp=tp, pp=pp, args=('load', arch, ckpt, 2)
        )
        loaded = _merge_stages(outs)
        if 'tied output copy' in loaded:  # the last stage's copy reads the first stage's table
            assert torch.equal(
                loaded.pop('tied output copy'), saved['embedding.word_embeddings.weight']
            )
        saved.pop('tied output copy', None)
        assert sorted(loaded) == sorted(saved)
        for name in saved:
            assert torch.equal(loaded[name], saved[name]), f'{name} at TP{tp} PP{pp}'
