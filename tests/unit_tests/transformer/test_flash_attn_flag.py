"""--use-flash-attn: the core attention runs as one fused scaled_dot_product_attention call, with
the same results as the unfused path (padding masks; a fully padded row stays finite), attention
dropout inside the kernel drawn from the model-parallel RNG, and the flag reaching the config."""

import torch

from tests.unit_tests.dist_utils import run_distributed

S, B, H, D = 8, 2, 4, 16


def _attention(use_flash_attn, mask_type, dropout=0.0):
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=1,
        hidden_size=H * D,
        num_attention_heads=H,
        attention_dropout=dropout,
        use_flash_attn=use_flash_attn,
    )
    return DotProductAttention(config, 1, mask_type, 'self')


def _inputs():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(S, B, H, D, generator=gen) for _ in range(3))
    # Padding: batch row 1 has 5 real tokens; its padded queries see nothing.
    real = torch.tensor([S, 5])
    pos = torch.arange(S)
    valid = pos[None, :] < real[:, None]  # [b, s]
    mask = ~(valid[:, None, :, None] & valid[:, None, None, :])  # [b, 1, sq, sk], True = masked
    return q, k, v, mask, valid


def _cases():
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer.enums import AttnMaskType

    q, k, v, mask, valid = _inputs()
    out = {}
    for flash in (False, True):
        layer = _attention(flash, AttnMaskType.padding).eval()
        out[('padding', flash)] = layer(q, k, v, mask)
    layer = _attention(True, AttnMaskType.causal, dropout=0.5).train()
    drops = []
    for _ in range(2):
        model_parallel_cuda_manual_seed(123)
        drops.append(layer(q, k, v, None))
    out['dropout'] = drops
    out['no_dropout'] = layer.eval()(q, k, v, None)
    out['valid'] = valid
    return out


def test_fused_attention_matches_the_unfused_path():
    (out,) = run_distributed(_cases, world_size=1)
    plain, fused = out[('padding', False)], out[('padding', True)]
    rows = out['valid'].t()  # [s, b]: queries that see at least one key
    torch.testing.assert_close(fused[rows], plain[rows], rtol=1e-5, atol=1e-5)
    assert torch.isfinite(fused).all()
    first, second = out['dropout']
    torch.testing.assert_close(first, second, rtol=0, atol=0)  # same model-parallel seed
    assert not torch.allclose(first, out['no_dropout'])


def test_flag_reaches_the_transformer_config():
    from megatron.training.arguments import (
        core_transformer_config_from_args,
        parse_args,
        validate_args,
    )

    args = parse_args(
        args_list=(
            '--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 '
            '--max-position-embeddings 16 --micro-batch-size 2 --train-iters 4 --lr 1e-3 '
            '--use-flash-attn'
        ).split()
    )
    args.world_size, args.rank = 1, 0
    assert core_transformer_config_from_args(validate_args(args, {})).use_flash_attn is True
