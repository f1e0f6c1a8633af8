"""The surface Megatron core_r0.8.0's pretrain_mamba.py relies on (exercised by
tests/functional_tests/r08_contract/mamba.py, written here) trains at TP=2 with r0.8's required
`--spec` and prints the same losses as this repository's pretrain_mamba.py."""

from tests.functional_tests.test_megatron_r08_scripts import _both_scripts, _losses
from tests.unit_tests.dist_utils import run_distributed


def test_megatron_r08_pretrain_mamba_trains_unchanged(gpt_data_prefix):
    from tests.functional_tests.test_megatron_r08_scripts import _COMMON, MERGES, VOCAB

    argv = _COMMON + [
        '--num-layers', '4', '--seq-length', '16', '--max-position-embeddings', '16',
        '--vocab-file', VOCAB, '--merge-file', MERGES, '--make-vocab-size-divisible-by', '64',
        '--tensor-model-parallel-size', '2', '--hybrid-attention-ratio', '0.25',
        '--hybrid-mlp-ratio', '0.25', '--mamba-head-dim', '16', '--mamba-num-groups', '2',
        '--mamba-state-dim', '16', '--normalization', 'RMSNorm',
        '--position-embedding-type', 'none',
        '--spec', 'megatron.core.models.mamba.mamba_layer_specs', 'mamba_stack_spec',
        '--data-path', gpt_data_prefix,
    ]  # fmt: skip
    outs = run_distributed(_both_scripts, world_size=2, args=('pretrain_mamba', argv), timeout=300)
    megatron_out, ours_out = outs[-1]  # the last rank prints the training log
    losses = _losses(megatron_out)
    assert sorted(losses) == [1, 2, 3], megatron_out[-3000:]
    assert all(0.0 < v < 20.0 for v in losses.values())
    assert losses == _losses(ours_out)
