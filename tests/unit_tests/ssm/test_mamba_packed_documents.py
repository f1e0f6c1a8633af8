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
