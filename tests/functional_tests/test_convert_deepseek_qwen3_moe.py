"""DeepSeek-V3 (MLA + group-limited sigmoid MoE with expert bias and a shared expert + a first
dense layer + YaRN) and Qwen3-MoE (qk-norm, GQA, a dense layer) through tools/checkpoint/convert.py.

Tiny random models are built with transformers (the DeepSeek-V3 one is the parity test's) and
saved; convert.main runs in this process (the saver is a forked child):

- HF -> ours at TP2 x EP2 (loader_hf -> saver_mcore) -> HF (loader_mcore -> saver_hf): every
  exported tensor equals the original bitwise, and transformers loads the export.
- --use-checkpoint-args restores every architectural field from the converted checkpoint alone.
- GPTModel built by pretrain_gpt.model_provider from those args at TP2 x EP2 gives Hugging Face's
  logits.

transformers' DeepseekV3ForCausalLM holds no multi-token-prediction weights (its MTP modules are
loaded by the separate MtpModel), so the round trip here has none.
"""

import os
import sys

import pytest
import torch

from tests.functional_tests import convert_utils as cu
from tests.unit_tests.dist_utils import run_distributed

transformers = pytest.importorskip('transformers')
safetensors_torch = pytest.importorskip('safetensors.torch')

VOCAB = 64
TOKENS = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))


def _qwen3_moe():
    torch.manual_seed(3)
    config = transformers.Qwen3MoeConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        mlp_only_layers=[1],
        max_position_embeddings=64,
        rope_parameters=dict(rope_type='default', rope_theta=1e6),
        tie_word_embeddings=False,
    )
    model = transformers.Qwen3MoeForCausalLM(config)
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1.0 + 0.1 * noise if 'norm' in name else 0.2 * noise)
    return model.eval()


def _deepseek_v3():
    from tests.unit_tests.models.test_deepseek_v3_parity import _hf_model

    return _hf_model()


def _convert(*argv):
    tools = os.path.join(cu.REPO, 'tools', 'checkpoint')
    if tools not in sys.path:
        sys.path.insert(0, tools)
    import convert

    assert convert.main(['--model-type', 'GPT', *argv]) == 0


@pytest.fixture(scope='module', params=['deepseek_v3', 'qwen3_moe'])
def converted(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    hf = _deepseek_v3() if request.param == 'deepseek_v3' else _qwen3_moe()
    dirs = {n: str(root / n) for n in ('hf', 'tp2ep2', 'export')}
    hf.save_pretrained(dirs['hf'])
    _convert(
        *('--loader', 'hf', '--saver', 'mcore', '--load-dir', dirs['hf']),
        *('--save-dir', dirs['tp2ep2'], '--target-tensor-parallel-size', '2'),
        *('--target-expert-parallel-size', '2', '--hf-tokenizer-type', 'GPT2BPETokenizer'),
    )
    _convert(
        *('--loader', 'mcore', '--saver', 'hf', '--load-dir', dirs['tp2ep2']),
        *('--save-dir', dirs['export']),
    )
    with torch.no_grad():
        expected = hf(TOKENS).logits
    return request.param, dirs, expected


def test_round_trip_is_bitwise(converted):
    arch, dirs, _ = converted
    original = safetensors_torch.load_file(os.path.join(dirs['hf'], 'model.safetensors'))
    exported = safetensors_torch.load_file(os.path.join(dirs['export'], 'model.safetensors'))
    assert sorted(exported) == sorted(original)
    for name, tensor in original.items():
        assert exported[name].dtype == tensor.dtype, name
        assert torch.equal(exported[name], tensor), name
    assert sorted(os.listdir(os.path.join(dirs['tp2ep2'], 'iter_0000001'))) == [
        'mp_rank_00_000',
        'mp_rank_00_001',
        'mp_rank_01_000',
        'mp_rank_01_001',
    ]
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(dirs['export']).eval()
    assert type(reloaded).__name__ == {
        'deepseek_v3': 'DeepseekV3ForCausalLM',
        'qwen3_moe': 'Qwen3MoeForCausalLM',
    }[arch]
    # The original directory loaded the same way (same attention implementation) gives the
    # same logits bit for bit.
    source = transformers.AutoModelForCausalLM.from_pretrained(dirs['hf']).eval()
    with torch.no_grad():
        assert torch.equal(reloaded(TOKENS).logits, source(TOKENS).logits)


#: What --use-checkpoint-args must give back (from the converted checkpoint alone).
_RESTORED = {
    'deepseek_v3': dict(
        num_layers=3,
        hidden_size=32,
        num_attention_heads=4,
        ffn_hidden_size=48,
        multi_latent_attention=True,
        q_lora_rank=16,
        kv_lora_rank=12,
        qk_head_dim=8,
        qk_pos_emb_head_dim=4,
        v_head_dim=6,
        qk_layernorm=True,
        rope_type='yarn',
        rotary_scaling_factor=4.0,
        mscale=1.0,
        mscale_all_dim=1.0,
        yarn_original_max_position_embeddings=16,
        yarn_beta_fast=32.0,
        yarn_beta_slow=1.0,
        rotary_base=10000,
        norm_epsilon=1e-6,
        num_experts=8,
        moe_ffn_hidden_size=16,
        moe_shared_expert_intermediate_size=16,
        moe_shared_expert_gate=False,
        moe_router_topk=4,
        moe_router_score_function='sigmoid',
        moe_router_enable_expert_bias=True,
        moe_router_num_groups=4,
        moe_router_group_topk=2,
        moe_router_topk_scaling_factor=2.5,
        moe_router_dtype='fp32',
        moe_router_pre_softmax=False,
        moe_layer_freq=[0, 1, 1],
        expert_model_parallel_size=2,
        tensor_model_parallel_size=2,
        untie_embeddings_and_output_weights=True,
    ),
    'qwen3_moe': dict(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        num_query_groups=2,
        group_query_attention=True,
        kv_channels=16,
        ffn_hidden_size=48,
        qk_layernorm=True,
        add_qkv_bias=False,
        rotary_base=1000000,
        num_experts=4,
        moe_ffn_hidden_size=16,
        moe_shared_expert_intermediate_size=None,
        moe_router_topk=2,
        moe_router_score_function='softmax',
        moe_router_pre_softmax=False,
        moe_layer_freq=[1, 0],
        expert_model_parallel_size=2,
        tensor_model_parallel_size=2,
    ),
}


def test_use_checkpoint_args_restores_the_architecture(converted):
    from megatron.training.arguments import parse_args
    from megatron.training.checkpointing import load_args_from_checkpoint

    arch, dirs, _ = converted
    argv = ['--load', dirs['tp2ep2'], '--use-checkpoint-args', '--micro-batch-size', '1']
    args, _ = load_args_from_checkpoint(parse_args(args_list=argv + ['--mock-data']))
    got = {name: getattr(args, name) for name in _RESTORED[arch]}
    assert got == _RESTORED[arch]


def test_tp2_ep2_checkpoint_gives_hf_logits(converted):
    _, dirs, expected = converted
    outs = run_distributed(
        cu.logits_from_checkpoint,
        world_size=4,
        tp=2,
        ep=2,
        args=(dirs['tp2ep2'], TOKENS, ['--sequence-parallel']),
        timeout=600,
    )
    torch.testing.assert_close(outs[0][..., :VOCAB], expected, atol=2e-5, rtol=1e-4)
