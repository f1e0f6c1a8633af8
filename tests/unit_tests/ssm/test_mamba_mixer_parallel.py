"""The Mamba mixer split over 2 tensor-parallel ranks (with and without sequence parallelism)
equals the unsharded mixer: outputs, the input gradient and every parameter gradient (the
in_proj and conv weights sharded per segment z | x | B | C | dt). Full activation recompute of
a hybrid MambaModel gives the same loss and gradients as no recompute."""

import pytest
import torch

from tests.unit_tests.dist_utils import run_distributed

S, B, H = 12, 2, 32


def _config(**kw):
    from megatron.core.transformer.transformer_config import TransformerConfig

    base = dict(
        num_layers=2,
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


def _global_tensor(name, shape):
    import zlib

    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    t = torch.randn(shape, generator=gen)
    if name in ('A_log',):
        return torch.log(torch.rand(shape, generator=gen) * 7 + 1)
    if name.endswith('norm.weight') or name.endswith('layer_norm_weight'):
        return 1.0 + 0.2 * t
    return 0.3 * t


def _mixer_rank(tp, sp):
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
            full = _global_tensor(name, shape)
            if name == 'in_proj.weight':
                full = split_in_proj(full, sizes, tp, rank)
            elif name.startswith('conv1d.'):
                full = split_conv(full, sizes[1:4], tp, rank)
            elif name == 'out_proj.weight':
                full = full.chunk(tp, dim=1)[rank]
            elif getattr(p, 'tensor_model_parallel', False):
                full = full.chunk(tp, dim=0)[rank]
            p.copy_(full)
    x = _global_tensor('input', [S, B, H])
    w = _global_tensor('output_weight', [S, B, H])
    if sp:
        x, w = x.chunk(tp, dim=0)[rank], w.chunk(tp, dim=0)[rank]
    x = x.clone().requires_grad_(True)
    out, bias = mixer(x)
    assert bias is None
    (out * w).sum().backward()
    return dict(
        out=out.detach(),
        x_grad=x.grad,
        grads={n: p.grad.clone() for n, p in mixer.named_parameters()},
        sizes=sizes,
    )


@pytest.mark.parametrize('sp', [False, True])
def test_tp2_mixer_equals_unsharded(sp):
    from megatron.core.ssm.mamba_mixer import merge_segments

    (ref,) = run_distributed(_mixer_rank, world_size=1, args=(1, False))
    r0, r1 = run_distributed(_mixer_rank, world_size=2, tp=2, args=(2, sp))
    if sp:
        out = torch.cat([r0['out'], r1['out']], dim=0)
        x_grad = torch.cat([r0['x_grad'], r1['x_grad']], dim=0)
    else:
        torch.testing.assert_close(r0['out'], r1['out'])
        out, x_grad = r0['out'], r0['x_grad']
    torch.testing.assert_close(out, ref['out'], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(x_grad, ref['x_grad'], atol=1e-5, rtol=1e-5)
    sizes = ref['sizes']
    g0, g1 = r0['grads'], r1['grads']
    for name, expected in ref['grads'].items():
        if name == 'in_proj.weight':
            got = merge_segments([g0[name], g1[name]], sizes)
        elif name.startswith('conv1d.'):
            got = merge_segments([g0[name], g1[name]], sizes[1:4])
        elif name == 'out_proj.weight':
            got = torch.cat([g0[name], g1[name]], dim=1)
        elif name == 'in_proj.layer_norm_weight':
            # Replicated: full on every rank, or partial sums per sequence slice under SP.
            got = g0[name] + g1[name] if sp else g0[name]
        else:
            got = torch.cat([g0[name], g1[name]], dim=0)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5, msg=name)


def _recompute_rank():
    from megatron.core.models.mamba import MambaModel
    from megatron.core.models.mamba.mamba_layer_specs import mamba_stack_spec

    results, state = [], None
    for recompute in (False, True):
        kw = dict(num_layers=3)
        if recompute:
            kw.update(recompute_granularity='full', recompute_method='uniform',
                      recompute_num_layers=2)  # fmt: skip
        torch.manual_seed(5)
        model = MambaModel(
            _config(**kw),
            mamba_stack_spec,
            vocab_size=64,
            max_sequence_length=S,
            hybrid_override_pattern='M*-',
            position_embedding_type='none',
        )
        if state is None:
            state = model.state_dict()
        else:
            model.load_state_dict(state)
        calls = []
        model.decoder.layers[0].mixer.register_forward_hook(lambda *_: calls.append(1))
        tokens = torch.arange(B * S).view(B, S) % 64
        loss = model(tokens, None, None, labels=(tokens + 1) % 64)
        loss.sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        results.append((loss.detach(), grads, len(calls)))
    return results


def test_full_recompute_equals_no_recompute():
    ((plain, recomputed),) = run_distributed(_recompute_rank, world_size=1)
    # The recomputed mixer runs again in backward.
    assert (plain[2], recomputed[2]) == (1, 2)
    torch.testing.assert_close(recomputed[0], plain[0], atol=0, rtol=0)
    assert plain[1].keys() == recomputed[1].keys()
    for name, g in plain[1].items():
        torch.testing.assert_close(recomputed[1][name], g, atol=1e-6, rtol=1e-6, msg=name)
