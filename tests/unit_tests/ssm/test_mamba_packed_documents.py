"""Packed documents: with the document ids of --reset-attention-mask (a new document after
each EOD token), a hybrid MambaModel's logits on a packed row equal those of each document run
on its own, so neither the Mamba conv / scan state nor attention crosses a boundary. Without
the ids the state does leak (the core_r0.8.0 behaviour)."""

import torch

from tests.unit_tests.dist_utils import run_distributed

EOD = 0


def _causal(s, b=1):
    return torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1).expand(b, 1, s, s)


def _packed_rank():
    from megatron.core.models.mamba import MambaModel
    from megatron.core.models.mamba.mamba_layer_specs import get_mamba_stack_spec
    from megatron.core.models.mamba.mamba_model import seq_idx_from_eod
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=3, hidden_size=32, num_attention_heads=4, mamba_head_dim=8,
        mamba_num_groups=2, mamba_state_dim=4, normalization='RMSNorm', add_bias_linear=False,
        hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True,
    )  # fmt: skip
    model = MambaModel(
        config,
        get_mamba_stack_spec(AttnMaskType.arbitrary),
        vocab_size=64,
        max_sequence_length=32,
        hybrid_override_pattern='M*M',
        position_embedding_type='none',
    )
    model.eval()
    gen = torch.Generator().manual_seed(0)
    first = torch.randint(1, 64, (1, 7), generator=gen)
    first[0, -1] = EOD
    second = torch.randint(1, 64, (1, 10), generator=gen)
    packed = torch.cat([first, second], dim=1)  # [1, 17]
    seq_idx = seq_idx_from_eod(packed, EOD)
    # The per-document causal mask --reset-attention-mask gives attention layers.
    mask = _causal(17).clone()
    mask[..., 7:, :7] = True
    with torch.no_grad():
        out = model(packed, None, mask, seq_idx=seq_idx)
        leaky = model(packed, None, mask)
        alone = torch.cat([model(first, None, _causal(7)), model(second, None, _causal(10))], dim=1)
    return dict(out=out, leaky=leaky, alone=alone, seq_idx=seq_idx)


def test_packed_documents_do_not_leak():
    (r,) = run_distributed(_packed_rank, world_size=1)
    assert r['seq_idx'].tolist() == [[0] * 7 + [1] * 10]
    torch.testing.assert_close(r['out'], r['alone'], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(r['leaky'][:, 7:], r['alone'][:, 7:], atol=1e-3)


def _sft_rank():
    """--sft packing: rows of packed conversations (PackedSeqParams, positions restarting per
    conversation) on a hybrid with RoPE; the per-token loss of each packed row equals that of
    every conversation run on its own."""
    from megatron.core.models.mamba import MambaModel
    from megatron.core.models.mamba.mamba_layer_specs import mamba_stack_spec
    from megatron.core.packed_seq_params import packed_seq_params_from_samples
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.manual_seed(0)
    config = TransformerConfig(
        num_layers=4, hidden_size=32, num_attention_heads=4, mamba_head_dim=8,
        mamba_num_groups=2, mamba_state_dim=4, normalization='RMSNorm', add_bias_linear=False,
        hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True,
    )  # fmt: skip
    model = MambaModel(
        config, mamba_stack_spec, vocab_size=64, max_sequence_length=32,
        hybrid_override_pattern='M*-M', position_embedding_type='rope',
    )  # fmt: skip
    model.eval()
    s, lengths = 16, [[7, 9], [10, 6]]  # two rows of two conversations
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(1, 64, (2, s), generator=gen)
    labels = torch.randint(0, 64, (2, s), generator=gen)
    position_ids = torch.cat([torch.cat([torch.arange(n) for n in row])[None] for row in lengths])
    # The dataset's layout: per row its segment starts, right-filled with s to s + 1 entries.
    cu = torch.full((2, s + 1), s, dtype=torch.int32)
    cu[:, 0] = 0
    cu[:, 1] = torch.tensor([row[0] for row in lengths])
    packed = packed_seq_params_from_samples(cu, torch.tensor([max(r) for r in lengths]))
    with torch.no_grad():
        loss = model(tokens, position_ids, None, labels=labels, packed_seq_params=packed)
        leaky = model(tokens, position_ids, None, labels=labels)
        alone = []
        for i, row in enumerate(lengths):
            pieces, start = [], 0
            for n in row:
                seg = slice(start, start + n)
                pieces.append(
                    model(tokens[i : i + 1, seg], None, None, labels=labels[i : i + 1, seg])
                )
                start += n
            alone.append(torch.cat(pieces, dim=1))
    return dict(loss=loss, leaky=leaky, alone=torch.cat(alone))


def test_sft_packed_conversations_equal_separate_losses():
    (r,) = run_distributed(_sft_rank, world_size=1)
    torch.testing.assert_close(r['loss'], r['alone'], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(r['loss'].sum(), r['alone'].sum(), atol=1e-4, rtol=1e-6)
    # Without the boundaries the second conversation of each row sees the first one.
    assert not torch.allclose(r['leaky'][0, 7:], r['alone'][0, 7:], atol=1e-3)
