"""The conv / SSM state caches: a prompt prefilled through InferenceParams, then tokens fed one
at a time, gives the logits of one full-sequence forward (hybrid model, attention KV cache in
the same dict), for prompts shorter and longer than the conv width."""

import pytest
import torch

from tests.unit_tests.dist_utils import run_distributed


def _decode_rank(prompt_len):
    from megatron.core.inference_params import InferenceParams
    from megatron.core.models.mamba import MambaModel
    from megatron.core.models.mamba.mamba_layer_specs import mamba_stack_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=3, hidden_size=32, num_attention_heads=4, mamba_head_dim=8,
        mamba_num_groups=2, mamba_state_dim=4, normalization='RMSNorm', add_bias_linear=False,
        hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True,
    )  # fmt: skip
    model = MambaModel(
        config, mamba_stack_spec, vocab_size=64, max_sequence_length=32,
        hybrid_override_pattern='M*M', position_embedding_type='rope',
    )  # fmt: skip
    model.eval()
    tokens = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model(tokens, None, None)
        params = InferenceParams(max_batch_size=2, max_sequence_length=12)
        steps = [model(tokens[:, :prompt_len], None, None, inference_params=params)]
        params.sequence_len_offset += prompt_len
        for t in range(prompt_len, 12):
            steps.append(model(tokens[:, t : t + 1], None, None, inference_params=params))
            params.sequence_len_offset += 1
    return dict(
        full=full, incremental=torch.cat(steps, dim=1), cached=sorted(params.key_value_memory_dict)
    )


@pytest.mark.parametrize('prompt_len', [2, 7])
def test_incremental_decode_equals_full_forward(prompt_len):
    (r,) = run_distributed(_decode_rank, world_size=1, args=(prompt_len,))
    assert r['cached'] == [1, 2, 3]  # two Mamba states and one KV cache, by layer number
    torch.testing.assert_close(r['incremental'], r['full'], atol=1e-5, rtol=1e-5)
