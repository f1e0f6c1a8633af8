"""`--test-mode` (TransformerConfig.test_mode): self-attention checks in every forward that the
query/key layernorm parameters are bit-identical on all tensor- and data-parallel ranks.

Four gloo ranks as TP=2 x DP=2. Identical parameters pass (LayerNorm with bias, and RMSNorm,
which has no bias and which Megatron's check cannot stack); a parameter changed on one rank makes
the forward raise ReplicaMismatchError on every rank of the group that sees it, naming the
parameter and both ranks; without test_mode the same divergence goes unnoticed.
"""

import pytest
import torch

from tests.unit_tests.dist_utils import run_distributed

SQ, B, H, NP = 4, 2, 32, 4


def _attention(normalization, test_mode):
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=1,
        hidden_size=H,
        num_attention_heads=NP,
        normalization=normalization,
        qk_layernorm=True,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
        use_cpu_initialization=True,
        test_mode=test_mode,
    )
    spec = get_gpt_layer_local_spec(qk_layernorm=True).submodules.self_attention
    torch.manual_seed(5)  # the same replicated parameters on every rank
    return build_module(spec, config=config, layer_number=3)


def _forward(attn):
    x = torch.randn(SQ, B, H, generator=torch.Generator().manual_seed(1))
    out, _ = attn(x, attention_mask=None)
    return out


def _check(normalization, corrupt_rank, test_mode=True, full_forward=True):
    from megatron.core.transformer.replica_consistency import ReplicaMismatchError

    attn = _attention(normalization, test_mode)
    if torch.distributed.get_rank() == corrupt_rank:
        with torch.no_grad():
            attn.k_layernorm.weight[1] += 1e-6
    try:
        # A rank outside the diverged rank's groups would go on to the output projection's
        # all-reduce alone: the 4-rank case runs the check by itself.
        _forward(attn) if full_forward else attn.run_realtime_tests()
    except ReplicaMismatchError as error:
        return str(error)
    return None


@pytest.mark.parametrize('normalization', ['LayerNorm', 'RMSNorm'])
def test_identical_replicas_pass(normalization):
    assert run_distributed(_check, world_size=4, tp=2, args=(normalization, None)) == [None] * 4


def test_forward_raises_on_a_diverged_parameter():
    messages = run_distributed(_check, world_size=2, tp=2, args=('LayerNorm', 1))
    assert 'k_layernorm.weight differs between tensor-parallel ranks 1 and 0' in messages[0]
    assert 'k_layernorm.weight differs between tensor-parallel ranks 0 and 1' in messages[1]


def test_diverged_parameter_is_reported_by_its_groups():
    # Global rank 3 is TP rank 1 of TP group {2, 3} and DP rank 1 of DP group {1, 3}.
    messages = run_distributed(
        _check, world_size=4, tp=2, args=('RMSNorm', 3), kwargs={'full_forward': False}
    )
    assert messages[0] is None  # shares neither group with rank 3
    for rank in (1, 2, 3):
        assert messages[rank] is not None
        assert 'layer 3 self_attention.k_layernorm.weight differs between' in messages[rank]
    assert 'tensor-parallel ranks 1 and 0' in messages[2]
    assert 'data-parallel ranks 1 and 0' in messages[1]
    assert 'tensor-parallel ranks 0 and 1' in messages[3]


def test_without_test_mode_nothing_is_checked():
    assert (
        run_distributed(
            _check, world_size=4, tp=2, args=('RMSNorm', 3), kwargs={'test_mode': False}
        )
        == [None] * 4
    )
