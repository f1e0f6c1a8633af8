"""DeepSeek-V3-style model: our GPTModel (MLA + grouped sigmoid MoE + shared expert) against
transformers' DeepseekV3ForCausalLM with the same config and weights, and MLA's KV-cache size.

- Training: one forward + backward + AdamW step each, alternated (ours, HF, ours, ...) in one
  process on --threads threads after a warm-up; tokens/s from the median step time (and, as
  `*_best`, from the fastest step, the figure least disturbed by other jobs). Both use
  torch's fused AdamW: the kernel our optimizer builds (`get_megatron_optimizer`) and the
  default of Hugging Face's Trainer (`adamw_torch_fused`).
- KV cache: values cached per token and layer by our static engine (the latent and the shared
  rotary key, measured from the cache after a prefill) against expanded keys and values
  (n (dn + dr) + n dv), for the benchmark config and for DeepSeek-V3's published sizes.

Usage:
    python benchmarks/bench_mla.py                 # ~100M parameters, seq 512, batch 1
    python benchmarks/bench_mla.py --hidden-size 128 --num-layers 2 --seq-length 64 --steps 3
"""

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _parse():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument('--num-layers', type=int, default=8)
    parser.add_argument('--hidden-size', type=int, default=768)
    parser.add_argument('--num-attention-heads', type=int, default=12)
    parser.add_argument('--num-experts', type=int, default=16)
    parser.add_argument('--vocab-size', type=int, default=32000)
    parser.add_argument('--seq-length', type=int, default=512)
    parser.add_argument('--steps', type=int, default=5)
    parser.add_argument('--threads', type=int, default=2)
    parser.add_argument(
        '--moe-grouped-gemm',
        action='store_true',
        help="our experts as GroupedMLP (one autograd node per linear layer, as HF's grouped "
        'experts) instead of SequentialMLP',
    )
    return parser.parse_args()


def _hf_config(a):
    from transformers import DeepseekV3Config

    h, n = a.hidden_size, a.num_attention_heads
    config = DeepseekV3Config(
        vocab_size=a.vocab_size,
        hidden_size=h,
        intermediate_size=4 * h,
        moe_intermediate_size=h // 2,
        num_hidden_layers=a.num_layers,
        num_attention_heads=n,
        num_key_value_heads=n,
        n_shared_experts=1,
        n_routed_experts=a.num_experts,
        num_experts_per_tok=4,
        n_group=4,
        topk_group=2,
        first_k_dense_replace=1,
        q_lora_rank=h // 2,
        kv_lora_rank=h // 4,
        qk_nope_head_dim=h // n,
        qk_rope_head_dim=h // (2 * n),
        v_head_dim=h // n,
        max_position_embeddings=4 * a.seq_length,
        rope_parameters=dict(
            rope_type='yarn',
            rope_theta=10000.0,
            factor=4.0,
            original_max_position_embeddings=a.seq_length,
            beta_fast=32.0,
            beta_slow=1.0,
            mscale=1.0,
            mscale_all_dim=1.0,
        ),
        rope_interleave=True,
        tie_word_embeddings=False,
    )
    config._attn_implementation = 'sdpa'
    return config


def _our_model(hf_config, a):
    import torch.nn.functional as F

    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs_mla import get_gpt_mla_decoder_block_spec
    from megatron.core.transformer.mla_transformer_config import MLATransformerConfig

    c = hf_config
    config = MLATransformerConfig(
        num_layers=c.num_hidden_layers,
        hidden_size=c.hidden_size,
        num_attention_heads=c.num_attention_heads,
        ffn_hidden_size=c.intermediate_size,
        q_lora_rank=c.q_lora_rank,
        kv_lora_rank=c.kv_lora_rank,
        qk_head_dim=c.qk_nope_head_dim,
        qk_pos_emb_head_dim=c.qk_rope_head_dim,
        v_head_dim=c.v_head_dim,
        rotary_scaling_factor=4.0,
        original_max_position_embeddings=a.seq_length,
        mscale=1.0,
        mscale_all_dim=1.0,
        qk_layernorm=True,
        layernorm_epsilon=c.rms_norm_eps,
        add_bias_linear=False,
        gated_linear_unit=True,
        activation_func=F.silu,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        num_moe_experts=c.n_routed_experts,
        moe_ffn_hidden_size=c.moe_intermediate_size,
        moe_shared_expert_intermediate_size=c.moe_intermediate_size,
        moe_layer_freq=[0] + [1] * (c.num_hidden_layers - 1),
        moe_router_topk=4,
        moe_router_score_function='sigmoid',
        moe_router_enable_expert_bias=True,
        moe_router_num_groups=4,
        moe_router_group_topk=2,
        moe_router_topk_scaling_factor=2.5,
        moe_router_load_balancing_type='none',
        moe_router_dtype='fp32',
        moe_grouped_gemm=a.moe_grouped_gemm,
        use_cpu_initialization=True,
    )
    return GPTModel(
        config,
        get_gpt_mla_decoder_block_spec(config),
        vocab_size=c.vocab_size,
        max_sequence_length=c.max_position_embeddings,
        position_embedding_type='rope',
    )


def _to_grouped(state, num_experts):
    """SequentialMLP expert keys -> GroupedMLP's weight1 [h, E g f] and weight2 [E f, h], whose
    memory holds expert e's fc1^T [h, g f] and fc2^T [f, h] as consecutive blocks."""
    out = {k: v for k, v in state.items() if '.local_experts.' not in k}
    prefixes = {k.split('local_experts.')[0] for k in state if '.local_experts.' in k}
    for p in prefixes:
        fc1 = [state[f'{p}local_experts.{e}.linear_fc1.weight'].t() for e in range(num_experts)]
        fc2 = [state[f'{p}local_experts.{e}.linear_fc2.weight'].t() for e in range(num_experts)]
        out[p + 'weight1'] = torch.stack(fc1).view(fc1[0].shape[0], -1)  # [h, E g f]
        out[p + 'weight2'] = torch.stack(fc2).view(-1, fc2[0].shape[1])  # [E f, h]
    return out


def _time_steps(models, a):
    ids = torch.randint(0, a.vocab_size, (1, a.seq_length + 1))
    inputs, labels = ids[:, :-1], ids[:, 1:]
    optims = {k: torch.optim.AdamW(m.parameters(), lr=1e-4, fused=True) for k, m in models.items()}

    def step(name):
        model, opt = models[name], optims[name]
        opt.zero_grad(set_to_none=True)
        start = time.perf_counter()
        if name == 'ours':
            loss = model(inputs, None, None, labels=labels).mean()
        else:
            loss = model(input_ids=inputs, labels=labels).loss
        loss.backward()
        opt.step()
        return time.perf_counter() - start

    for name in models:
        step(name)  # warm-up
    times = {name: [] for name in models}
    for _ in range(a.steps):
        for name in models:
            times[name].append(step(name))
    median = {name: a.seq_length / statistics.median(t) for name, t in times.items()}
    best = {name: a.seq_length / min(t) for name, t in times.items()}
    return median, best


def _kv_cache(model, hf_config):
    from megatron.core.inference_params import InferenceParams

    c, s = hf_config, 16
    params = InferenceParams(1, s)
    with torch.no_grad():
        model.eval()(torch.randint(0, c.vocab_size, (1, s)), None, None, inference_params=params)
    cached = sum(t.numel() for pair in params.key_value_memory_dict.values() for t in pair)
    per_token_layer = cached / (s * c.num_hidden_layers)
    n = c.num_attention_heads
    expanded = n * (c.qk_nope_head_dim + c.qk_rope_head_dim) + n * c.v_head_dim
    v3 = dict(latent=512 + 64, expanded=128 * (128 + 64) + 128 * 128)
    return dict(
        latent_values_per_token_layer=per_token_layer,
        expanded_values_per_token_layer=expanded,
        saving=expanded / per_token_layer,
        deepseek_v3=dict(**v3, saving=v3['expanded'] / v3['latent']),
    )


def main():
    a = _parse()
    torch.set_num_threads(a.threads)
    os.environ.setdefault('MASTER_ADDR', '127.0.0.1')
    os.environ.setdefault('MASTER_PORT', str(29000 + os.getpid() % 1000))
    torch.distributed.init_process_group('gloo', rank=0, world_size=1)
    from transformers import DeepseekV3ForCausalLM

    from megatron.core import parallel_state
    from megatron.core.models.gpt.hf_weight_mapping_deepseek import (
        deepseek_v3_hf_to_mcore_state_dict,
    )
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    parallel_state.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(1)
    hf_config = _hf_config(a)
    hf = DeepseekV3ForCausalLM(hf_config).train()
    ours = _our_model(hf_config, a).train()
    state = deepseek_v3_hf_to_mcore_state_dict(hf.state_dict(), a.num_layers, 1, a.num_experts)
    if a.moe_grouped_gemm:
        state = _to_grouped(state, a.num_experts)
    missing, unexpected = ours.load_state_dict(state, strict=False)
    assert not unexpected and all('_extra_state' in k for k in missing), (missing, unexpected)
    params = sum(p.numel() for p in hf.parameters())
    tokens_per_s, best = _time_steps({'ours': ours, 'hf': hf}, a)
    result = dict(
        params=params,
        seq_length=a.seq_length,
        threads=a.threads,
        moe_grouped_gemm=a.moe_grouped_gemm,
        tokens_per_s=tokens_per_s,
        speedup=tokens_per_s['ours'] / tokens_per_s['hf'],
        # From the fastest step of each: on a shared machine the least disturbed figure.
        tokens_per_s_best=best,
        speedup_best=best['ours'] / best['hf'],
        kv_cache=_kv_cache(ours, hf_config),
    )
    print(json.dumps(result, indent=2))
    torch.distributed.destroy_process_group()


if __name__ == '__main__':
    main()
