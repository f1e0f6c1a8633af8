"""ModelParallelConfig field checks."""

import dataclasses

import pytest
import torch

from megatron.core.model_parallel_config import ModelParallelConfig


def test_defaults_match_megatron():
    c = ModelParallelConfig()
    assert c.tensor_model_parallel_size == 1 and c.pipeline_model_parallel_size == 1
    assert c.params_dtype == torch.float32 and c.autocast_dtype == torch.float32
    assert c.batch_p2p_comm and c.barrier_with_L1_time and not c.sequence_parallel
    assert c.virtual_pipeline_model_parallel_size is None and c.pipeline_dtype is None


def test_every_field_has_a_docstring():
    import inspect

    source = inspect.getsource(ModelParallelConfig)
    lines = source.splitlines()
    for field in dataclasses.fields(ModelParallelConfig):
        idx = next(i for i, line in enumerate(lines) if line.strip().startswith(f"{field.name}:"))
        assert lines[idx + 1].strip().startswith('"""'), f"{field.name} has no docstring"


@pytest.mark.parametrize(
    "kwargs,pattern",
    [
        (
            dict(sequence_parallel=True),
            r"sequence_parallel needs tensor_model_parallel_size > 1, got 1",
        ),
        (
            dict(pipeline_model_parallel_size=2),
            r"pipeline_model_parallel_size is 2: pipeline_dtype",
        ),
        (
            dict(virtual_pipeline_model_parallel_size=2),
            r"virtual_pipeline_model_parallel_size \(2\).*got 1",
        ),
        (
            dict(tensor_model_parallel_size=0),
            r"tensor_model_parallel_size must be a positive integer, got 0",
        ),
        (dict(fp16=True, bf16=True), r"fp16 and bf16"),
        (dict(defer_embedding_wgrad_compute=True), r"defer_embedding_wgrad_compute needs pipeline"),
        (
            dict(
                defer_embedding_wgrad_compute=True,
                pipeline_model_parallel_size=2,
                pipeline_dtype=torch.float32,
            ),
            r"gradient_accumulation_fusion",
        ),
    ],
)
def test_post_init_value_errors(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        ModelParallelConfig(**kwargs)


def test_derived_fields():
    c = ModelParallelConfig(
        tensor_model_parallel_size=2,
        sequence_parallel=True,
        async_tensor_model_parallel_allreduce=True,
        params_dtype=torch.bfloat16,
    )
    assert c.async_tensor_model_parallel_allreduce is False  # sequence parallel overlaps itself
    assert c.autocast_dtype == torch.bfloat16
