"""Context parallelism of Mamba layers (the sequence -> heads all-to-all of the mixer) equals the
serial model on the full sequence: a hybrid MambaModel (M*-M) at CP2, with the groups split over
the CP ranks or replicated, with and without packed documents, and the mixer (with documents)
at TP2 x CP2 (with and without SP) and CP4. Packed sequences (--sft's per-sequence split, with
padding, RoPE and the THD attention): the hybrid at CP2 equals the serial one, and a token
changed in one sequence leaves the other sequences' logits unchanged. Each CP rank gets the
load-balanced slices (chunks r and 2cp-1-r); its per-token losses / outputs are its slice of
the serial ones, and the parameter gradients summed over the CP ranks (what the data-parallel
reduction over dp x cp does) equal the serial gradients."""

import pytest
import torch

from tests.unit_tests.dist_utils import run_distributed

S, B, H = 16, 2, 32
PATTERN = 'M*-M'


def _config(**kw):
    from megatron.core.transformer.transformer_config import TransformerConfig

    base = dict(
        num_layers=len(PATTERN),
        hidden_size=H,
        num_attention_heads=4,
        mamba_head_dim=8,
        mamba_num_groups=2,
        mamba_state_dim=4,
        normalization='RMSNorm',
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=True,
    )
    base.update(kw)
    return TransformerConfig(**base)


def _value(name, shape):
    """A deterministic tensor per name (layout-free, so every run draws the same)."""
    import zlib

    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    t = torch.randn(shape, generator=gen)
    if name.endswith('A_log'):
        return torch.log(torch.rand(shape, generator=gen) * 7 + 1)
    if 'norm' in name and name.endswith('weight'):
        return 1.0 + 0.2 * t
    if 'conv1d.weight' in name:
        return t
    return 0.3 * t


def _hybrid_model(config, position_embedding_type):
    """The PATTERN hybrid with the deterministic weights of _value (equal on every layout)."""
    from megatron.core.models.mamba import MambaModel
    from megatron.core.models.mamba.mamba_layer_specs import mamba_stack_spec

    model = MambaModel(
        config,
        mamba_stack_spec,
        vocab_size=64,
        max_sequence_length=S,
        hybrid_override_pattern=PATTERN,
        position_embedding_type=position_embedding_type,
    )
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(_value(name, list(p.shape)))
    return model


def _documents():
    """Global document ids [B, S]: boundaries inside chunks and on a chunk border."""
    starts = [[0, 3, 8, 13], [0, 6]]
    ids = torch.zeros(B, S, dtype=torch.long)
    for row, row_starts in enumerate(starts):
        for start in row_starts[1:]:
            ids[row, start:] += 1
    return ids


def _assert_grad_close(got, expected, name):
    """fp32 reduction noise scales with the largest gradient entry."""
    atol = 1e-5 * max(expected.abs().max().item(), 1.0)
    torch.testing.assert_close(got, expected, atol=atol, rtol=1e-4, msg=name)


def _cp_slice(t, dim):
    from megatron.core import parallel_state as mpu
    from megatron.core.transformer.context_parallel import slice_for_cp_rank

    cp = mpu.get_context_parallel_world_size()
    return slice_for_cp_rank(t, dim, cp, mpu.get_context_parallel_rank())


def _sum_over_cp(grads):
    from megatron.core import parallel_state as mpu

    for g in grads.values():
        torch.distributed.all_reduce(g, group=mpu.get_context_parallel_group())
    return grads


def _model_rank(groups, documents):
    from megatron.core import parallel_state as mpu

    cp = mpu.get_context_parallel_world_size()
    config = _config(mamba_num_groups=groups, context_parallel_size=cp)
    model = _hybrid_model(config, 'none')
    tokens = (torch.arange(B * S).view(B, S) * 7) % 64
    labels = (tokens * 3 + 1) % 64
    seq_idx = _cp_slice(_documents(), 1) if documents else None
    loss = model(_cp_slice(tokens, 1), None, None, labels=_cp_slice(labels, 1), seq_idx=seq_idx)
    loss.sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return dict(loss=loss.detach(), grads=_sum_over_cp(grads))


def _gathered(results, key, dim):
    from megatron.core.transformer.context_parallel.layout import gather_from_cp_layout

    return gather_from_cp_layout([r[key] for r in results], dim)


@pytest.mark.parametrize(
    'groups,documents',
    [(2, False), (1, False), (2, True)],
    ids=['groups-split', 'groups-replicated', 'documents'],
)
def test_hybrid_model_cp2_equals_serial(groups, documents):
    (ref,) = run_distributed(_model_rank, world_size=1, args=(groups, documents))
    ranks = run_distributed(_model_rank, world_size=2, cp=2, args=(groups, documents))
    loss = _gathered(ranks, 'loss', 1)  # [b, s] in sequence order
    torch.testing.assert_close(loss, ref['loss'], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ranks[0]['grads'], ranks[1]['grads'])
    for name, expected in ref['grads'].items():
        _assert_grad_close(ranks[0]['grads'][name], expected, name)


def _mixer_rank(sp=False):
    from megatron.core import parallel_state as mpu
    from megatron.core.ssm.layer_norm_linear import LayerNormColumnParallelLinear
    from megatron.core.ssm.mamba_mixer import (
        MambaMixer,
        MambaMixerSubmodules,
        segment_sizes,
        split_conv,
        split_in_proj,
    )
    from megatron.core.tensor_parallel.layers import RowParallelLinear

    tp = mpu.get_tensor_model_parallel_world_size()
    config = _config(tensor_model_parallel_size=tp, sequence_parallel=sp)
    mixer = MambaMixer(
        config,
        MambaMixerSubmodules(in_proj=LayerNormColumnParallelLinear, out_proj=RowParallelLinear),
        d_model=H,
        chunk_size=4,
        layer_number=1,
    )
    rank = mpu.get_tensor_model_parallel_rank()
    sizes = segment_sizes(config, H)
    with torch.no_grad():
        for name, p in mixer.named_parameters():
            shape = list(p.shape)
            if name == 'out_proj.weight':
                shape[1] *= tp
            elif getattr(p, 'tensor_model_parallel', False):
                shape[0] *= tp
            full = _value(name, shape)
            if name == 'in_proj.weight':
                full = split_in_proj(full, sizes, tp, rank)
            elif name.startswith('conv1d.'):
                full = split_conv(full, sizes[1:4], tp, rank)
            elif name == 'out_proj.weight':
                full = full.chunk(tp, dim=1)[rank]
            elif getattr(p, 'tensor_model_parallel', False):
                full = full.chunk(tp, dim=0)[rank]
            p.copy_(full)
    x = _cp_slice(_value('input', [S, B, H]), 0)
    w = _cp_slice(_value('output_weight', [S, B, H]), 0)
    if sp:  # [s/cp/tp, b, H]: the TP ranks split this CP rank's tokens
        x, w = x.chunk(tp, dim=0)[rank], w.chunk(tp, dim=0)[rank]
    x = x.requires_grad_(True)
    out, _ = mixer(x, seq_idx=_cp_slice(_documents(), 1))
    (out * w).sum().backward()
    grads = {n: p.grad.clone() for n, p in mixer.named_parameters()}
    return dict(out=out.detach(), x_grad=x.grad, grads=_sum_over_cp(grads), sizes=sizes)


@pytest.mark.parametrize(
    'tp,cp,sp', [(2, 2, False), (2, 2, True), (1, 4, False)], ids=['tp2-cp2', 'tp2-sp-cp2', 'cp4']
)
def test_mixer_tp_cp_equals_serial(tp, cp, sp):
    """Groups per TP rank (1 at TP2, 2 at TP1) below the CP size: B / C replicated over CP
    ranks (at CP4 CP ranks 0, 1 use group 0 and ranks 2, 3 group 1)."""
    from megatron.core.ssm.mamba_mixer import merge_segments

    (ref,) = run_distributed(_mixer_rank, world_size=1)
    ranks = run_distributed(_mixer_rank, world_size=4, tp=tp, cp=cp, args=(sp,))
    # Rank order: tp fastest; by_cp[j] = TP rank 0 of CP rank j (its tokens joined over TP
    # under SP).
    by_cp = ranks[::tp]
    if sp:
        by_cp = [
            {
                key: torch.cat([r[key] for r in ranks[j * tp : (j + 1) * tp]])
                for key in ('out', 'x_grad')
            }
            for j in range(cp)
        ]
    else:
        torch.testing.assert_close(ranks[0]['out'], ranks[tp - 1]['out'])
    torch.testing.assert_close(_gathered(by_cp, 'out', 0), ref['out'], atol=1e-5, rtol=1e-5)
    x_grad = _gathered(by_cp, 'x_grad', 0)
    torch.testing.assert_close(x_grad, ref['x_grad'], atol=1e-5, rtol=1e-5)
    sizes = ref['sizes']
    shards = [r['grads'] for r in ranks[:tp]]
    for name, expected in ref['grads'].items():
        parts = [g[name] for g in shards]
        if name == 'in_proj.weight':
            got = merge_segments(parts, sizes)
        elif name.startswith('conv1d.'):
            got = merge_segments(parts, sizes[1:4])
        elif name == 'out_proj.weight':
            got = torch.cat(parts, dim=1)
        elif name == 'in_proj.layer_norm_weight':
            # Replicated over TP: partial sums per token slice under SP.
            got = sum(parts) if sp else parts[0]
        else:
            got = torch.cat(parts, dim=0)
        _assert_grad_close(got, expected, name)


def _eod_rank():
    from megatron.core import parallel_state as mpu
    from megatron.core.models.mamba.mamba_model import seq_idx_from_eod

    tokens = (torch.arange(B * S).view(B, S) * 5) % 7  # eod = 0 at varied positions
    local = seq_idx_from_eod(_cp_slice(tokens, 1), 0, mpu.get_context_parallel_group())
    return local, _cp_slice(seq_idx_from_eod(tokens, 0), 1)


def test_seq_idx_from_eod_counts_over_the_whole_row():
    for local, expected in run_distributed(_eod_rank, world_size=2, cp=2):
        assert expected.max() > 1
        torch.testing.assert_close(local, expected, atol=0, rtol=0)


def test_cp_head_and_group_refusals():
    from megatron.core.ssm.mamba_mixer import check_mamba_dims

    # 8 heads, 2 groups: CP4 takes 2 heads per rank and replicates each group over 2 ranks.
    check_mamba_dims(_config(), H, 1, 4)
    with pytest.raises(ValueError, match=r"heads per tensor-parallel rank \(8 / 2 = 4\).*\(8\)"):
        check_mamba_dims(_config(), H, 2, 8)
    twelve = dict(mamba_num_heads=12)
    with pytest.raises(ValueError, match=r"context_parallel_size \(4\) must be divisible by .*= 3"):
        check_mamba_dims(_config(mamba_num_groups=3, **twelve), H, 1, 4)
    with pytest.raises(
        ValueError, match=r"groups per .*\(6 / 1 = 6\).*context_parallel_size \(4\)"
    ):
        check_mamba_dims(_config(mamba_num_groups=6, **twelve), H, 1, 4)


# Packed sequences (--sft) under CP: each sequence is split on its own into 2cp chunks
# (context_parallel/packed.py), so the mixers reorder by the segment offsets and the attention
# layers run the THD CP scheme on the same PackedSeqParams. Per row: (padded, real) lengths,
# every padded length a multiple of 2 x cp = 4; one row has padding inside its first sequence.
PACKED = [[(4, 3), (8, 8), (4, 2)], [(12, 10), (4, 4)]]


def _packed_batch(tokens):
    """The dataset's packed fields for PACKED: [B, S] token fields, cu_seqlens [B, S + 1]."""
    cu = torch.full((B, S + 1), S, dtype=torch.int32)
    unpadded = torch.zeros(B, S + 1, dtype=torch.int32)
    loss_mask = torch.zeros(B, S)
    positions = torch.zeros(B, S, dtype=torch.long)
    for row, sequences in enumerate(PACKED):
        start, real_total = 0, 0
        for k, (padded, real) in enumerate(sequences):
            cu[row, k] = start
            loss_mask[row, start : start + real] = 1.0
            positions[row, start : start + padded] = torch.arange(padded)
            real_total += real
            unpadded[row, k + 1 :] = real_total
            start += padded
    labels = (tokens * 3 + 1) % 64
    return dict(
        tokens=tokens,
        labels=labels,
        loss_mask=loss_mask,
        position_ids=positions,
        cu_seqlens=cu,
        cu_seqlens_unpadded=unpadded,
    )


def _packed_rank(tokens, slow_decay=False):
    """This CP rank's per-token losses (or logits without labels), loss-masked gradients
    summed over CP and the global positions it holds, of the hybrid (RoPE) on PACKED."""
    from megatron.core import parallel_state as mpu
    from megatron.core.transformer.context_parallel.packed import (
        get_thd_batch_on_this_cp_rank,
        sample_boundaries,
        thd_partitioned_indices,
    )

    cp, rank = mpu.get_context_parallel_world_size(), mpu.get_context_parallel_rank()
    model = _hybrid_model(_config(context_parallel_size=cp), 'rope')
    with torch.no_grad():
        for name, p in model.named_parameters():
            if slow_decay and name.endswith('A_log'):
                p.fill_(-3.0)  # A = -0.05: a leaked state would still reach later tokens
    full = _packed_batch(tokens)
    batch, packed = get_thd_batch_on_this_cp_rank(dict(full), cp, rank)
    held = [
        thd_partitioned_indices(sample_boundaries(row, S), cp, rank) for row in full['cu_seqlens']
    ]
    if slow_decay:
        logits = model(batch['tokens'], batch['position_ids'], None, packed_seq_params=packed)
        return dict(logits=logits.detach(), held=torch.tensor(held))
    loss = model(
        batch['tokens'],
        batch['position_ids'],
        None,
        labels=batch['labels'],
        packed_seq_params=packed,
    )
    (loss * batch['loss_mask']).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return dict(
        loss=loss.detach(),
        mask=batch['loss_mask'],
        held=torch.tensor(held),
        grads=_sum_over_cp(grads),
    )


def _packed_tokens():
    return (torch.arange(B * S).view(B, S) * 7) % 64


def test_hybrid_model_cp2_packed_sequences_equals_serial():
    tokens = _packed_tokens()
    (ref,) = run_distributed(_packed_rank, world_size=1, args=(tokens,))
    ranks = run_distributed(_packed_rank, world_size=2, cp=2, args=(tokens,))
    for r in ranks:
        expected = torch.gather(ref['loss'], 1, r['held'])
        real = r['mask'].bool()
        torch.testing.assert_close(r['loss'][real], expected[real], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ranks[0]['grads'], ranks[1]['grads'])
    for name, expected in ref['grads'].items():
        _assert_grad_close(ranks[0]['grads'][name], expected, name)


def test_cp2_packed_state_stops_at_the_sequence_boundary():
    """A token changed in row 0's first sequence (positions 0-3) changes that sequence's later
    logits and nothing after it, on both CP ranks (slowly decaying states)."""
    tokens = _packed_tokens()
    changed = tokens.clone()
    changed[0, 1] = (changed[0, 1] + 5) % 64
    base = run_distributed(_packed_rank, world_size=2, cp=2, args=(tokens, True))
    edit = run_distributed(_packed_rank, world_size=2, cp=2, args=(changed, True))
    for a, b in zip(base, edit):
        first = a['held'][0] < 4  # row 0's first sequence
        after = (a['held'][0] >= 2) & first
        assert (a['logits'][0][after] - b['logits'][0][after]).abs().max() > 1e-3
        torch.testing.assert_close(
            a["logits"][0][~first], b["logits"][0][~first], atol=1e-5, rtol=0
        )
        torch.testing.assert_close(a["logits"][1], b["logits"][1], atol=1e-5, rtol=0)


def _inference_rank():
    from megatron.core.inference_params import InferenceParams
    from megatron.core.ssm.layer_norm_linear import LayerNormColumnParallelLinear
    from megatron.core.ssm.mamba_mixer import MambaMixer, MambaMixerSubmodules
    from megatron.core.tensor_parallel.layers import RowParallelLinear

    mixer = MambaMixer(
        _config(),
        MambaMixerSubmodules(in_proj=LayerNormColumnParallelLinear, out_proj=RowParallelLinear),
        d_model=H,
        layer_number=1,
    )
    with pytest.raises(ValueError) as info:
        mixer(torch.zeros(S // 2, B, H), inference_params=InferenceParams(B, S))
    return str(info.value)


def test_cp_inference_refused_in_one_line():
    for message in run_distributed(_inference_rank, world_size=2, cp=2):
        assert message == (
            "--context-parallel-size (2) > 1 is not supported for Mamba inference (context "
            "parallelism is a training layout): use 1"
        )
