"""Uneven pipeline splits: --standalone-embedding-stage (stage 0 holds no layer) and later
Megatron's first/last-stage layer counts, in the core arithmetic, the config and the converter."""

import argparse

import pytest
import torch

from megatron.core.transformer.pipeline_layer_split import (
    pipeline_stage_layer_counts,
    pipeline_stage_layer_offset,
)
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.training.checkpoint.checkpoint_conversion import layer_offset


def test_counts_and_offsets():
    assert pipeline_stage_layer_counts(6, 3) == [2, 2, 2]
    assert pipeline_stage_layer_counts(6, 3, first=0) == [0, 3, 3]
    assert pipeline_stage_layer_counts(7, 3, first=1, last=2) == [1, 4, 2]
    assert pipeline_stage_layer_counts(8, 4, last=5) == [1, 1, 1, 5]
    assert [pipeline_stage_layer_offset(6, 3, r, 0, None) for r in range(3)] == [0, 0, 3]
    assert [pipeline_stage_layer_offset(7, 3, r, 1, 2) for r in range(3)] == [0, 1, 5]


@pytest.mark.parametrize(
    'num_layers, pp, first, last, message',
    [
        (6, 1, 0, None, 'needs pipeline_model_parallel_size > 1'),
        (6, 2, 1, 1, 'needs pipeline_model_parallel_size > 2'),
        (5, 3, 0, None, 'must split evenly over the other 2 pipeline stages, got 5'),
        (4, 3, 3, 3, 'got -2'),
        (4, 2, -1, None, 'first_pipeline_num_layers must be >= 0, got -1'),
    ],
)
def test_impossible_splits_are_refused(num_layers, pp, first, last, message):
    with pytest.raises(ValueError, match=message):
        pipeline_stage_layer_counts(num_layers, pp, first, last)


def _config(**kwargs):
    base = dict(
        num_layers=6,
        hidden_size=16,
        num_attention_heads=2,
        pipeline_model_parallel_size=3,
        pipeline_dtype=torch.float32,
    )
    return TransformerConfig(**{**base, **kwargs})


def test_config_checks_the_split():
    assert _config(first_pipeline_num_layers=0).first_pipeline_num_layers == 0
    with pytest.raises(ValueError, match='split evenly'):
        _config(first_pipeline_num_layers=1)
    with pytest.raises(ValueError, match='virtual'):
        _config(
            first_pipeline_num_layers=0,
            pipeline_model_parallel_size=3,
            virtual_pipeline_model_parallel_size=2,
        )


def test_converter_reads_the_split_from_checkpoint_args():
    # A Megatron r0.8 checkpoint records only standalone_embedding_stage.
    r08 = argparse.Namespace(standalone_embedding_stage=True)
    assert [layer_offset(6, 3, r, None, 0, r08) for r in range(3)] == [0, 0, 3]
    ours = argparse.Namespace(
        decoder_first_pipeline_num_layers=None, decoder_last_pipeline_num_layers=4
    )
    assert [layer_offset(8, 3, r, None, 0, ours) for r in range(3)] == [0, 2, 4]
    assert [layer_offset(6, 3, r, None, 0) for r in range(3)] == [0, 2, 4]
