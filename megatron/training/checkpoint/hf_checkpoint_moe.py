"""Hugging Face Mixtral / Qwen2-MoE / Qwen3-MoE directories <-> this project's args and full
megatron-core state dicts (the MoE counterpart of hf_checkpoint.py, whose file helpers it uses).

- Mixtral (`model_type` "mixtral"): Llama attention, every layer MoE with `num_local_experts`
  SwiGLU experts of size `intermediate_size`, top-`num_experts_per_tok` routing renormalized
  (Megatron's default router), untied output layer, `rope_theta` (Megatron's loader drops it;
  here it becomes --rotary-base).
- Qwen2-MoE (`model_type` "qwen2_moe"): q/k/v biases, experts of `moe_intermediate_size`, a
  shared expert of `shared_expert_intermediate_size` with a sigmoid gate, routing without
  renormalization when `norm_topk_prob` is false (--moe-router-pre-softmax), dense layers of
  `intermediate_size` where `mlp_only_layers` / `decoder_sparse_step` say so (--moe-layer-freq).
- Qwen3-MoE (`model_type` "qwen3_moe"): Qwen3 attention (per-head q/k RMSNorm, --qk-layernorm;
  explicit `head_dim`; no biases), experts as Qwen2-MoE's without a shared expert, renormalized
  top-k with `norm_topk_prob` (else --moe-router-pre-softmax), dense layers likewise.

The weight renaming lives in megatron/core/models/gpt/hf_weight_mapping_moe.py.
"""

import types
from typing import Dict, List, Optional

import torch

from megatron.core.models.gpt import hf_weight_mapping_moe as hfm_moe
from megatron.training.checkpoint import hf_checkpoint as hfc

MOE_MODEL_TYPES = ('mixtral', 'qwen2_moe', 'qwen3_moe')

# transformers' defaults for the keys a config.json may leave out.
_COMMON = dict(
    hidden_act='silu',
    initializer_range=0.02,
    tie_word_embeddings=False,
    attention_dropout=0.0,
    head_dim=None,
    rope_scaling=None,
    sliding_window=None,
)
_MIXTRAL_DEFAULTS = dict(
    _COMMON,
    vocab_size=32000,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    max_position_embeddings=4096 * 32,
    rms_norm_eps=1e-5,
    num_experts_per_tok=2,
    num_local_experts=8,
    router_jitter_noise=0.0,
    rope_theta=1e6,
)
_QWEN2_MOE_DEFAULTS = dict(
    _COMMON,
    vocab_size=151936,
    hidden_size=2048,
    intermediate_size=5632,
    num_hidden_layers=24,
    num_attention_heads=16,
    num_key_value_heads=16,
    max_position_embeddings=32768,
    rms_norm_eps=1e-6,
    decoder_sparse_step=1,
    moe_intermediate_size=1408,
    shared_expert_intermediate_size=5632,
    num_experts_per_tok=4,
    num_experts=60,
    norm_topk_prob=False,
    mlp_only_layers=[],
    qkv_bias=True,
    use_sliding_window=False,
    rope_theta=10000.0,
)


_QWEN3_MOE_DEFAULTS = dict(
    _COMMON,
    vocab_size=151936,
    hidden_size=2048,
    intermediate_size=6144,
    num_hidden_layers=24,
    num_attention_heads=32,
    num_key_value_heads=4,
    max_position_embeddings=32768,
    rms_norm_eps=1e-6,
    decoder_sparse_step=1,
    moe_intermediate_size=768,
    num_experts_per_tok=8,
    num_experts=128,
    norm_topk_prob=False,
    mlp_only_layers=[],
    attention_bias=False,
    use_sliding_window=False,
    rope_theta=10000.0,
)
_DEFAULTS = {
    'mixtral': _MIXTRAL_DEFAULTS,
    'qwen2_moe': _QWEN2_MOE_DEFAULTS,
    'qwen3_moe': _QWEN3_MOE_DEFAULTS,
}


def is_moe_hf_config(config: dict) -> bool:
    """Whether a config.json describes a Mixtral or Qwen2-MoE model."""
    return config.get('model_type') in MOE_MODEL_TYPES


def hf_moe_config_namespace(config: dict) -> types.SimpleNamespace:
    """The config with transformers' defaults filled in, checked for what we cannot represent."""
    model_type = config.get('model_type')
    if model_type not in MOE_MODEL_TYPES:
        raise ValueError(f'Hugging Face config: model_type {model_type!r} is not an MoE model')
    values = dict(_DEFAULTS[model_type])
    values.update(config)
    if model_type == 'qwen3_moe' and values.get('attention_bias'):
        raise ValueError('Hugging Face config: Qwen3-MoE with attention_bias is not supported')
    rope = values.get('rope_parameters') or {}
    if 'rope_theta' in rope:
        values['rope_theta'] = rope['rope_theta']
    if rope.get('rope_type', 'default') != 'default' or values.get('rope_scaling'):
        raise ValueError(
            f'Hugging Face config: rope scaling {rope or values["rope_scaling"]} is not supported'
        )
    if values['num_key_value_heads'] is None:
        values['num_key_value_heads'] = values['num_attention_heads']
    if values['hidden_act'] != 'silu':
        raise ValueError(f'Hugging Face config: hidden_act {values["hidden_act"]!r} (only silu)')
    window = values.get('sliding_window')
    if model_type != 'mixtral' and not values.get('use_sliding_window'):
        window = None
    if window is not None and window < values['max_position_embeddings']:
        raise ValueError(
            f'Hugging Face config: sliding-window attention (sliding_window {window}) is not '
            'supported'
        )
    values['num_moe_experts'] = values.get('num_local_experts', values.get('num_experts'))
    if model_type == 'mixtral':
        values['moe_ffn_hidden_size'] = values['intermediate_size']
        values['moe_shared_expert_intermediate_size'] = None
        values['moe_layer_pattern'] = [1] * values['num_hidden_layers']
        if values['num_experts_per_tok'] == 1:
            raise ValueError(
                'Hugging Face config: Mixtral with num_experts_per_tok 1 (renormalized top-1, '
                'a constant weight of 1) has no Megatron router equivalent'
            )
    else:
        values['moe_ffn_hidden_size'] = values['moe_intermediate_size']
        values['moe_shared_expert_intermediate_size'] = values.get(
            'shared_expert_intermediate_size'
        )
        values['moe_layer_pattern'] = hfm_moe.qwen2_moe_layer_pattern(
            values['num_hidden_layers'], values['decoder_sparse_step'], values['mlp_only_layers']
        )
    return types.SimpleNamespace(**values)


def megatron_args_list_moe(
    config: dict,
    tokenizer_type: str,
    seq_length: Optional[int] = None,
    tokenizer_model: Optional[str] = None,
    vocab_file: Optional[str] = None,
    merge_file: Optional[str] = None,
) -> List[str]:
    """pretrain_gpt.py flags that build the architecture of a Mixtral / Qwen2-MoE config."""
    c = hf_moe_config_namespace(config)
    head_dim = c.head_dim or c.hidden_size // c.num_attention_heads
    args = hfc.llama_family_flags(c, head_dim, int(c.rope_theta), seq_length)
    args += [
        '--disable-bias-linear',
        '--num-experts',
        c.num_moe_experts,
        '--moe-router-topk',
        c.num_experts_per_tok,
        '--moe-ffn-hidden-size',
        c.moe_ffn_hidden_size,
    ]
    if not c.tie_word_embeddings:
        args.append('--untie-embeddings-and-output-weights')
    if config['model_type'] == 'qwen2_moe':
        args += [
            '--moe-shared-expert-intermediate-size',
            c.moe_shared_expert_intermediate_size,
            '--moe-shared-expert-gate',
        ]
        if not c.norm_topk_prob:
            args.append('--moe-router-pre-softmax')
        if c.qkv_bias:
            args.append('--add-qkv-bias')
    if config['model_type'] == 'qwen3_moe':
        args.append('--qk-layernorm')
        if not c.norm_topk_prob:
            args.append('--moe-router-pre-softmax')
    if config['model_type'] != 'mixtral' and not all(c.moe_layer_pattern):
        args += ['--moe-layer-freq', str(c.moe_layer_pattern).replace(' ', '')]
    args += hfc.tokenizer_flags(tokenizer_type, tokenizer_model, vocab_file, merge_file)
    return [str(a) for a in args]


def megatron_args_from_hf_moe(config: dict, tokenizer_type: str, **kwargs):
    """Our full, validated args namespace for a Mixtral / Qwen2-MoE config (TP = EP = PP = 1)."""
    return hfc.validated_args(
        megatron_args_list_moe(config, tokenizer_type, **kwargs),
        hf_moe_config_namespace(config).vocab_size,
    )


def _tensor_shapes(hf_dir: str) -> Dict[str, tuple]:
    """{name: shape} of every tensor of the directory's safetensors files (headers only)."""
    import json
    import os

    from safetensors import safe_open

    single = os.path.join(hf_dir, hfc.SAFETENSORS_NAME)
    if os.path.isfile(single):
        files = [single]
    else:
        with open(os.path.join(hf_dir, hfc.SAFETENSORS_INDEX_NAME)) as f:
            names = sorted(set(json.load(f)['weight_map'].values()))
        files = [os.path.join(hf_dir, n) for n in names]
    shapes = {}
    for path in files:
        with safe_open(path, framework='pt') as f:
            for name in f.keys():
                shapes[name] = tuple(f.get_slice(name).get_shape())
    return shapes


def check_moe_hf_tensors(hf_dir: str, config: dict) -> None:
    """Every router, expert and shared-expert weight the config promises is in the files with
    its shape (read from the file headers, before any tensor): ValueError in one line naming
    the first missing or mis-shaped one."""
    c = hf_moe_config_namespace(config)
    router, prefix, gate, up, down = hfm_moe._EXPERT_KEYS[config['model_type']]
    h, e, f = c.hidden_size, c.num_moe_experts, c.moe_ffn_hidden_size
    expected = {}
    for i, moe in enumerate(c.moe_layer_pattern):
        p = f'model.layers.{i}.'
        if not moe:
            continue
        expected[p + router] = (e, h)
        for j in range(e):
            q = p + prefix.format(j=j)
            expected[q + f'{gate}.weight'] = expected[q + f'{up}.weight'] = (f, h)
            expected[q + f'{down}.weight'] = (h, f)
        fs = c.moe_shared_expert_intermediate_size
        if fs is not None:
            s = p + 'mlp.shared_expert.'
            expected[s + 'gate_proj.weight'] = expected[s + 'up_proj.weight'] = (fs, h)
            expected[s + 'down_proj.weight'] = (h, fs)
            expected[p + 'mlp.shared_expert_gate.weight'] = (1, h)
    shapes = _tensor_shapes(hf_dir)
    for name, shape in expected.items():
        if name not in shapes:
            raise ValueError(f'--load-dir {hf_dir}: expert weight {name} is missing')
        if shapes[name] != shape:
            raise ValueError(
                f'--load-dir {hf_dir}: expert weight {name} has shape {shapes[name]}, the config '
                f'({c.num_moe_experts} experts, hidden {h}) needs {shape}'
            )
    expert_part = '.' + prefix.split('{j}')[0].rstrip('.').rsplit('.', 1)[-1] + '.'  # '.experts.'
    extra = sorted(n for n in shapes if expert_part in n and n not in expected)
    if extra:
        raise ValueError(
            f'--load-dir {hf_dir}: expert weight {extra[0]} is not described by the config '
            f'({c.num_moe_experts} experts per layer; {len(extra)} such weight(s))'
        )


def _mapping_config(c) -> types.SimpleNamespace:
    return types.SimpleNamespace(
        num_layers=c.num_hidden_layers,
        hidden_size=c.hidden_size,
        num_attention_heads=c.num_attention_heads,
        num_query_groups=c.num_key_value_heads,
        kv_channels=c.head_dim or c.hidden_size // c.num_attention_heads,
        num_moe_experts=c.num_moe_experts,
        moe_ffn_hidden_size=c.moe_ffn_hidden_size,
        ffn_hidden_size=c.intermediate_size,
        moe_shared_expert_intermediate_size=c.moe_shared_expert_intermediate_size,
        moe_layer_pattern=c.moe_layer_pattern,
    )


def full_state_dict_from_hf_moe(config: dict, hf_state_dict) -> Dict[str, torch.Tensor]:
    """A full (TP = EP = PP = 1) megatron-core GPT state dict from Mixtral / Qwen2-MoE tensors."""
    c = hf_moe_config_namespace(config)
    return hfm_moe.moe_hf_to_mcore_state_dict(
        hf_state_dict, config['model_type'], _mapping_config(c)
    )


# ---------------------------------------------------------------------------------------------
# our args -> HF


def hf_moe_family_of_args(args) -> str:
    """'mixtral', 'qwen2_moe' or 'qwen3_moe' (--qk-layernorm) for an MoE model's args;
    ValueError naming what does not fit."""
    reasons = []
    if args.position_embedding_type != 'rope' or getattr(args, 'normalization', '') != 'RMSNorm':
        reasons.append('RoPE and RMSNorm')
    if not args.swiglu:
        reasons.append('SwiGLU experts')
    if args.add_bias_linear:
        reasons.append('no linear biases (--disable-bias-linear)')
    if getattr(args, 'rotary_percent', 1.0) != 1.0 or getattr(args, 'rotary_interleaved', False):
        reasons.append('full, non-interleaved RoPE')
    if args.moe_router_score_function != 'softmax' or args.moe_router_enable_expert_bias:
        reasons.append('softmax routing without an expert bias')
    if args.moe_router_topk_scaling_factor is not None:
        reasons.append('no --moe-router-topk-scaling-factor')
    if reasons:
        raise ValueError(
            'saver_hf: an MoE model converts to Mixtral / Qwen2-MoE only with ' + ', '.join(reasons)
        )
    if args.moe_shared_expert_intermediate_size is not None:
        if not args.moe_shared_expert_gate:
            raise ValueError(
                'saver_hf: shared experts without --moe-shared-expert-gate have no Hugging Face '
                'equivalent (Qwen2-MoE gates its shared expert)'
            )
        if getattr(args, 'qk_layernorm', False):
            raise ValueError(
                'saver_hf: --qk-layernorm with shared experts has no Hugging Face equivalent '
                '(Qwen3-MoE has no shared experts, Qwen2-MoE no q/k norms)'
            )
        return 'qwen2_moe'
    if getattr(args, 'qk_layernorm', False):
        if getattr(args, 'add_qkv_bias', False):
            raise ValueError('saver_hf: --qk-layernorm (Qwen3-MoE) with --add-qkv-bias')
        return 'qwen3_moe'
    freq = args.moe_layer_freq
    if args.moe_router_pre_softmax or getattr(args, 'add_qkv_bias', False) or freq != 1:
        raise ValueError(
            'saver_hf: without shared experts the model must be a Mixtral: renormalized routing '
            '(no --moe-router-pre-softmax), no --add-qkv-bias, every layer MoE'
        )
    return 'mixtral'


def _moe_pattern(args) -> List[int]:
    freq = args.moe_layer_freq
    if isinstance(freq, int):
        return [1 if i % freq == 0 else 0 for i in range(args.num_layers)]
    return list(freq)


def hf_moe_config_from_args(args, vocab_size: int, dtype: torch.dtype) -> dict:
    """config.json of the Mixtral / Qwen2-MoE equivalent of an MoE model with our `args`."""
    family = hf_moe_family_of_args(args)
    heads = args.num_attention_heads
    kv = args.kv_channels or args.hidden_size // heads
    groups = args.num_query_groups if args.group_query_attention else heads
    moe_ffn = args.moe_ffn_hidden_size or args.ffn_hidden_size
    config = {
        'vocab_size': vocab_size,
        'hidden_size': args.hidden_size,
        'num_hidden_layers': args.num_layers,
        'num_attention_heads': heads,
        'num_key_value_heads': groups,
        'head_dim': kv,
        'hidden_act': 'silu',
        'max_position_embeddings': args.max_position_embeddings,
        'rms_norm_eps': args.norm_epsilon,
        'rope_theta': float(args.rotary_base),
        'rope_parameters': {'rope_theta': float(args.rotary_base), 'rope_type': 'default'},
        'attention_dropout': args.attention_dropout,
        'initializer_range': args.init_method_std,
        'tie_word_embeddings': not args.untie_embeddings_and_output_weights,
        'torch_dtype': {v: k for k, v in hfc._DTYPES.items()}.get(dtype, 'float32'),
        'num_experts_per_tok': args.moe_router_topk,
    }
    if family == 'mixtral':
        config.update(
            architectures=['MixtralForCausalLM'],
            model_type='mixtral',
            intermediate_size=moe_ffn,
            num_local_experts=args.num_experts,
            sliding_window=None,
        )
        return config
    pattern = _moe_pattern(args)
    if family == 'qwen3_moe':
        config.update(
            architectures=['Qwen3MoeForCausalLM'],
            model_type='qwen3_moe',
            intermediate_size=args.ffn_hidden_size,
            moe_intermediate_size=moe_ffn,
            num_experts=args.num_experts,
            norm_topk_prob=not args.moe_router_pre_softmax,
            decoder_sparse_step=1,
            mlp_only_layers=[i for i, moe in enumerate(pattern) if not moe],
            attention_bias=False,
            use_sliding_window=False,
        )
        return config
    config.update(
        architectures=['Qwen2MoeForCausalLM'],
        model_type='qwen2_moe',
        intermediate_size=args.ffn_hidden_size,
        moe_intermediate_size=moe_ffn,
        shared_expert_intermediate_size=args.moe_shared_expert_intermediate_size,
        num_experts=args.num_experts,
        norm_topk_prob=not args.moe_router_pre_softmax,
        decoder_sparse_step=1,
        mlp_only_layers=[i for i, moe in enumerate(pattern) if not moe],
        qkv_bias=bool(getattr(args, 'add_qkv_bias', False)),
        use_sliding_window=False,
    )
    return config


def hf_moe_state_dict_from_full(config: dict, full: Dict[str, torch.Tensor]):
    """HF tensors (without a tied lm_head) from a full megatron-core MoE state dict."""
    c = hf_moe_config_namespace(config)
    out = hfm_moe.mcore_to_moe_hf_state_dict(
        full, config['model_type'], _mapping_config(c), true_vocab_size=c.vocab_size
    )
    if c.tie_word_embeddings:
        out.pop('lm_head.weight', None)
    return out
