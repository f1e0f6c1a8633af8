"""Helpers shared by the GPTModel tests: tiny configs, model builders, state-dict gathering.

Imported inside spawned ranks (tests.unit_tests.dist_utils), so everything is module level.
"""

import dataclasses

import torch

from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.gpt.hf_weight_mapping import (
    merge_tensor_parallel_state_dicts,
    tensor_parallel_partition_dim,
)
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import openai_gelu

VOCAB = 128
SEQ = 16
BATCH = 2


def gpt2_like_kwargs(**overrides):
    """TransformerConfig kwargs of a tiny GPT-2 architecture (LayerNorm, GeLU, biases)."""
    kw = dict(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        activation_func=openai_gelu,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=True,
    )
    kw.update(overrides)
    return kw


def llama_like_kwargs(**overrides):
    """TransformerConfig kwargs of a tiny Llama architecture (RMSNorm, SwiGLU, GQA, no bias)."""
    kw = dict(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=8,
        num_query_groups=4,
        ffn_hidden_size=96,
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        layernorm_epsilon=1e-6,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=True,
    )
    kw.update(overrides)
    return kw


def build_gpt(config_kwargs, arch="gpt2", **model_overrides):
    """Build a GPTModel for the current parallel state (TP size taken from parallel_state)."""
    tp = parallel_state.get_tensor_model_parallel_world_size()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    extra = {}
    if pp > 1:
        extra["pipeline_dtype"] = torch.float32
    config = TransformerConfig(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, **extra, **config_kwargs
    )
    model_kwargs = dict(
        vocab_size=VOCAB,
        max_sequence_length=SEQ * 2,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
    )
    if arch == "gpt2":
        model_kwargs.update(
            position_embedding_type="learned_absolute", share_embeddings_and_output_weights=True
        )
    else:
        model_kwargs.update(
            position_embedding_type="rope", share_embeddings_and_output_weights=False
        )
    model_kwargs.update(model_overrides)
    model_kwargs.setdefault("transformer_layer_spec", get_gpt_layer_local_spec())
    model = GPTModel(config=config, **model_kwargs)
    return model, config


def batch(seed=7, batch_size=BATCH, seq=SEQ):
    """Deterministic token ids and labels [b, s]."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (batch_size, seq + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _all_gather_tp(tensor):
    group = parallel_state.get_tensor_model_parallel_group()
    world = torch.distributed.get_world_size(group)
    if world == 1:
        return [tensor]
    out = [torch.empty_like(tensor) for _ in range(world)]
    torch.distributed.all_gather(out, tensor.contiguous(), group=group)
    return out


def gather_full(named_tensors, config):
    """Gather per-rank TP shards of `{name: tensor}` (params or grads) into the full TP=1 dict."""
    tp = parallel_state.get_tensor_model_parallel_world_size()
    names = sorted(named_tensors)
    shards = [dict() for _ in range(tp)]
    for name in names:
        t = named_tensors[name].detach()
        if tensor_parallel_partition_dim(name) is None:
            pieces = [t] * tp
        else:
            pieces = _all_gather_tp(t)
        for r in range(tp):
            shards[r][name] = pieces[r]
    return merge_tensor_parallel_state_dicts(shards, config)


def grads_of(model):
    """`{name: grad}` of every parameter (zeros for params that got no gradient)."""
    return {
        n: (p.grad if p.grad is not None else torch.zeros_like(p)).detach().clone()
        for n, p in model.named_parameters()
    }


def gather_logits(logits):
    """[b, s, v/tp] vocab-parallel logits -> [b, s, v]."""
    return torch.cat(_all_gather_tp(logits), dim=-1)


def config_snapshot(config):
    return dataclasses.asdict(config)
