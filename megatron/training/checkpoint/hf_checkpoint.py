"""Hugging Face model directories <-> this project's args and full megatron-core state dicts.

A Hugging Face directory holds `config.json` and the weights (`model.safetensors`, or shards
listed in `model.safetensors.index.json`), plus tokenizer files. Two families are handled:

- GPT-2 (`model_type` "gpt2"): learned positions, LayerNorm, GeLU (the tanh approximation,
  which Megatron's default fused bias-GeLU computes), linear biases, tied output layer.
- Llama (`model_type` "llama" or "mistral" without a sliding window): RoPE, RMSNorm, SwiGLU,
  grouped-query attention, no biases, untied output layer; Llama-3.1 rope scaling becomes
  `--use-rope-scaling --rope-scaling-factor`.
- Qwen2 / Qwen2.5 (`model_type` "qwen2"): Llama with q/k/v biases only (`--add-qkv-bias`).
- Qwen3 (`model_type` "qwen3"): Llama with per-head RMSNorm of queries and keys before RoPE
  (`--qk-layernorm`; `q_norm` / `k_norm` are `self_attention.q_layernorm` / `k_layernorm`).

The weight renaming itself lives in megatron/core/models/gpt/hf_weight_mapping.py.
"""

import contextlib
import io
import json
import os
import shutil
import types
from typing import Dict, List, Optional

import torch

from megatron.core.models.gpt import hf_weight_mapping as hfm

CONFIG_NAME = 'config.json'
SAFETENSORS_NAME = 'model.safetensors'
SAFETENSORS_INDEX_NAME = 'model.safetensors.index.json'
TOKENIZER_FILES = (
    'tokenizer.json',
    'tokenizer_config.json',
    'special_tokens_map.json',
    'vocab.json',
    'merges.txt',
    'tokenizer.model',
    'added_tokens.json',
    'generation_config.json',
)

# transformers' defaults for the keys a config.json may leave out.
_GPT2_DEFAULTS = dict(
    vocab_size=50257,
    n_positions=1024,
    n_embd=768,
    n_layer=12,
    n_head=12,
    n_inner=None,
    activation_function='gelu_new',
    resid_pdrop=0.1,
    embd_pdrop=0.1,
    attn_pdrop=0.1,
    layer_norm_epsilon=1e-5,
    initializer_range=0.02,
    scale_attn_by_inverse_layer_idx=False,
    reorder_and_upcast_attn=False,
    tie_word_embeddings=True,
)
_LLAMA_DEFAULTS = dict(
    vocab_size=32000,
    hidden_size=4096,
    intermediate_size=11008,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=None,
    hidden_act='silu',
    max_position_embeddings=2048,
    initializer_range=0.02,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    rope_scaling=None,
    attention_bias=False,
    attention_dropout=0.0,
    mlp_bias=False,
    head_dim=None,
)
_DTYPES = {'float32': torch.float32, 'float16': torch.float16, 'bfloat16': torch.bfloat16}


# ---------------------------------------------------------------------------------------------
# reading


def read_hf_config(hf_dir: str) -> dict:
    """config.json of a Hugging Face model directory."""
    path = os.path.join(hf_dir, CONFIG_NAME)
    if not os.path.isfile(path):
        raise ValueError(
            f'--load-dir {hf_dir}: no {CONFIG_NAME} (not a Hugging Face model directory)'
        )
    try:
        with open(path) as f:
            config = json.load(f)
    except ValueError as exc:
        raise ValueError(f'{path}: not valid JSON ({exc})') from None
    if not isinstance(config, dict):
        raise ValueError(f'{path}: not a JSON object')
    return config


def hf_family(config: dict) -> str:
    """'gpt2' or 'llama'; ValueError (one line) for any other architecture."""
    model_type = config.get('model_type')
    if model_type == 'gpt2':
        return 'gpt2'
    if model_type in ('qwen2', 'qwen3'):
        if config.get('use_sliding_window'):
            raise ValueError(
                f'Hugging Face config: {model_type} with use_sliding_window is not supported'
            )
        return 'llama'
    if model_type in ('llama', 'mistral'):
        window = config.get('sliding_window')
        max_pos = config.get('max_position_embeddings', 0)
        if model_type == 'mistral' and window is not None and window < max_pos:
            raise ValueError(
                f'Hugging Face config: sliding-window attention (sliding_window '
                f'{window} < max_position_embeddings {max_pos}) is not supported'
            )
        return 'llama'
    raise ValueError(
        f'Hugging Face config: unsupported architecture model_type={model_type!r} '
        f'(architectures {config.get("architectures")}); supported: gpt2, llama, mistral, '
        'qwen2, qwen3, mixtral, qwen2_moe, qwen3_moe, deepseek_v3'
    )


def hf_config_namespace(config: dict) -> types.SimpleNamespace:
    """The config with transformers' defaults filled in (what `from_pretrained` would see)."""
    defaults = _GPT2_DEFAULTS if hf_family(config) == 'gpt2' else _LLAMA_DEFAULTS
    values = dict(defaults)
    values.update(config)
    if values.get('num_key_value_heads', 0) is None:
        values['num_key_value_heads'] = values['num_attention_heads']
    sizes = (
        ('vocab_size', 'n_positions', 'n_embd', 'n_layer', 'n_head')
        if defaults is _GPT2_DEFAULTS
        else (
            'vocab_size',
            'hidden_size',
            'intermediate_size',
            'num_hidden_layers',
            'num_attention_heads',
            'num_key_value_heads',
            'max_position_embeddings',
        )
    )
    for key in sizes:
        value = values[key]
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(
                f'Hugging Face config: {key} must be a positive integer, got {value!r}'
            )
    if defaults is _LLAMA_DEFAULTS:
        # transformers >= 5 writes RoPE settings as rope_parameters, older versions rope_theta.
        rope = values.get('rope_parameters') or {}
        values.setdefault('rope_theta', rope.get('rope_theta', 10000.0))
        if rope.get('rope_type', 'default') != 'default' and not values.get('rope_scaling'):
            values['rope_scaling'] = rope
        # Qwen2 has q/k/v biases (no output bias); Qwen3 normalises queries and keys per head.
        values['qkv_bias'] = config.get('model_type') == 'qwen2'
        values['qk_norm'] = config.get('model_type') == 'qwen3'
    return types.SimpleNamespace(**values)


def _weight_files(hf_dir: str) -> List[str]:
    """The safetensors files of a model directory (the single file, or the index's shards)."""
    single = os.path.join(hf_dir, SAFETENSORS_NAME)
    if os.path.isfile(single):
        return [single]
    index = os.path.join(hf_dir, SAFETENSORS_INDEX_NAME)
    if not os.path.isfile(index):
        raise ValueError(
            f'--load-dir {hf_dir}: neither {SAFETENSORS_NAME} nor {SAFETENSORS_INDEX_NAME}'
        )
    try:
        with open(index) as f:
            shards = sorted(set(json.load(f)['weight_map'].values()))
    except (ValueError, KeyError, AttributeError) as exc:
        raise ValueError(f'{index}: not a safetensors index ({type(exc).__name__}: {exc})')
    return [os.path.join(hf_dir, shard) for shard in shards]


def check_hf_files(hf_dir: str) -> None:
    """The weights a config.json promises are present (missing shards named)."""
    missing = [os.path.basename(p) for p in _weight_files(hf_dir) if not os.path.isfile(p)]
    if missing:
        raise ValueError(f'--load-dir {hf_dir}: partial model, shards missing: {missing}')


def _unreadable(path: str, exc: Exception) -> ValueError:
    reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return ValueError(f'{path}: cannot be read as safetensors (truncated or corrupt?): {reason}')


def load_hf_state_dict(hf_dir: str) -> Dict[str, torch.Tensor]:
    """Every tensor of model.safetensors (or of the shards its index lists)."""
    from safetensors.torch import load_file

    state_dict = {}
    for path in _weight_files(hf_dir):
        try:
            state_dict.update(load_file(path))
        except Exception as exc:
            raise _unreadable(path, exc) from exc
    return state_dict


def hf_tensor_shapes(hf_dir: str) -> Dict[str, tuple]:
    """{tensor name: (shape, file)} from the safetensors headers alone (no tensor is read);
    a truncated or corrupt file is a ValueError naming it."""
    from safetensors import safe_open

    shapes = {}
    for path in _weight_files(hf_dir):
        try:
            with safe_open(path, 'pt') as f:
                for name in f.keys():
                    shapes[name] = (tuple(f.get_slice(name).get_shape()), path)
        except Exception as exc:
            raise _unreadable(path, exc) from exc
    return shapes


def expected_hf_shapes(config: dict) -> Dict[str, tuple]:
    """{tensor name: shape} that config.json describes (Hugging Face names; GPT-2 without its
    "transformer." prefix). An untied output layer is listed as "lm_head.weight"."""
    c = hf_config_namespace(config)
    if hf_family(config) == 'gpt2':
        h, ffn, vocab = c.n_embd, c.n_inner or 4 * c.n_embd, c.vocab_size
        shapes = {'wte.weight': (vocab, h), 'wpe.weight': (c.n_positions, h)}
        per_layer = {
            'ln_1.weight': (h,),
            'ln_1.bias': (h,),
            'attn.c_attn.weight': (h, 3 * h),
            'attn.c_attn.bias': (3 * h,),
            'attn.c_proj.weight': (h, h),
            'attn.c_proj.bias': (h,),
            'ln_2.weight': (h,),
            'ln_2.bias': (h,),
            'mlp.c_fc.weight': (h, ffn),
            'mlp.c_fc.bias': (ffn,),
            'mlp.c_proj.weight': (ffn, h),
            'mlp.c_proj.bias': (h,),
        }
        layers, prefix = c.n_layer, 'h.{}.'
        final = {'ln_f.weight': (h,), 'ln_f.bias': (h,)}
    else:
        h, ffn, vocab = c.hidden_size, c.intermediate_size, c.vocab_size
        head_dim = c.head_dim or h // c.num_attention_heads
        q, kv = c.num_attention_heads * head_dim, c.num_key_value_heads * head_dim
        shapes = {'model.embed_tokens.weight': (vocab, h)}
        per_layer = {
            'input_layernorm.weight': (h,),
            'self_attn.q_proj.weight': (q, h),
            'self_attn.k_proj.weight': (kv, h),
            'self_attn.v_proj.weight': (kv, h),
            'self_attn.o_proj.weight': (h, q),
            'post_attention_layernorm.weight': (h,),
            'mlp.gate_proj.weight': (ffn, h),
            'mlp.up_proj.weight': (ffn, h),
            'mlp.down_proj.weight': (h, ffn),
        }
        if c.qkv_bias:
            per_layer.update(
                {
                    'self_attn.q_proj.bias': (q,),
                    'self_attn.k_proj.bias': (kv,),
                    'self_attn.v_proj.bias': (kv,),
                }
            )
        if c.qk_norm:
            per_layer.update({'self_attn.q_norm.weight': (head_dim,)})
            per_layer.update({'self_attn.k_norm.weight': (head_dim,)})
        if c.attention_bias:
            per_layer.update(
                {
                    'self_attn.q_proj.bias': (q,),
                    'self_attn.k_proj.bias': (kv,),
                    'self_attn.v_proj.bias': (kv,),
                    'self_attn.o_proj.bias': (h,),
                }
            )
        if c.mlp_bias:
            per_layer.update(
                {
                    'mlp.gate_proj.bias': (ffn,),
                    'mlp.up_proj.bias': (ffn,),
                    'mlp.down_proj.bias': (h,),
                }
            )
        layers, prefix = c.num_hidden_layers, 'model.layers.{}.'
        final = {'model.norm.weight': (h,)}
    for i in range(layers):
        shapes.update({prefix.format(i) + k: v for k, v in per_layer.items()})
    shapes.update(final)
    if not c.tie_word_embeddings:
        shapes['lm_head.weight'] = (vocab, h)
    return shapes


#: Buffers some Hugging Face saves carry besides the weights (attention masks, RoPE tables).
_IGNORED_HF_TENSORS = ('.attn.bias', '.attn.masked_bias', '.rotary_emb.inv_freq')


def check_hf_shapes(hf_dir: str, config: dict) -> None:
    """Every tensor config.json describes is there with its shape, and no other weight is.

    Raises:
        ValueError: one line naming the file, the tensor, both shapes and the config values.
    """
    found = hf_tensor_shapes(hf_dir)
    expected = expected_hf_shapes(config)
    if hf_family(config) == 'gpt2':
        found = {
            k[len('transformer.') :] if k.startswith('transformer.') else k: v
            for k, v in found.items()
        }
        # A tied GPT-2 may still store lm_head.weight (the same table).
        if 'lm_head.weight' in found and 'lm_head.weight' not in expected:
            expected['lm_head.weight'] = expected['wte.weight']
    config_path = os.path.join(hf_dir, CONFIG_NAME)
    for name, shape in expected.items():
        if name not in found:
            raise ValueError(
                f'--load-dir {hf_dir}: tensor {name} (shape {list(shape)}, from {config_path}) '
                f'is missing from the weights'
            )
        got, path = found[name]
        if got != shape:
            raise ValueError(
                f'{path}: tensor {name} has shape {list(got)} but {config_path} describes '
                f'{list(shape)}'
            )
    extra = sorted(n for n in found if n not in expected and not n.endswith(_IGNORED_HF_TENSORS))
    if extra:
        raise ValueError(
            f'{found[extra[0]][1]}: holds weights {config_path} does not describe: '
            f'{", ".join(extra[:5])}' + (f' ... ({len(extra)} in all)' if len(extra) > 5 else '')
        )


# ---------------------------------------------------------------------------------------------
# HF config -> our args


def megatron_args_list(
    config: dict,
    tokenizer_type: str,
    seq_length: Optional[int] = None,
    tokenizer_model: Optional[str] = None,
    vocab_file: Optional[str] = None,
    merge_file: Optional[str] = None,
) -> List[str]:
    """pretrain_gpt.py flags that build the architecture of a Hugging Face config."""
    c = hf_config_namespace(config)
    if hf_family(config) == 'gpt2':
        kw = hfm.gpt2_config_kwargs(c)  # validates activation and attention options
        args = [
            '--num-layers',
            c.n_layer,
            '--hidden-size',
            c.n_embd,
            '--num-attention-heads',
            c.n_head,
            '--ffn-hidden-size',
            kw['config']['ffn_hidden_size'],
            '--max-position-embeddings',
            c.n_positions,
            '--seq-length',
            seq_length or c.n_positions,
            '--norm-epsilon',
            c.layer_norm_epsilon,
            '--position-embedding-type',
            'learned_absolute',
            '--hidden-dropout',
            c.resid_pdrop,
            '--attention-dropout',
            c.attn_pdrop,
            '--init-method-std',
            c.initializer_range,
        ]
        if c.activation_function == 'gelu':
            # Megatron's fused bias-GeLU (on by default) is the tanh approximation (gelu_new);
            # the exact erf GeLU is the unfused F.gelu.
            args.append('--no-bias-gelu-fusion')
        if not c.tie_word_embeddings:
            args.append('--untie-embeddings-and-output-weights')
    else:
        kw = hfm.llama_config_kwargs(c)  # validates activation and RoPE scaling
        if c.attention_bias != c.mlp_bias:
            raise ValueError(
                f'Hugging Face config: attention_bias={c.attention_bias} with '
                f'mlp_bias={c.mlp_bias} is not supported (both or neither)'
            )
        args = llama_family_flags(
            c, kw['config']['kv_channels'], int(kw['model']['rotary_base']), seq_length
        )
        if not c.mlp_bias:
            args.append('--disable-bias-linear')
        if c.qkv_bias:
            args.append('--add-qkv-bias')
        if c.qk_norm:
            args.append('--qk-layernorm')
        if kw['model'].get('rope_scaling'):
            args += [
                '--use-rope-scaling',
                '--rope-scaling-factor',
                kw['model']['rope_scaling_factor'],
            ]
        if not c.tie_word_embeddings:
            args.append('--untie-embeddings-and-output-weights')
    args += tokenizer_flags(tokenizer_type, tokenizer_model, vocab_file, merge_file)
    return [str(a) for a in args]


def llama_family_flags(c, head_dim: int, rotary_base: int, seq_length=None) -> list:
    """The flags every Llama-style import starts with (RMSNorm, SwiGLU, RoPE, no dropout in the
    hidden states), and grouped-query attention when the config has fewer key/value heads."""
    args = [
        '--num-layers',
        c.num_hidden_layers,
        '--hidden-size',
        c.hidden_size,
        '--num-attention-heads',
        c.num_attention_heads,
        '--ffn-hidden-size',
        c.intermediate_size,
        '--kv-channels',
        head_dim,
        '--max-position-embeddings',
        c.max_position_embeddings,
        '--seq-length',
        seq_length or min(c.max_position_embeddings, 4096),
        '--norm-epsilon',
        c.rms_norm_eps,
        '--normalization',
        'RMSNorm',
        '--swiglu',
        '--position-embedding-type',
        'rope',
        '--rotary-base',
        rotary_base,
        '--hidden-dropout',
        0.0,
        '--attention-dropout',
        c.attention_dropout,
        '--init-method-std',
        c.initializer_range,
    ]
    if c.num_key_value_heads != c.num_attention_heads:
        args += ['--group-query-attention', '--num-query-groups', c.num_key_value_heads]
    return args


def tokenizer_flags(tokenizer_type, tokenizer_model=None, vocab_file=None, merge_file=None):
    """The flags every imported architecture ends with: its tokenizer (the files given),
    micro-batch 1 and mock data (a conversion reads no dataset)."""
    args = ['--tokenizer-type', tokenizer_type, '--micro-batch-size', 1, '--mock-data']
    for flag, value in (
        ('--tokenizer-model', tokenizer_model),
        ('--vocab-file', vocab_file),
        ('--merge-file', merge_file),
    ):
        if value is not None:
            args += [flag, value]
    return args


def validated_args(args_list: List[str], vocab_size: int):
    """Our full, validated args namespace for `args_list` at TP = EP = PP = 1, its
    `padded_vocab_size` the Hugging Face vocabulary (the table as stored)."""
    from megatron.training.arguments import parse_args
    from megatron.training.validation.argument_validation import validate_args

    args = parse_args(args_list=args_list)
    args.world_size = 1
    args.rank = 0
    with contextlib.redirect_stdout(io.StringIO()):  # validate_args prints every argument
        validate_args(args)
    args.padded_vocab_size = vocab_size
    return args


def megatron_args_from_hf(config: dict, tokenizer_type: str, **kwargs):
    """Our full, validated args namespace for a Hugging Face config (TP = PP = 1).

    `padded_vocab_size` is the Hugging Face vocabulary (the table as stored).
    """
    return validated_args(
        megatron_args_list(config, tokenizer_type, **kwargs), hf_config_namespace(config).vocab_size
    )


def full_state_dict_from_hf(config: dict, hf_state_dict) -> Dict[str, torch.Tensor]:
    """A full (TP = PP = 1) megatron-core GPT state dict from HF tensors."""
    c = hf_config_namespace(config)
    if hf_family(config) == 'gpt2':
        core = types.SimpleNamespace(num_attention_heads=c.n_head, kv_channels=c.n_embd // c.n_head)
        out = hfm.gpt2_hf_to_mcore_state_dict(hf_state_dict, core)
        if not c.tie_word_embeddings:
            out['output_layer.weight'] = hf_state_dict['lm_head.weight'].clone()
        return out
    head_dim = c.head_dim or c.hidden_size // c.num_attention_heads
    core = types.SimpleNamespace(
        num_attention_heads=c.num_attention_heads,
        num_query_groups=c.num_key_value_heads,
        kv_channels=head_dim,
    )
    return hfm.llama_hf_to_mcore_state_dict(hf_state_dict, core)


# ---------------------------------------------------------------------------------------------
# our args -> HF


def hf_family_of_args(args) -> str:
    """Which Hugging Face family a model's args map to; ValueError naming what does not fit."""
    norm = getattr(args, 'normalization', 'LayerNorm')
    pos = args.position_embedding_type
    if pos == 'learned_absolute' and norm == 'LayerNorm' and not args.swiglu:
        if not args.add_bias_linear:
            raise ValueError(
                'saver_hf: a GPT-2 style model (learned positions, LayerNorm) needs '
                'linear biases (--disable-bias-linear is set)'
            )
        return 'gpt2'
    if pos == 'rope' and norm == 'RMSNorm' and args.swiglu and getattr(args, 'qk_layernorm', False):
        if args.add_bias_linear or getattr(args, 'add_qkv_bias', False):
            raise ValueError('saver_hf: --qk-layernorm (Qwen3) with linear biases is not supported')
        return 'qwen3'
    if (
        pos == 'rope'
        and norm == 'RMSNorm'
        and args.swiglu
        and getattr(args, 'add_qkv_bias', False)
        and not args.add_bias_linear
    ):
        return 'qwen2'
    if pos == 'rope' and norm == 'RMSNorm' and args.swiglu:
        if getattr(args, 'rotary_percent', 1.0) != 1.0 or getattr(
            args, 'rotary_interleaved', False
        ):
            raise ValueError('saver_hf: partial or interleaved RoPE has no Llama equivalent')
        if getattr(args, 'add_qkv_bias', False) and not args.add_bias_linear:
            raise ValueError(
                'saver_hf: --add-qkv-bias without linear biases has no Llama equivalent'
            )
        return 'llama'
    raise ValueError(
        f'saver_hf: no Hugging Face family for position_embedding_type={pos}, '
        f'normalization={norm}, swiglu={args.swiglu} (GPT-2: learned_absolute + LayerNorm; '
        f'Llama: rope + RMSNorm + swiglu)'
    )


def _tanh_gelu(args) -> bool:
    """Whether a GeLU model computes the tanh approximation: --openai-gelu, or Megatron's fused
    bias-GeLU (on by default), which is that approximation too."""
    return bool(args.openai_gelu or (args.bias_gelu_fusion and args.add_bias_linear))


def hf_config_from_args(args, vocab_size: int, dtype: torch.dtype) -> dict:
    """config.json for a model with our `args` and `vocab_size` real tokens."""
    family = hf_family_of_args(args)
    heads = args.num_attention_heads
    kv = args.kv_channels or args.hidden_size // heads
    torch_dtype = {v: k for k, v in _DTYPES.items()}.get(dtype, 'float32')
    tied = not args.untie_embeddings_and_output_weights
    if family == 'gpt2':
        if kv * heads != args.hidden_size:
            raise ValueError(
                f'saver_hf: GPT-2 needs kv_channels x heads ({kv} x {heads}) == '
                f'hidden size ({args.hidden_size})'
            )
        return {
            'architectures': ['GPT2LMHeadModel'],
            'model_type': 'gpt2',
            'vocab_size': vocab_size,
            'n_positions': args.max_position_embeddings,
            'n_embd': args.hidden_size,
            'n_layer': args.num_layers,
            'n_head': heads,
            'n_inner': args.ffn_hidden_size,
            'activation_function': 'gelu_new' if _tanh_gelu(args) else 'gelu',
            'layer_norm_epsilon': args.norm_epsilon,
            'resid_pdrop': args.hidden_dropout,
            'embd_pdrop': args.hidden_dropout,
            'attn_pdrop': args.attention_dropout,
            'initializer_range': args.init_method_std,
            'tie_word_embeddings': tied,
            'torch_dtype': torch_dtype,
            # GPT-2's <|endoftext|> (the last id of smaller vocabularies).
            'bos_token_id': min(50256, vocab_size - 1),
            'eos_token_id': min(50256, vocab_size - 1),
        }
    groups = args.num_query_groups if args.group_query_attention else heads
    architecture = {
        'llama': 'LlamaForCausalLM',
        'qwen2': 'Qwen2ForCausalLM',
        'qwen3': 'Qwen3ForCausalLM',
    }[family]
    rope = {'rope_theta': float(args.rotary_base), 'rope_type': 'default'}
    if getattr(args, 'use_rope_scaling', False):
        rope.update(
            rope_type='llama3',
            factor=float(args.rope_scaling_factor),
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=8192,
        )
    return {
        'architectures': [architecture],
        'model_type': family,
        'vocab_size': vocab_size,
        'hidden_size': args.hidden_size,
        'intermediate_size': args.ffn_hidden_size,
        'num_hidden_layers': args.num_layers,
        'num_attention_heads': heads,
        'num_key_value_heads': groups,
        'head_dim': kv,
        'hidden_act': 'silu',
        'max_position_embeddings': args.max_position_embeddings,
        'rms_norm_eps': args.norm_epsilon,
        'rope_theta': float(args.rotary_base),
        'rope_parameters': rope,
        'attention_bias': bool(args.add_bias_linear),
        'mlp_bias': bool(args.add_bias_linear),
        'attention_dropout': args.attention_dropout,
        'initializer_range': args.init_method_std,
        'tie_word_embeddings': tied,
        'torch_dtype': torch_dtype,
    }


def hf_state_dict_from_full(config: dict, full: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """HF tensors (without a tied lm_head) from a full megatron-core state dict."""
    c = hf_config_namespace(config)
    vocab = c.vocab_size
    if hf_family(config) == 'gpt2':
        core = types.SimpleNamespace(num_attention_heads=c.n_head, kv_channels=c.n_embd // c.n_head)
        out = hfm.mcore_to_gpt2_hf_state_dict(full, core, true_vocab_size=vocab)
    else:
        core = types.SimpleNamespace(
            num_attention_heads=c.num_attention_heads,
            num_query_groups=c.num_key_value_heads,
            kv_channels=c.head_dim,
            ffn_hidden_size=c.intermediate_size,
        )
        out = hfm.mcore_to_llama_hf_state_dict(full, core, true_vocab_size=vocab)
    if c.tie_word_embeddings:
        out.pop('lm_head.weight', None)
    return out


def _write_atomically(path: str, write) -> None:
    """write(tmp) then rename over `path`: a reader sees the old file or the new one."""
    tmp = f'{path}.tmp.{os.getpid()}'
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def _remove_stale_weights(hf_dir: str) -> None:
    """An earlier sharded save's index and shards (a single model.safetensors replaces them)."""
    index = os.path.join(hf_dir, SAFETENSORS_INDEX_NAME)
    if not os.path.isfile(index):
        return
    try:
        with open(index) as f:
            shards = set(json.load(f)['weight_map'].values())
    except (ValueError, KeyError, AttributeError):
        shards = set()
    os.remove(index)
    for shard in shards:
        path = os.path.join(hf_dir, shard)
        if os.path.isfile(path) and os.path.basename(path) != SAFETENSORS_NAME:
            os.remove(path)


def save_hf_dir(hf_dir: str, config: dict, state_dict, tokenizer_dir: Optional[str] = None):
    """Write model.safetensors, config.json and (from tokenizer_dir) the tokenizer files.

    Each file is written under a temporary name and renamed over the old one, the weights
    before the config, so an overwrite killed half-way never pairs a config with weights that
    are neither the old nor the new ones (a shape mismatch is refused by transformers).
    """
    from safetensors.torch import save_file

    os.makedirs(hf_dir, exist_ok=True)
    tensors = {k: v.contiguous() for k, v in state_dict.items()}
    _write_atomically(
        os.path.join(hf_dir, SAFETENSORS_NAME),
        lambda tmp: save_file(tensors, tmp, metadata={'format': 'pt'}),
    )
    _remove_stale_weights(hf_dir)

    def write_config(tmp):
        with open(tmp, 'w') as f:
            json.dump(config, f, indent=2, sort_keys=True)

    _write_atomically(os.path.join(hf_dir, CONFIG_NAME), write_config)
    copied = []
    if tokenizer_dir is not None:
        for name in TOKENIZER_FILES:
            src = os.path.join(tokenizer_dir, name)
            if os.path.isfile(src):
                shutil.copyfile(src, os.path.join(hf_dir, name))
                copied.append(name)
    return copied


def copy_gpt2_bpe_files(hf_dir: str, vocab_file: str, merge_file: str) -> List[str]:
    """Megatron's GPT-2 BPE files as the vocab.json / merges.txt transformers reads."""
    shutil.copyfile(vocab_file, os.path.join(hf_dir, 'vocab.json'))
    shutil.copyfile(merge_file, os.path.join(hf_dir, 'merges.txt'))
    return ['vocab.json', 'merges.txt']
