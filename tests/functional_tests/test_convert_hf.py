"""Hugging Face import / export through tools/checkpoint/convert.py.

A random tiny GPT-2 and a random tiny Llama (GQA 8/2, untied, RoPE base 5000) are built with
transformers (no downloads) and saved; each is imported at TP2xPP2 and at TP1xPP1 (loader_hf ->
saver_mcore) and exported again (loader_mcore -> saver_hf). The exported tensors are identical to
the original ones, transformers' from_pretrained loads the export, and our model, built from the
converted checkpoint's saved args alone, gives the HF model's logits at both layouts.
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


def _randomize(model, seed):
    """Random values everywhere (HF initialises biases to 0 and norms to 1)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g) * 0.05
            is_norm = p.dim() == 1 and ('ln' in name or 'norm' in name) and name.endswith('weight')
            p.copy_(1.0 + noise if is_norm else noise * 2)


def _hf_model(arch):
    if arch == 'gpt2':
        config = transformers.GPT2Config(
            vocab_size=VOCAB,
            n_positions=32,
            n_embd=32,
            n_layer=4,
            n_head=4,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        )
        model = transformers.GPT2LMHeadModel(config)
    elif arch in ('qwen2', 'qwen3'):
        # Qwen2.5: q/k/v biases; Qwen3: per-head q/k RMSNorm, explicit head_dim.
        kind = transformers.Qwen2Config if arch == 'qwen2' else transformers.Qwen3Config
        config = kind(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=4,
            num_attention_heads=8,
            num_key_value_heads=4,
            head_dim=8 if arch == 'qwen2' else 16,
            max_position_embeddings=32,
            rms_norm_eps=1e-6,
            rope_theta=20000.0,
            tie_word_embeddings=arch == 'qwen3',
        )
        model = (
            transformers.Qwen2ForCausalLM if arch == 'qwen2' else transformers.Qwen3ForCausalLM
        )(config)
    else:
        config = transformers.LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=4,
            num_attention_heads=8,
            num_key_value_heads=2,
            max_position_embeddings=32,
            rms_norm_eps=1e-6,
            rope_theta=5000.0,
            tie_word_embeddings=False,
        )
        if arch == 'llama31':
            # Llama-3.1 rope scaling with a short original context, so it changes the logits.
            config.rope_parameters = dict(
                rope_type='llama3',
                rope_theta=5000.0,
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=8192,
            )
        model = transformers.LlamaForCausalLM(config)
    _randomize(model, seed=3)
    return model.eval()


def _logits(load_dir, tokens):
    return cu.logits_from_checkpoint(load_dir, tokens)


def _our_logits(load_dir, tokens, tp, pp):
    outs = run_distributed(_logits, world_size=tp * pp, tp=tp, pp=pp, args=(load_dir, tokens))
    return [o for o in outs if o is not None][0][..., :VOCAB]


@pytest.mark.parametrize('arch', ['gpt2', 'llama', 'qwen2', 'qwen3', 'llama31'])
def test_hf_import_export(tmp_path, arch):
    hf = _hf_model(arch)
    hf_dir, tok_dir = str(tmp_path / 'hf'), str(tmp_path / 'tokenizer')
    hf.save_pretrained(hf_dir, safe_serialization=True)
    os.makedirs(tok_dir)
    for name in ('vocab.json', 'merges.txt'):
        src = os.path.join(cu.REPO, 'data', 'gpt2', 'gpt2-' + name.replace('.', '-', 0))
        # The tokenizer files beside the export's source and in the model directory itself.
        for directory in (tok_dir, hf_dir):
            with (
                open(src if os.path.exists(src) else os.devnull) as f,
                open(os.path.join(directory, name), 'w') as g,
            ):
                g.write(f.read())

    ours = {layout: str(tmp_path / f'ours_{layout}') for layout in ('tp2pp2', 'tp1')}
    cu.convert(
        '--loader',
        'hf',
        '--saver',
        'mcore',
        '--load-dir',
        hf_dir,
        '--save-dir',
        ours['tp2pp2'],
        '--target-tensor-parallel-size',
        '2',
        '--target-pipeline-parallel-size',
        '2',
    )
    cu.convert(
        '--loader', 'hf', '--saver', 'megatron', '--load-dir', hf_dir, '--save-dir', ours['tp1']
    )
    export = str(tmp_path / 'export')
    cu.convert(
        '--loader',
        'mcore',
        '--saver',
        'hf',
        '--load-dir',
        ours['tp2pp2'],
        '--save-dir',
        export,
        '--hf-tokenizer-dir',
        tok_dir,
    )

    original = safetensors_torch.load_file(os.path.join(hf_dir, 'model.safetensors'))
    exported = safetensors_torch.load_file(os.path.join(export, 'model.safetensors'))
    assert sorted(exported) == sorted(original)
    for name, tensor in original.items():
        assert torch.equal(exported[name], tensor), name
    assert sorted(n for n in os.listdir(export) if n.endswith(('.json', '.txt'))) == [
        'config.json',
        'merges.txt',
        'vocab.json',
    ]
    with open(os.path.join(export, 'config.json')) as f:
        assert json.load(f)['vocab_size'] == VOCAB

    reloaded = transformers.AutoModelForCausalLM.from_pretrained(export).eval()
    assert type(reloaded) is type(hf)
    tokens = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = hf(tokens).logits
        assert torch.equal(reloaded(tokens).logits, expected)

    # Iteration 1 and the architecture in the saved args (what --use-checkpoint-args reads).
    state = cu.read_rank_file(ours['tp1'], 0, 0, pp=1)
    assert state['iteration'] == 1
    args = state['args']
    # The model directory's own tokenizer files are recorded (GPT-2 BPE: vocab.json + merges.txt).
    assert (args.tokenizer_type, args.vocab_file, args.merge_file) == (
        'GPT2BPETokenizer',
        os.path.join(os.path.abspath(hf_dir), 'vocab.json'),
        os.path.join(os.path.abspath(hf_dir), 'merges.txt'),
    )
    if arch == 'llama':
        assert (args.rotary_base, args.num_query_groups, args.norm_epsilon) == (5000, 2, 1e-6)
    elif arch == 'qwen2':
        assert args.add_qkv_bias and not args.add_bias_linear and not args.qk_layernorm
    elif arch == 'qwen3':
        assert args.qk_layernorm and args.kv_channels == 16 and not args.add_qkv_bias
    elif arch == 'llama31':
        assert args.use_rope_scaling and args.rope_scaling_factor == 8.0
    else:
        assert args.bias_gelu_fusion and args.position_embedding_type == 'learned_absolute'

    for layout, (tp, pp) in (('tp2pp2', (2, 2)), ('tp1', (1, 1))):
        got = _our_logits(ours[layout], tokens, tp, pp)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=0, msg=f'{arch} {layout}')


def test_loader_llama_mistral_matches_loader_hf(tmp_path):
    """Megatron's flags for Llama directories give loader_hf's weights, with Megatron's args
    (Llama2Tokenizer, --tokenizer-model, seq_length 4096, iteration 1) plus the RoPE base."""
    hf_dir = str(tmp_path / 'hf')
    _hf_model('llama').save_pretrained(hf_dir, safe_serialization=True)
    via_hf, via_llama = str(tmp_path / 'via_hf'), str(tmp_path / 'via_llama')
    # The directory has no tokenizer files: the loader is told which tokenizer to record.
    cu.convert(
        '--loader',
        'hf',
        '--saver',
        'mcore',
        '--load-dir',
        hf_dir,
        '--save-dir',
        via_hf,
        '--hf-tokenizer-type',
        'GPT2BPETokenizer',
    )
    common = ['--loader', 'llama_mistral', '--saver', 'mcore', '--load-dir', hf_dir]
    common += ['--model-size', 'llama2-7B', '--tokenizer-model', '/models/tokenizer.model']
    meta = cu.convert(*common, '--checkpoint-type', 'meta', '--save-dir', via_llama, check=False)
    assert meta.returncode == 2 and meta.stderr.strip().startswith(
        'error: --checkpoint-type meta: only "hf" is supported here'
    )
    cu.convert(*common, '--checkpoint-type', 'hf', '--save-dir', via_llama)

    expected, _ = cu.full_model(via_hf)
    got, reader = cu.full_model(via_llama)
    assert sorted(got) == sorted(expected)
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name
    args = reader.args
    assert (args.tokenizer_type, args.tokenizer_model) == (
        'Llama2Tokenizer',
        '/models/tokenizer.model',
    )
    assert (args.seq_length, reader.iteration, args.rotary_base) == (4096, 1, 5000)
    assert args.params_dtype == torch.float32
