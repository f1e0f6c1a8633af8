"""MoE GPTModel.sharded_state_dict: the expert axis (Megatron's keys and global shapes) and
resharding across expert / tensor parallel sizes and between SequentialMLP and GroupedMLP.

- Literal keys, global / local shapes, offsets and replica ids of an MoE layer at TP2 x EP2 and
  at TP2 x EP1 (expert data parallel 2), for SequentialMLP and GroupedMLP (the same tensors).
- A checkpoint of a model with 4 experts, shared experts and an expert bias, saved at TP2 x EP2
  (SequentialMLP) loads at TP1 x EP4 (grouped), TP2 x EP1 (grouped), TP1 x EP1 and back: every
  weight equals the saved model's; the stored expert tensor [L, E, 2F, h] holds expert e's
  [W; V] rows at index e (checked against the one-rank model).
- A distributed-optimizer slice of a grouped weight (any flat range) maps to the boxes holding
  the same elements in the stored layout.
"""

import os

import torch

from tests.unit_tests.dist_utils import run_distributed

H, FFN, E, LAYERS = 16, 8, 4, 2


def _config_kwargs(grouped, **overrides):
    from megatron.core import parallel_state

    tp = parallel_state.get_tensor_model_parallel_world_size()
    kw = dict(
        num_layers=LAYERS,
        hidden_size=H,
        num_attention_heads=4,
        ffn_hidden_size=FFN,
        normalization='RMSNorm',
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=True,
        num_moe_experts=E,
        moe_router_topk=2,
        moe_grouped_gemm=grouped,
        expert_model_parallel_size=parallel_state.get_expert_model_parallel_world_size(),
        sequence_parallel=tp > 1,
    )
    kw.update(overrides)
    return kw


def _build(grouped, seed, **overrides):
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.manual_seed(seed)
    config = TransformerConfig(
        tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
        **_config_kwargs(grouped, **overrides),
    )
    return GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(E, grouped),
        vocab_size=64,
        max_sequence_length=16,
        position_embedding_type='rope',
        share_embeddings_and_output_weights=False,
    )


def _moe_entries(grouped):
    """{ST key: (global shape, local shape, offset, replica id, fragmentations)} of layer 1's
    experts and router on this rank (the built chunks of factories), and object unique keys."""
    from megatron.core import parallel_state
    from megatron.core.dist_checkpointing import ShardedObject, ShardedTensorFactory

    model = _build(grouped, seed=1)
    tensors, objects = {}, set()
    for name, sh in model.sharded_state_dict().items():
        if not name.startswith(('decoder.layers.1.mlp.', 'decoder.layers.1.pre_mlp')):
            continue
        if isinstance(sh, ShardedObject):
            objects.add((sh.unique_key, sh.replica_id))
            continue
        chunks = sh.build() if isinstance(sh, ShardedTensorFactory) else [sh]
        for c in chunks:
            tensors.setdefault(c.key, []).append(
                (
                    c.global_shape,
                    c.local_shape,
                    c.global_offset,
                    c.replica_id,
                    c.axis_fragmentations,
                )
            )
    tp = parallel_state.get_tensor_model_parallel_rank()
    ep = parallel_state.get_expert_model_parallel_rank()
    edp = parallel_state.get_data_modulo_expert_parallel_rank(with_context_parallel=True)
    dp = parallel_state.get_data_parallel_rank(with_context_parallel=True)
    return (tp, ep, edp, dp), {k: sorted(v) for k, v in tensors.items()}, objects


def _expected(ranks, tp_size, ep_size, grouped):
    """Megatron's layout for layer 1 (L = 2, E = 4, F = 8, h = 16, SwiGLU) at this rank."""
    tp, ep, edp, dp = ranks
    nle = E // ep_size
    f = FFN // tp_size
    fc1 = 'decoder.layers.mlp.experts.experts.linear_fc1.weight'
    fc2 = 'decoder.layers.mlp.experts.experts.linear_fc2.weight'
    rows = {}
    if grouped:  # one chunk of nle experts per half (expert axis real, local size nle)
        rows[fc1] = [
            ((2, 4, 16, 16), (nle, f, 16), (1, nle * ep, half * 8 + f * tp, 0), (0, 0, edp),
             (2, ep_size, 2 * tp_size, 1))
            for half in (0, 1)
        ]  # fmt: skip
        rows[fc2] = [
            ((2, 4, 16, 8), (nle, 16, f), (1, nle * ep, 0, f * tp), (0, 0, edp),
             (2, ep_size, 1, tp_size))
        ]  # fmt: skip
    else:  # one chunk per expert (expert axis prepended, local size 1) and GLU half
        rows[fc1] = [
            ((2, 4, 16, 16), (f, 16), (1, e, half * 8 + f * tp, 0), (0, 0, edp),
             (2, 4, 2 * tp_size, 1))
            for e in range(nle * ep, nle * ep + nle)
            for half in (0, 1)
        ]  # fmt: skip
        rows[fc2] = [
            ((2, 4, 16, 8), (16, f), (1, e, 0, f * tp), (0, 0, edp), (2, 4, 1, tp_size))
            for e in range(nle * ep, nle * ep + nle)
        ]
    # Replicated over TP, EP and DP: written once (TP 0, DP 0).
    rows['decoder.layers.mlp.router.weight'] = [
        ((2, 4, 16), (4, 16), (1, 0, 0), (0, tp, dp), (2, 1, 1))
    ]
    rows['decoder.layers.mlp.linear_fc1.layer_norm_weight'] = [
        ((2, 16), (16,), (1, 0), (0, tp, dp), (2, 1))
    ]
    objects = {
        (
            f'decoder.layers.mlp.experts.experts.{fc}._extra_state/shard_1.{e}_2.4',
            (0, tp, edp),
        )
        for e in range(nle * ep, nle * ep + nle)
        for fc in ('linear_fc1', 'linear_fc2')
    }
    return {k: sorted(v) for k, v in rows.items()}, objects


def _check_layout(tp_size, ep_size):
    for grouped in (False, True):
        outs = run_distributed(_moe_entries, world_size=4, tp=tp_size, ep=ep_size, args=(grouped,))
        for ranks, tensors, objects in outs:
            rows, expected_objects = _expected(ranks, tp_size, ep_size, grouped)
            assert tensors == rows, (tp_size, ep_size, grouped, ranks)
            assert objects == expected_objects


def test_expert_axis_keys_tp2_ep2():
    # DP 2 = EP 2: expert data parallel size 1; the router's DP slot is the data-parallel rank.
    _check_layout(tp_size=2, ep_size=2)


def test_expert_axis_keys_tp2_ep1_expert_data_parallel():
    # EP 1, DP 2: both data-parallel ranks hold every expert; expert-DP rank 0 writes them.
    _check_layout(tp_size=2, ep_size=1)


def _mixed_layer_keys():
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        tensor_model_parallel_size=2, **_config_kwargs(False, moe_layer_freq=[0, 1])
    )
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_decoder_block_spec(config),
        vocab_size=64,
        max_sequence_length=16,
        position_embedding_type='rope',
    )
    return {
        sh.key: sh.global_shape
        for sh in model.sharded_state_dict().values()
        if isinstance(sh, ShardedTensor) and '.mlp.' in sh.key
    }


def test_mixed_dense_and_moe_layers_get_per_layer_keys():
    # No tensor spans both layers: per-layer keys without the layer axis.
    keys = run_distributed(_mixed_layer_keys, world_size=4, tp=2, ep=2)[0]
    assert keys == {
        'decoder.layers.0.mlp.linear_fc1.layer_norm_weight': (16,),
        'decoder.layers.1.mlp.linear_fc1.layer_norm_weight': (16,),
        'decoder.layers.0.mlp.linear_fc2.weight': (16, 8),
        'decoder.layers.1.mlp.router.weight': (4, 16),
        'decoder.layers.1.mlp.experts.experts.linear_fc2.weight': (4, 16, 8),
    }


# ---------------------------------------------------------------------------------------------
# resharding on load


MODEL_OPTS = dict(
    init_method_std=0.3,  # weights that move the loss
    moe_shared_expert_intermediate_size=8,
    moe_shared_expert_gate=True,
    moe_router_enable_expert_bias=True,
    moe_router_score_function='sigmoid',
)


def _loss(model):
    """The mean loss of a fixed batch (eval mode; every rank sees the same tokens)."""
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, 64, (2, 9), generator=g)
    position_ids = torch.arange(8).unsqueeze(0).expand(2, 8)
    model.eval()
    with torch.no_grad():
        loss = model(tokens[:, :-1], position_ids, None, labels=tokens[:, 1:])
    return float(loss.float().mean())


def _save(ckpt_dir, model):
    from megatron.core import dist_checkpointing

    if torch.distributed.get_rank() == 0:
        os.makedirs(ckpt_dir)
    torch.distributed.barrier()
    dist_checkpointing.save(model.sharded_state_dict(), ckpt_dir)


def _save_or_load(kind, grouped, ckpt_dir, seed, resave_dir=None):
    """Save (with a non-zero expert bias) or load, then re-save into `resave_dir`; returns the
    loss of a fixed batch and this rank's model state."""
    from megatron.core import dist_checkpointing

    model = _build(grouped, seed, **MODEL_OPTS)
    if kind == 'save':
        with torch.no_grad():  # a trained expert bias (not its zero init)
            for layer in model.decoder.layers:
                layer.mlp.router.expert_bias.uniform_(-0.1, 0.1)
        _save(ckpt_dir, model)
    else:
        loaded = dist_checkpointing.load(model.sharded_state_dict(), ckpt_dir)
        own = {k: v for k, v in model.state_dict().items() if k.endswith('_extra_state')}
        model.load_state_dict({**own, **loaded}, strict=True)
    if resave_dir is not None:
        _save(resave_dir, model)
    state = {k: v.detach().clone() for k, v in model.state_dict().items() if v is not None}
    return _loss(model), state


def _plain(ckpt):
    from megatron.core import dist_checkpointing

    return dist_checkpointing.load_plain_tensors(ckpt)


def test_reshard_experts_across_ep_tp_and_grouped_gemm(tmp_path):
    """Saved at TP2 x EP2 (SequentialMLP), loaded at TP1 x EP4 / TP2 x EP1 (GroupedMLP) and
    TP1 x EP1, each load saved again: the re-saved global tensors equal the original bit for
    bit and the loss of a fixed batch is the saved model's (within reduction noise)."""
    ckpt = str(tmp_path / 'seq')
    saved = run_distributed(_save_or_load, world_size=4, tp=2, ep=2, args=('save', False, ckpt, 1))
    saved_loss = saved[0][0]
    original = _plain(ckpt)
    assert original['decoder.layers.mlp.experts.experts.linear_fc1.weight'].shape == (2, E, 16, H)
    assert original['decoder.layers.mlp.shared_experts.linear_fc1.weight'].shape == (2, 16, H)
    for tp, ep, grouped in ((1, 4, True), (2, 1, True), (1, 1, False)):
        resave = str(tmp_path / f'tp{tp}ep{ep}')
        outs = run_distributed(
            _save_or_load, world_size=4, tp=tp, ep=ep, args=('load', grouped, ckpt, 2, resave)
        )
        for loss, _ in outs:
            assert abs(loss - saved_loss) <= 1e-5 * abs(saved_loss), (tp, ep, loss, saved_loss)
        if (tp, ep) == (2, 1):  # grouped weight1 block e = SequentialMLP expert e's fc1^T
            for rank, (_, state) in enumerate(outs):
                for layer, e in ((0, 1), (1, 2)):
                    pre = f'decoder.layers.{layer}.mlp.experts.'
                    block = state[pre + 'weight1'].view(E, H, -1)[e].t()
                    # saved at TP2 x EP2: rank = tp + 2 ep, local expert e % 2
                    source = saved[rank % 2 + 2 * (e // 2)][1]
                    fc1 = source[f'{pre}local_experts.{e % 2}.linear_fc1.weight']
                    assert torch.equal(block, fc1), (rank, layer, e)
        again = _plain(resave)
        assert sorted(again) == sorted(original)
        for key in original:
            assert torch.equal(again[key], original[key]), (key, tp, ep, grouped)
    # At TP1 x EP1 the stored experts are the SequentialMLP's own, expert by expert.
    state = outs[0][1]
    for layer in range(LAYERS):
        for e in range(E):
            for fc in ('linear_fc1', 'linear_fc2'):
                stored = original[f'decoder.layers.mlp.experts.experts.{fc}.weight'][layer, e]
                local = state[f'decoder.layers.{layer}.mlp.experts.local_experts.{e}.{fc}.weight']
                assert torch.equal(stored, local), (layer, e, fc)
        bias = state[f'decoder.layers.{layer}.mlp.router.expert_bias']
        assert torch.equal(original['decoder.layers.mlp.router.expert_bias'][layer], bias)
        assert bias.abs().sum() > 0

    # GroupedMLP at TP1 x EP4 back to SequentialMLP at TP2 x EP2.
    grouped_ckpt, back = str(tmp_path / 'grouped'), str(tmp_path / 'back')
    run_distributed(_save_or_load, world_size=4, tp=1, ep=4, args=('save', True, grouped_ckpt, 3))
    run_distributed(
        _save_or_load, world_size=4, tp=2, ep=2, args=('load', False, grouped_ckpt, 4, back)
    )
    grouped_plain, back_plain = _plain(grouped_ckpt), _plain(back)
    for key in grouped_plain:
        assert torch.equal(back_plain[key], grouped_plain[key]), key


# ---------------------------------------------------------------------------------------------
# grouped weights in distributed-optimizer slices


def _grouped_slices_match_layout():
    from megatron.core.dist_checkpointing import ShardedTensorFactory

    model = _build(True, seed=3)
    for name, sh in model.sharded_state_dict().items():
        if not (isinstance(sh, ShardedTensorFactory) and 'experts.weight' in name):
            continue
        stored = torch.zeros(sh.build()[0].global_shape)
        for chunk in sh.build():  # the whole local weight, Megatron's chunks
            index = tuple(
                slice(o, o + s) for o, s in zip(chunk.global_offset, chunk.local_chunk_shape)
            )
            stored[index] = chunk.data.reshape(chunk.local_chunk_shape)
        flat = sh.data.detach().reshape(-1)
        numel = flat.numel()
        covered = 0
        for start, stop in ((0, 5), (5, numel // 2 + 3), (numel // 2 + 3, numel)):
            piece = flat[start:stop].clone()
            boxes = sh.build_fn(sh.key, piece, (0, 0, 0), slice(start, stop))
            for box in boxes:
                index = tuple(
                    slice(o, o + s) for o, s in zip(box.global_offset, box.local_chunk_shape)
                )
                assert torch.equal(stored[index], box.data.reshape(box.local_chunk_shape)), name
                covered += box.data.numel()
                box.data.add_(1.0)  # the boxes alias the slice: loading writes in place
            assert torch.equal(piece, flat[start:stop] + 1.0)
            merged = sh.merge_fn([b.data for b in boxes])
            assert merged.data_ptr() == piece.data_ptr() and merged.numel() == piece.numel()
        assert covered == numel
    return True


def test_grouped_weight_slices_map_to_the_stored_layout():
    assert all(run_distributed(_grouped_slices_match_layout, world_size=4, tp=2, ep=2))


# ---------------------------------------------------------------------------------------------
# RNG states at expert parallelism


def _rng_cells():
    import argparse

    from megatron.training.checkpoint import checkpointing_dist
    from megatron.training.global_vars import destroy_global_vars, set_args

    destroy_global_vars()
    set_args(argparse.Namespace(data_parallel_random_init=False))
    try:
        ours = checkpointing_dist._sharded_rng_state([{}])
        megatron = checkpointing_dist._sharded_rng_state([{}], with_expert_axis=False)
        # A checkpoint written with Megatron's (pp, tp) grid is read from its (pp, tp) cell.
        fallback = checkpointing_dist._rng_request({megatron.unique_key})
        own = checkpointing_dist._rng_request({ours.unique_key, megatron.unique_key})
        return ours.unique_key, ours.replica_id, fallback.unique_key, own.unique_key
    finally:
        destroy_global_vars()


def test_rng_state_cells_per_expert_parallel_rank():
    outs = run_distributed(_rng_cells, world_size=4, tp=1, ep=2)
    # DP 4 = EP 2 x expert-DP 2; rank order tp-cp-ep-dp: ep = rank % 2, expert-DP = rank // 2.
    for rank, (key, replica_id, fallback, own) in enumerate(outs):
        assert key == own == f'rng_state/shard_0.0.{rank % 2}_1.1.2'
        assert replica_id == rank // 2
        assert fallback == 'rng_state/shard_0.0_1.1'
