"""TransformerConfig: derived defaults and ValueErrors that name the fields and the numbers."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from megatron.core.transformer.transformer_config import TransformerConfig

BASE = dict(num_layers=4, hidden_size=64, num_attention_heads=8)


def test_derived_defaults():
    config = TransformerConfig(**BASE)
    assert config.ffn_hidden_size == 256
    assert config.kv_channels == 8
    assert config.num_query_groups == 8
    assert callable(config.init_method) and callable(config.output_layer_init_method)
    # Field names are Megatron's.
    names = {f.name for f in dataclasses.fields(TransformerConfig)}
    for name in (
        "num_layers",
        "hidden_size",
        "ffn_hidden_size",
        "num_attention_heads",
        "num_query_groups",
        "kv_channels",
        "hidden_dropout",
        "attention_dropout",
        "layernorm_epsilon",
        "normalization",
        "gated_linear_unit",
        "activation_func",
        "add_bias_linear",
        "add_qkv_bias",
        "apply_residual_connection_post_layernorm",
        "init_method_std",
        "init_method",
        "output_layer_init_method",
        "apply_query_key_layer_scaling",
        "attention_softmax_in_fp32",
        "recompute_granularity",
        "recompute_method",
        "recompute_num_layers",
        "sequence_parallel",
        "params_dtype",
        "fp16",
        "bf16",
        "use_cpu_initialization",
        "perform_initialization",
    ):
        assert name in names, name


@pytest.mark.parametrize(
    "overrides, fragments",
    [
        (
            dict(num_attention_heads=6, tensor_model_parallel_size=4),
            ["num_attention_heads (6)", "tensor_model_parallel_size (4)"],
        ),
        (dict(num_query_groups=3), ["num_attention_heads (8)", "num_query_groups (3)"]),
        (
            dict(num_query_groups=2, tensor_model_parallel_size=4),
            ["num_query_groups (2)", "tensor_model_parallel_size (4)"],
        ),
        (dict(hidden_size=60), ["hidden_size (60)", "num_attention_heads (8)"]),
        (
            dict(num_layers=3, pipeline_model_parallel_size=2, pipeline_dtype=None),
            ["pipeline_dtype"],
        ),
        (
            dict(num_layers=5, pipeline_model_parallel_size=2, pipeline_dtype=torch.float32),
            ["num_layers (5)", "pipeline_model_parallel_size (2)"],
        ),
        (dict(normalization="BatchNorm"), ["normalization", "BatchNorm"]),
        (dict(hidden_dropout=1.5), ["hidden_dropout", "1.5"]),
        (dict(recompute_granularity="partial"), ["recompute_granularity", "partial"]),
        (dict(recompute_granularity="full"), ["recompute_method"]),
        (dict(recompute_granularity="full", recompute_method="uniform"), ["recompute_num_layers"]),
        (
            dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=5),
            ["recompute_num_layers (5)", "4"],
        ),
        (
            dict(recompute_granularity="selective", recompute_method="uniform"),
            ["recompute_method", "selective"],
        ),
        (
            dict(recompute_granularity="selective", recompute_num_layers=2),
            ["recompute_num_layers (2)", "selective"],
        ),
        (dict(recompute_method="block"), ["recompute_granularity"]),
        (
            dict(bias_activation_fusion=True, activation_func=F.relu),
            ["bias_activation_fusion", "relu"],
        ),
        (dict(num_layers=0), ["num_layers", "0"]),
    ],
)
def test_impossible_configs_raise_value_error(overrides, fragments):
    kwargs = {**BASE, **overrides}
    with pytest.raises(ValueError) as exc_info:
        TransformerConfig(**kwargs)
    message = str(exc_info.value)
    for fragment in fragments:
        assert fragment in message, (fragment, message)
