"""MoE checkpoints through tools/checkpoint/convert.py, against Hugging Face.

A random tiny Mixtral (4 experts, top-2, GQA 4/2, RoPE base 1e6) and a random tiny Qwen2-MoE
(shared expert with its sigmoid gate, routing without renormalization, q/k/v biases, layer 1
dense) are built with transformers (no downloads) and saved.

- Mixtral: HF -> ours at TP2 x EP2 (loader_hf -> saver_mcore) -> TP1 x EP1 (mcore -> mcore) -> HF
  (saver_hf): the exported tensors are identical to the original ones and transformers loads
  them; GPTModel built from each checkpoint's saved args alone (--use-checkpoint-args restores
  the experts, top-k and the RoPE base) gives MixtralForCausalLM's logits at both layouts.
- Qwen2-MoE: HF -> ours at EP2 -> HF identical, logits equal to Qwen2MoeForCausalLM's.
- Megatron's loader_mixtral_hf gives loader_hf's weights, with its args (Llama2Tokenizer, bf16)
  plus the RoPE base that Megatron's loader drops.
- A source whose expert weight is missing or mis-shaped stops with one line before any work.
"""

import json
import os

import pytest
import torch

from tests.functional_tests import convert_utils as cu
from tests.unit_tests.dist_utils import run_distributed

transformers = pytest.importorskip('transformers')
safetensors_torch = pytest.importorskip('safetensors.torch')

VOCAB = 100
TOKENS = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))


def _randomize(model, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1.0 + 0.05 * noise if 'norm' in name else 0.1 * noise)


def _hf_model(arch):
    common = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        num_experts_per_tok=2,
        tie_word_embeddings=False,
    )
    if arch == 'mixtral':
        config = transformers.MixtralConfig(
            intermediate_size=48, num_local_experts=4, rope_theta=1e6, **common
        )
        model = transformers.MixtralForCausalLM(config)
    else:
        config = transformers.Qwen2MoeConfig(
            intermediate_size=40,
            moe_intermediate_size=24,
            shared_expert_intermediate_size=16,
            num_experts=4,
            norm_topk_prob=False,
            mlp_only_layers=[1],
            **common,
        )
        model = transformers.Qwen2MoeForCausalLM(config)
    _randomize(model, seed=5)
    return model.eval()


def _logits(load_dir, tokens, extra_args=()):
    return cu.logits_from_checkpoint(load_dir, tokens, extra_args)


def _our_logits(load_dir, world, tp=1, ep=1):
    extra = ['--sequence-parallel'] if tp > 1 else []
    outs = run_distributed(
        _logits, world_size=world, tp=tp, ep=ep, args=(load_dir, TOKENS, extra), timeout=600
    )
    return outs[0][..., :VOCAB]


def _dist_logits(load_dir, tokens):
    """Logits of a torch_dist checkpoint loaded by the trainer's load_checkpoint (resharded to
    this pool's layout: the saved args' TP x EP through --use-checkpoint-args)."""
    import sys

    if cu.REPO not in sys.path:
        sys.path.insert(0, cu.REPO)
    import pretrain_gpt
    from megatron.training.arguments import parse_args
    from megatron.training.checkpointing import load_args_from_checkpoint, load_checkpoint
    from megatron.training.global_vars import destroy_global_vars, set_args
    from megatron.training.validation.argument_validation import validate_args
    from tests.unit_tests.models.gpt_test_utils import gather_logits

    destroy_global_vars()
    argv = ['--load', load_dir, '--use-checkpoint-args', '--finetune', '--micro-batch-size', '1']
    argv += ['--mock-data', '--tokenizer-type', 'NullTokenizer', '--vocab-size', '1']
    args, _ = load_args_from_checkpoint(parse_args(args_list=argv))
    args.world_size, args.rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    validate_args(args)
    set_args(args)
    try:
        model = pretrain_gpt.model_provider()
        load_checkpoint([model], None, None)
        model.eval()
        position_ids = torch.arange(tokens.shape[1]).unsqueeze(0).expand(tokens.shape[0], -1)
        with torch.no_grad():
            return gather_logits(model(tokens, position_ids, None))
    finally:
        destroy_global_vars()


def _assert_identical_files(original_dir, export_dir):
    original = safetensors_torch.load_file(os.path.join(original_dir, 'model.safetensors'))
    exported = safetensors_torch.load_file(os.path.join(export_dir, 'model.safetensors'))
    assert sorted(exported) == sorted(original)
    for name, tensor in original.items():
        assert torch.equal(exported[name], tensor), name


@pytest.fixture(scope='module')
def mixtral(tmp_path_factory):
    root = tmp_path_factory.mktemp('mixtral')
    hf = _hf_model('mixtral')
    dirs = {n: str(root / n) for n in ('hf', 'tp2ep2', 'tp1ep1', 'export', 'megatron')}
    hf.save_pretrained(dirs['hf'])
    cu.convert(
        *('--loader', 'hf', '--saver', 'mcore', '--load-dir', dirs['hf']),
        *('--save-dir', dirs['tp2ep2'], '--target-tensor-parallel-size', '2'),
        *('--target-expert-parallel-size', '2', '--hf-tokenizer-type', 'GPT2BPETokenizer'),
    )
    cu.convert(
        *('--loader', 'mcore', '--saver', 'mcore', '--load-dir', dirs['tp2ep2']),
        *('--save-dir', dirs['tp1ep1'], '--target-tensor-parallel-size', '1'),
        *('--target-expert-parallel-size', '1'),
    )
    cu.convert(
        *('--loader', 'mcore', '--saver', 'hf', '--load-dir', dirs['tp1ep1']),
        *('--save-dir', dirs['export']),
    )
    with torch.no_grad():
        expected = hf(TOKENS).logits
    return dirs, expected


def test_mixtral_round_trip_is_identical(mixtral):
    dirs, expected = mixtral
    _assert_identical_files(dirs['hf'], dirs['export'])
    assert sorted(os.listdir(os.path.join(dirs['tp2ep2'], 'iter_0000001'))) == [
        'mp_rank_00_000',
        'mp_rank_00_001',
        'mp_rank_01_000',
        'mp_rank_01_001',
    ]
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(dirs['export']).eval()
    assert type(reloaded).__name__ == 'MixtralForCausalLM'
    with torch.no_grad():
        assert torch.equal(reloaded(TOKENS).logits, expected)
    with open(os.path.join(dirs['export'], 'config.json')) as f:
        config = json.load(f)
    assert (config['num_local_experts'], config['rope_theta']) == (4, 1e6)


def test_mixtral_logits_at_tp1ep1_and_tp2ep2(mixtral):
    dirs, expected = mixtral
    args = cu.read_rank_file(dirs['tp1ep1'], 0, 0, pp=1)['args']
    assert (args.num_experts, args.moe_router_topk, args.rotary_base) == (4, 2, 1000000)
    torch.testing.assert_close(_our_logits(dirs['tp1ep1'], 1), expected, atol=1e-5, rtol=0)
    got = _our_logits(dirs['tp2ep2'], 4, tp=2, ep=2)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


def test_qwen2_moe_round_trip_and_logits(tmp_path):
    """HF -> ours (torch format, EP2) -> torch_dist -> HF: identical tensors; the torch_dist
    checkpoint (shared expert, a dense layer among MoE layers: per-layer keys) loads in the
    trainer at EP2 with Hugging Face's logits."""
    from megatron.core import dist_checkpointing

    hf = _hf_model('qwen2_moe')
    hf_dir, ours, dist, export = (str(tmp_path / n) for n in ('hf', 'ep2', 'dist', 'export'))
    hf.save_pretrained(hf_dir)
    cu.convert(
        *('--loader', 'hf', '--saver', 'mcore', '--load-dir', hf_dir, '--save-dir', ours),
        *('--target-expert-parallel-size', '2', '--hf-tokenizer-type', 'GPT2BPETokenizer'),
    )
    cu.convert(
        *('--loader', 'mcore', '--saver', 'torch_dist', '--load-dir', ours, '--save-dir', dist),
        *('--target-expert-parallel-size', '2'),  # recorded in the args; tensors are global
    )
    cu.convert('--loader', 'torch_dist', '--saver', 'hf', '--load-dir', dist, '--save-dir', export)
    _assert_identical_files(hf_dir, export)
    shapes = {
        k: v.global_shape
        for k, v in dist_checkpointing.load_tensors_metadata(
            os.path.join(dist, 'iter_0000001')
        ).items()
    }
    assert shapes['decoder.layers.0.mlp.experts.experts.linear_fc1.weight'] == (4, 48, 32)
    assert shapes['decoder.layers.0.mlp.shared_experts.linear_fc1.weight'] == (32, 32)
    assert shapes['decoder.layers.1.mlp.linear_fc1.weight'] == (80, 32)  # the dense layer
    with torch.no_grad():
        expected = hf(TOKENS).logits
    outs = run_distributed(_dist_logits, world_size=4, ep=2, args=(dist, TOKENS), timeout=600)
    torch.testing.assert_close(outs[0][..., :VOCAB], expected, atol=1e-5, rtol=0)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(export).eval()
    with torch.no_grad():
        assert torch.equal(reloaded(TOKENS).logits, expected)


def test_loader_mixtral_hf_matches_loader_hf(mixtral, tmp_path):
    dirs, _ = mixtral
    via_megatron = str(tmp_path / 'via_mixtral_hf')
    cu.convert(
        *('--loader', 'mixtral_hf', '--saver', 'mcore', '--load-dir', dirs['hf']),
        *('--save-dir', via_megatron, '--tokenizer-model', '/models/tokenizer.model'),
    )
    expected, _ = cu.full_model(dirs['tp1ep1'])
    got, reader = cu.full_model(via_megatron)
    assert sorted(got) == sorted(expected)
    for name, tensor in expected.items():
        assert torch.equal(got[name].float(), tensor.to(torch.bfloat16).float()), name
    args = reader.args
    assert (args.tokenizer_type, args.tokenizer_model) == (
        'Llama2Tokenizer',
        '/models/tokenizer.model',
    )
    assert (args.seq_length, args.rotary_base, args.num_experts) == (4096, 1000000, 4)
    assert args.params_dtype == torch.bfloat16


@pytest.mark.parametrize('damage', ['missing', 'shape'])
def test_missing_or_misshaped_expert_stops_before_work(mixtral, tmp_path, damage):
    dirs, _ = mixtral
    broken = str(tmp_path / 'broken')
    os.makedirs(broken)
    tensors = safetensors_torch.load_file(os.path.join(dirs['hf'], 'model.safetensors'))
    name = 'model.layers.1.block_sparse_moe.experts.3.w2.weight'
    if damage == 'missing':
        del tensors[name]
        message = f'error: --load-dir {broken}: expert weight {name} is missing'
    else:
        tensors[name] = tensors[name][:, :40].contiguous()
        message = (
            f'error: --load-dir {broken}: expert weight {name} has shape (32, 40), the config (4 '
            'experts, hidden 32) needs (32, 48)'
        )
    safetensors_torch.save_file(tensors, os.path.join(broken, 'model.safetensors'))
    with (
        open(os.path.join(dirs['hf'], 'config.json')) as f,
        open(os.path.join(broken, 'config.json'), 'w') as g,
    ):
        g.write(f.read())
    for loader in ('hf', 'mixtral_hf'):
        proc = cu.convert(
            *('--loader', loader, '--saver', 'mcore', '--load-dir', broken),
            *('--save-dir', str(tmp_path / f'out_{loader}')),
            *('--tokenizer-model', 'x') * (loader == 'mixtral_hf'),
            check=False,
        )
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.strip().splitlines()[-1] == message
        assert 'Starting saver' not in proc.stdout
