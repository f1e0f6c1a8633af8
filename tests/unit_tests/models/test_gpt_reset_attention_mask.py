"""Causal GPT layers ignore the dataloader's mask and run fused attention; with
--reset-attention-mask, pretrain_gpt.py builds the self attention with an arbitrary mask type so
the per-document mask is applied exactly: two documents packed in one sample give the same logits
as each document run alone (positions reset at the document boundary)."""

import os
import sys

import torch

from tests.unit_tests.dist_utils import run_distributed

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
DOC = 8


def _packed_vs_alone():
    sys.path.insert(0, REPO)
    import pretrain_gpt
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig
    from tests.unit_tests.models.gpt_test_utils import gpt2_like_kwargs

    spec = get_gpt_layer_local_spec()
    exact = pretrain_gpt._with_exact_attention_mask(spec)
    mask_types = (
        spec.submodules.self_attention.params['attn_mask_type'],
        exact.submodules.self_attention.params['attn_mask_type'],
    )
    assert mask_types == (AttnMaskType.causal, AttnMaskType.arbitrary), mask_types

    def build(layer_spec):
        model_parallel_cuda_manual_seed(5)
        torch.manual_seed(5)
        config = TransformerConfig(**gpt2_like_kwargs())
        return GPTModel(config, layer_spec, vocab_size=64, max_sequence_length=2 * DOC).eval()

    causal_model, exact_model = build(spec), build(exact)
    exact_model.load_state_dict(causal_model.state_dict())
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 64, (1, 2 * DOC), generator=g)
    positions = torch.arange(DOC).repeat(2).unsqueeze(0)  # reset at the boundary
    mask = torch.triu(torch.ones(2 * DOC, 2 * DOC, dtype=torch.bool), 1)
    mask[DOC:, :DOC] = True  # the second document does not see the first
    mask = mask.view(1, 1, 2 * DOC, 2 * DOC)
    with torch.no_grad():
        packed = exact_model(tokens, positions, mask)
        ignored = causal_model(tokens, positions, mask)
        alone = torch.cat(
            [
                causal_model(tokens[:, :DOC], positions[:, :DOC], None),
                causal_model(tokens[:, DOC:], positions[:, DOC:], None),
            ],
            dim=1,
        )
    return packed, ignored, alone


def test_reset_attention_mask_applies_per_document_mask():
    packed, ignored, alone = run_distributed(_packed_vs_alone, 1)[0]
    torch.testing.assert_close(packed, alone, atol=1e-5, rtol=1e-5)
    # The causal layer ignored the per-document mask: the second document saw the first.
    torch.testing.assert_close(ignored[:, :DOC], alone[:, :DOC], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(ignored[:, DOC:], alone[:, DOC:], atol=1e-3)
