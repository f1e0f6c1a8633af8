"""A torch_dist checkpoint written by megatron-core 0.8.0 itself loads here and gives its logits.

fixtures/mcore08_gpt was written once by fixtures/make_mcore08_fixture.py with the
megatron-core 0.8.0 wheel (a tiny GPTModel, local spec, tied embeddings, one CPU process) and
holds the logits that model computed for fixed tokens. Our GPTModel of the same configuration
loads it through its own sharded_state_dict at TP1 x DP2 and at TP2, and reproduces the logits.
"""

import json
import os

import pytest
import torch

from tests.unit_tests.dist_utils import run_distributed

FIXTURE = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'fixtures', 'mcore08_gpt')


def _logits_after_load():
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig
    from tests.unit_tests.models.gpt_test_utils import gather_logits

    with open(os.path.join(FIXTURE, 'config.json')) as f:
        spec = json.load(f)
    tp = parallel_state.get_tensor_model_parallel_world_size()
    torch.manual_seed(99)  # other initial weights than the fixture's
    model = GPTModel(
        config=TransformerConfig(tensor_model_parallel_size=tp, **spec['config']),
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=spec['vocab_size'],
        max_sequence_length=spec['seq'],
        share_embeddings_and_output_weights=True,
        position_embedding_type='learned_absolute',
    )
    dist_checkpointing.load(model.sharded_state_dict(), os.path.join(FIXTURE, 'iter_0000001'))
    expected = torch.load(os.path.join(FIXTURE, 'expected.pt'), weights_only=True)
    model.eval()
    with torch.no_grad():
        logits = model(expected['tokens'], None, None)
    return gather_logits(logits), expected['logits']


@pytest.mark.parametrize('tp', [1, 2])
def test_megatron_core_080_checkpoint_loads_with_same_logits(tp):
    for logits, expected in run_distributed(_logits_after_load, world_size=2, tp=tp):
        assert logits.shape == expected.shape
        torch.testing.assert_close(logits, expected, rtol=0, atol=1e-5)
