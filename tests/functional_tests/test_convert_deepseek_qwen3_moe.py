"""DeepSeek-V3 (MLA + group-limited sigmoid MoE with expert bias and a shared expert + a first
dense layer + YaRN + one multi-token-prediction module) and Qwen3-MoE (qk-norm, GQA, a dense
layer) through tools/checkpoint/convert.py.

Tiny random models are built with transformers (the DeepSeek-V3 one is the parity test's) and
saved. DeepseekV3ForCausalLM holds no MTP weights: its MTP module is transformers' generic
`MtpModel` (random here), written into the files as DeepSeek's checkpoints hold it (the extra
layer `model.layers.3`). convert.main runs in this process (the saver is a forked child):

- HF -> ours at TP2 x EP2 (loader_hf -> saver_mcore) -> HF (loader_mcore -> saver_hf): every
  exported tensor, the MTP module's included, equals the original bitwise, and transformers
  loads the export.
- --use-checkpoint-args restores every architectural field from the converted checkpoint alone.
- GPTModel built by pretrain_gpt.model_provider from those args at TP2 x EP2 gives Hugging Face's
  logits, and its MTP layer MtpModel's depth-1 logits.
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
    from transformers.modeling_layers import MtpModel

    from tests.unit_tests.models.test_deepseek_v3_parity import _hf_model

    hf = _hf_model()
    mtp = MtpModel(hf, 1).eval()
    # Every value drawn here: whether transformers initialises a new module's weights depends
    # on state an earlier from_pretrained in the same process may leave (then they are
    # torch.empty garbage).
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, tensor in mtp.named_parameters():
            if name.startswith(('embed_tokens', 'lm_head')) or tensor is hf.lm_head.weight:
                continue
            noise = torch.rand(tensor.shape, generator=g)
            tensor.copy_(0.5 + noise if 'norm' in name else 0.2 * (noise - 0.5))
        mtp.layers[0].mtp_block.mlp.gate.e_score_correction_bias.copy_(torch.rand(8) * 0.2)
    return hf, mtp


def _mtp_file_tensors(hf, mtp):
    """MtpModel's module 0 under DeepSeek's file names (layer L = num_hidden_layers, experts per
    expert, copies of the main embedding and head)."""
    p, block = f'model.layers.{hf.config.num_hidden_layers}.', 'layers.0.mtp_block.'
    out = {}
    for name, tensor in mtp.state_dict().items():
        if name == f'{block}mlp.experts.gate_up_proj':
            for j, rows in enumerate(tensor):
                gate, up = rows.chunk(2)
                out[f'{p}mlp.experts.{j}.gate_proj.weight'] = gate
                out[f'{p}mlp.experts.{j}.up_proj.weight'] = up
        elif name == f'{block}mlp.experts.down_proj':
            for j, rows in enumerate(tensor):
                out[f'{p}mlp.experts.{j}.down_proj.weight'] = rows
        elif name.startswith(block):
            out[p + name[len(block) :]] = tensor
        elif name == 'layers.0.post_norm.weight':
            out[p + 'shared_head.norm.weight'] = tensor
        elif name.startswith('layers.0.'):
            out[p + name[len('layers.0.') :]] = tensor
    out[p + 'shared_head.head.weight'] = hf.lm_head.weight
    out[p + 'embed_tokens.weight'] = hf.model.embed_tokens.weight
    return {k: v.detach().clone().contiguous() for k, v in out.items()}


def _hf_mtp_logits(hf, mtp):
    """MtpModel depth 1 on ids[:, 1:] and the main hidden state [:, :-1] -> [b, s-1, v]."""
    s = TOKENS.shape[1]
    with torch.no_grad():
        main = hf.model(TOKENS).last_hidden_state  # [b, s, h], after the final norm
        positions = torch.arange(1, s).unsqueeze(0).expand(TOKENS.shape[0], -1)
        h1 = mtp.forward_layer(0, main[:, :-1], positions, None, input_ids=TOKENS[:, 1:])
        return mtp._project_to_logits(h1)


def _our_mtp_logits(model, tokens):
    """Our MTP layer 1 on the rolled ids and the decoder output -> [b, s-1, v] (full vocab)."""
    from megatron.core.transformer.multi_token_prediction import roll_left
    from tests.unit_tests.models.gpt_test_utils import gather_logits

    s = tokens.shape[1]
    rotary = model.rotary_pos_emb(s) if model.use_gpt_rotary else None
    hidden = model.decoder(model.embedding(input_ids=tokens, position_ids=None), None,
                           rotary_pos_emb=rotary)  # fmt: skip
    embedded = model.embedding(input_ids=roll_left(tokens), position_ids=None)
    h1 = model.mtp.layers[0](embedded, hidden, None, rotary)
    return gather_logits(model.output_logits(h1)).transpose(0, 1)[:, : s - 1]  # [b, s-1, v]


def _convert(*argv):
    tools = os.path.join(cu.REPO, 'tools', 'checkpoint')
    if tools not in sys.path:
        sys.path.insert(0, tools)
    import convert

    assert convert.main(['--model-type', 'GPT', *argv]) == 0


@pytest.fixture(scope='module', params=['deepseek_v3', 'qwen3_moe'])
def converted(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    dirs = {n: str(root / n) for n in ('hf', 'tp2ep2', 'export')}
    expected_mtp = None
    if request.param == 'deepseek_v3':
        hf, mtp = _deepseek_v3()
        hf.save_pretrained(dirs['hf'])
        path = os.path.join(dirs['hf'], 'model.safetensors')
        tensors = safetensors_torch.load_file(path)
        tensors.update(_mtp_file_tensors(hf, mtp))
        safetensors_torch.save_file(tensors, path, metadata={'format': 'pt'})
        expected_mtp = _hf_mtp_logits(hf, mtp)
    else:
        hf = _qwen3_moe()
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
    return request.param, dirs, (expected, expected_mtp)


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
    assert (
        type(reloaded).__name__
        == {
            'deepseek_v3': 'DeepseekV3ForCausalLM',
            'qwen3_moe': 'Qwen3MoeForCausalLM',
        }[arch]
    )
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
        mtp_num_layers=1,
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
    arch, dirs, (expected, expected_mtp) = converted
    # MoE under TP needs --sequence-parallel for training; the MTP head runs under it too.
    extra = ['--sequence-parallel']
    also = _our_mtp_logits if arch == 'deepseek_v3' else None
    outs = run_distributed(
        cu.logits_from_checkpoint,
        world_size=4,
        tp=2,
        ep=2,
        args=(dirs['tp2ep2'], TOKENS, extra),
        kwargs=dict(also=also),
        timeout=600,
    )
    logits, mtp_logits = outs[0] if also is not None else (outs[0], None)
    torch.testing.assert_close(logits[..., :VOCAB], expected, atol=2e-5, rtol=1e-4)
    if also is not None:
        torch.testing.assert_close(mtp_logits[..., :VOCAB], expected_mtp, atol=2e-5, rtol=1e-4)


def test_mtp_model_round_trips_through_a_pipeline_parallel_layout(converted, tmp_path):
    """TP2 x EP2 -> PP3 -> HF: the MTP module and a copy of the word table go to the last stage
    (where training embeds the rolled ids), and the export equals the original bit for bit."""
    arch, dirs, _ = converted
    if arch != 'deepseek_v3':
        pytest.skip('the Qwen3-MoE model has no MTP module')
    pp3, export = str(tmp_path / 'pp3'), str(tmp_path / 'export')
    _convert(
        *('--loader', 'mcore', '--saver', 'mcore', '--load-dir', dirs['tp2ep2']),
        *('--save-dir', pp3, '--target-pipeline-parallel-size', '3'),
    )
    last = torch.load(
        os.path.join(pp3, 'iter_0000001', 'mp_rank_00_002', 'model_optim_rng.pt'),
        weights_only=False,
    )['model']
    first = torch.load(
        os.path.join(pp3, 'iter_0000001', 'mp_rank_00_000', 'model_optim_rng.pt'),
        weights_only=False,
    )['model']
    assert 'mtp.layers.0.eh_proj.weight' in last and 'mtp.layers.0.eh_proj.weight' not in first
    assert torch.equal(
        last['embedding.word_embeddings.weight'], first['embedding.word_embeddings.weight']
    )
    _convert(*('--loader', 'mcore', '--saver', 'hf', '--load-dir', pp3, '--save-dir', export))
    original = safetensors_torch.load_file(os.path.join(dirs['hf'], 'model.safetensors'))
    exported = safetensors_torch.load_file(os.path.join(export, 'model.safetensors'))
    assert sorted(exported) == sorted(original)
    for name, tensor in original.items():
        assert torch.equal(exported[name], tensor), name
