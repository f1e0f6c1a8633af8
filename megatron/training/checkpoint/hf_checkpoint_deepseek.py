"""Hugging Face DeepSeek-V3 directories (`model_type` "deepseek_v3", `DeepseekV3ForCausalLM`)
<-> this project's args and full megatron-core state dicts (MLA + MoE, the DeepSeek-V3 member of
hf_checkpoint.py / hf_checkpoint_moe.py, whose file helpers it uses).

config.json -> flags:

- MLA: `q_lora_rank` (None: one query projection), `kv_lora_rank`, `qk_nope_head_dim`,
  `qk_rope_head_dim`, `v_head_dim` -> --q-lora-rank, --kv-lora-rank, --qk-head-dim,
  --qk-pos-emb-head-dim, --v-head-dim, with --multi-latent-attention --qk-layernorm (the latent
  norms). `rope_interleave` must be true (our MLA rotates the interleaved pairs as HF does then).
- RoPE: `rope_parameters` "default" -> --rope-type rope; "yarn" -> --rope-type yarn with
  --rotary-scaling-factor, --yarn-original-max-position-embeddings, --yarn-beta-fast / -slow,
  and --mscale / --mscale-all-dim only when both are set (transformers then takes their ratio;
  otherwise its cos/sin scale is 0.1 ln(factor) + 1, our --mscale 1 --mscale-all-dim 0).
- MoE: `n_routed_experts`, `num_experts_per_tok`, `moe_intermediate_size`, `n_shared_experts`
  (x moe_intermediate_size, ungated), `first_k_dense_replace` (--moe-layer-freq), sigmoid
  routing with the expert bias in fp32 (`e_score_correction_bias`), `routed_scaling_factor`,
  group-limited top-k (`n_group` / `topk_group`, when n_group > 1). HF renormalizes the top-k
  weights only with `norm_topk_prob`; our sigmoid router always does for k > 1, so other
  settings are refused.
- Multi-token prediction: `num_nextn_predict_layers` (transformers' `num_mtp_layers`) modules are
  stored, as DeepSeek's checkpoints hold them, as the extra layers `model.layers.{L + k}`
  (enorm, hnorm, eh_proj, shared_head.norm, the decoder layer; shared_head.head / embed_tokens
  copies of the main tables). They are imported (--mtp-num-layers) when the files hold them
  and exported back; DeepseekV3ForCausalLM itself ignores them (transformers' generic
  `MtpModel` loads them).

The weight renaming lives in megatron/core/models/gpt/hf_weight_mapping_deepseek.py.
"""

import types
from typing import Dict, List, Optional

import torch

from megatron.core.models.gpt import hf_weight_mapping_deepseek as hfm_ds
from megatron.training.checkpoint import hf_checkpoint as hfc

MODEL_TYPE = 'deepseek_v3'

# transformers' DeepseekV3Config defaults for the keys a config.json may leave out.
_DEFAULTS = dict(
    vocab_size=129280,
    hidden_size=7168,
    intermediate_size=18432,
    moe_intermediate_size=2048,
    num_hidden_layers=61,
    num_attention_heads=128,
    n_shared_experts=1,
    n_routed_experts=256,
    routed_scaling_factor=2.5,
    kv_lora_rank=512,
    q_lora_rank=1536,
    qk_rope_head_dim=64,
    v_head_dim=128,
    qk_nope_head_dim=128,
    n_group=8,
    topk_group=4,
    num_experts_per_tok=8,
    first_k_dense_replace=3,
    norm_topk_prob=True,
    hidden_act='silu',
    max_position_embeddings=4096,
    initializer_range=0.02,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    rope_interleave=True,
    attention_bias=False,
    attention_dropout=0.0,
    num_nextn_predict_layers=1,
)


def is_deepseek_hf_config(config: dict) -> bool:
    return config.get('model_type') == MODEL_TYPE


def _rope(values: dict) -> dict:
    rope = dict(values.get('rope_parameters') or values.get('rope_scaling') or {})
    rope.setdefault('rope_theta', values.get('rope_theta', 10000.0))
    rope.setdefault('rope_type', rope.get('type', 'default'))
    return rope


def deepseek_config_namespace(config: dict) -> types.SimpleNamespace:
    """The config with transformers' defaults filled in; ValueError (one line) for what our
    model cannot represent."""
    values = dict(_DEFAULTS)
    values.update(config)
    if 'num_mtp_layers' in config:
        values['num_nextn_predict_layers'] = config['num_mtp_layers']
    bad = []
    if values['hidden_act'] != 'silu':
        bad.append(f'hidden_act {values["hidden_act"]!r} (only silu)')
    if values['attention_bias']:
        bad.append('attention_bias true')
    if not values['rope_interleave']:
        bad.append('rope_interleave false')
    if values['num_experts_per_tok'] > 1 and not values['norm_topk_prob']:
        bad.append('norm_topk_prob false (our sigmoid router renormalizes the top-k)')
    if values['num_experts_per_tok'] == 1 and values['norm_topk_prob']:
        bad.append('norm_topk_prob with num_experts_per_tok 1')
    rope = _rope(values)
    if rope['rope_type'] not in ('default', 'yarn'):
        bad.append(f'rope_type {rope["rope_type"]!r} (default or yarn)')
    if rope.get('attention_factor') is not None:
        bad.append('rope_parameters.attention_factor')
    if bad:
        raise ValueError(
            'Hugging Face config: DeepSeek-V3 with ' + ', '.join(bad) + ' is not supported'
        )
    values['rope'] = rope
    first_k = min(values['first_k_dense_replace'] or 0, values['num_hidden_layers'])
    values['moe_layer_pattern'] = [int(i >= first_k) for i in range(values['num_hidden_layers'])]
    values['mtp_layers'] = values['num_nextn_predict_layers'] or 0
    return types.SimpleNamespace(**values)


def mtp_layers_in_files(hf_dir: str, config: dict) -> int:
    """How many of the config's MTP modules the weight files hold (0 when they hold none:
    a DeepseekV3ForCausalLM.save_pretrained directory)."""
    c = deepseek_config_namespace(config)
    names = hfc.hf_tensor_shapes(hf_dir)
    found = 0
    for k in range(c.mtp_layers):
        if f'model.layers.{c.num_hidden_layers + k}.eh_proj.weight' not in names:
            break
        found += 1
    return found


def megatron_args_list_deepseek(
    config: dict,
    tokenizer_type: str,
    seq_length: Optional[int] = None,
    mtp_layers: int = 0,
    tokenizer_model: Optional[str] = None,
    vocab_file: Optional[str] = None,
    merge_file: Optional[str] = None,
) -> List[str]:
    """pretrain_gpt.py flags that build the architecture of a DeepSeek-V3 config."""
    c = deepseek_config_namespace(config)
    rope = c.rope
    args = [
        *('--num-layers', c.num_hidden_layers, '--hidden-size', c.hidden_size),
        *('--num-attention-heads', c.num_attention_heads),
        *('--ffn-hidden-size', c.intermediate_size),
        *('--max-position-embeddings', c.max_position_embeddings),
        *('--seq-length', seq_length or min(c.max_position_embeddings, 4096)),
        *('--norm-epsilon', c.rms_norm_eps, '--normalization', 'RMSNorm', '--swiglu'),
        '--disable-bias-linear',
        *('--position-embedding-type', 'rope', '--rotary-base', int(rope['rope_theta'])),
        *('--hidden-dropout', 0.0, '--attention-dropout', c.attention_dropout),
        *('--init-method-std', c.initializer_range),
        *('--multi-latent-attention', '--qk-layernorm'),
        *('--kv-lora-rank', c.kv_lora_rank, '--qk-head-dim', c.qk_nope_head_dim),
        *('--qk-pos-emb-head-dim', c.qk_rope_head_dim, '--v-head-dim', c.v_head_dim),
        *('--num-experts', c.n_routed_experts, '--moe-router-topk', c.num_experts_per_tok),
        *('--moe-ffn-hidden-size', c.moe_intermediate_size),
        *('--moe-router-score-function', 'sigmoid', '--moe-router-enable-expert-bias'),
        *('--moe-router-topk-scaling-factor', c.routed_scaling_factor),
        *('--moe-router-dtype', 'fp32', '--moe-router-load-balancing-type', 'none'),
    ]
    if c.q_lora_rank is not None:
        args += ['--q-lora-rank', c.q_lora_rank]
    if rope['rope_type'] == 'yarn':
        args += [
            *('--rope-type', 'yarn', '--rotary-scaling-factor', rope['factor']),
            *('--yarn-original-max-position-embeddings', rope['original_max_position_embeddings']),
            *('--yarn-beta-fast', rope.get('beta_fast') or 32.0),
            *('--yarn-beta-slow', rope.get('beta_slow') or 1.0),
        ]
        if rope.get('mscale') and rope.get('mscale_all_dim'):
            args += ['--mscale', rope['mscale'], '--mscale-all-dim', rope['mscale_all_dim']]
        else:
            args += ['--mscale', 1.0, '--mscale-all-dim', 0.0]
        if not rope.get('truncate', True):
            args.append('--no-yarn-correction-range-round-to-int')
    else:
        args += ['--rope-type', 'rope']
    if c.n_shared_experts:
        args += [
            '--moe-shared-expert-intermediate-size',
            c.n_shared_experts * c.moe_intermediate_size,
        ]
    if c.n_group and c.n_group > 1:
        args += ['--moe-router-num-groups', c.n_group, '--moe-router-group-topk', c.topk_group]
    if not all(c.moe_layer_pattern):
        args += ['--moe-layer-freq', str(c.moe_layer_pattern).replace(' ', '')]
    if mtp_layers:
        args += ['--mtp-num-layers', mtp_layers]
    if not c.tie_word_embeddings:
        args.append('--untie-embeddings-and-output-weights')
    args += hfc.tokenizer_flags(tokenizer_type, tokenizer_model, vocab_file, merge_file)
    return [str(a) for a in args]


def megatron_args_from_hf_deepseek(config: dict, tokenizer_type: str, **kwargs):
    """Our full, validated args namespace for a DeepSeek-V3 config (TP = EP = PP = 1)."""
    return hfc.validated_args(
        megatron_args_list_deepseek(config, tokenizer_type, **kwargs),
        deepseek_config_namespace(config).vocab_size,
    )


def expected_deepseek_shapes(config: dict, mtp_layers: int = 0) -> Dict[str, tuple]:
    """{HF tensor name: shape} of a DeepSeek-V3 directory with `mtp_layers` MTP modules (files
    of DeepseekV3ForCausalLM.save_pretrained: per-expert weights)."""
    c = deepseek_config_namespace(config)
    h, n = c.hidden_size, c.num_attention_heads
    dq = c.qk_nope_head_dim + c.qk_rope_head_dim

    def mlp(prefix, f):
        return {
            prefix + 'gate_proj.weight': (f, h),
            prefix + 'up_proj.weight': (f, h),
            prefix + 'down_proj.weight': (h, f),
        }

    def layer(p, moe):
        out = {
            p + 'input_layernorm.weight': (h,),
            p + 'post_attention_layernorm.weight': (h,),
            p + 'self_attn.kv_a_proj_with_mqa.weight': (c.kv_lora_rank + c.qk_rope_head_dim, h),
            p + 'self_attn.kv_a_layernorm.weight': (c.kv_lora_rank,),
            p + 'self_attn.kv_b_proj.weight': (
                n * (c.qk_nope_head_dim + c.v_head_dim),
                c.kv_lora_rank,
            ),
            p + 'self_attn.o_proj.weight': (h, n * c.v_head_dim),
        }
        if c.q_lora_rank is None:
            out[p + 'self_attn.q_proj.weight'] = (n * dq, h)
        else:
            out[p + 'self_attn.q_a_proj.weight'] = (c.q_lora_rank, h)
            out[p + 'self_attn.q_a_layernorm.weight'] = (c.q_lora_rank,)
            out[p + 'self_attn.q_b_proj.weight'] = (n * dq, c.q_lora_rank)
        if not moe:
            out.update(mlp(p + 'mlp.', c.intermediate_size))
            return out
        e = c.n_routed_experts
        out[p + 'mlp.gate.weight'] = (e, h)
        out[p + 'mlp.gate.e_score_correction_bias'] = (e,)
        for j in range(e):
            out.update(mlp(f'{p}mlp.experts.{j}.', c.moe_intermediate_size))
        if c.n_shared_experts:
            out.update(mlp(p + 'mlp.shared_experts.', c.n_shared_experts * c.moe_intermediate_size))
        return out

    shapes = {'model.embed_tokens.weight': (c.vocab_size, h), 'model.norm.weight': (h,)}
    if not c.tie_word_embeddings:
        shapes['lm_head.weight'] = (c.vocab_size, h)
    for i, moe in enumerate(c.moe_layer_pattern):
        shapes.update(layer(f'model.layers.{i}.', moe))
    for k in range(mtp_layers):
        p = f'model.layers.{c.num_hidden_layers + k}.'
        shapes.update(layer(p, True))
        shapes.update({p + 'enorm.weight': (h,), p + 'hnorm.weight': (h,)})
        shapes.update({p + 'eh_proj.weight': (h, 2 * h), p + 'shared_head.norm.weight': (h,)})
        shapes.update({p + 'shared_head.head.weight': (c.vocab_size, h)})
        shapes.update({p + 'embed_tokens.weight': (c.vocab_size, h)})
    return shapes


def check_deepseek_hf_shapes(hf_dir: str, config: dict) -> int:
    """Every tensor config.json describes is in the files with its shape, no other is; returns
    the number of MTP modules held. ValueError (one line) naming the first mismatch."""
    mtp = mtp_layers_in_files(hf_dir, config)
    found = hfc.hf_tensor_shapes(hf_dir)
    expected = expected_deepseek_shapes(config, mtp)
    for name, shape in expected.items():
        if name not in found:
            raise ValueError(f'--load-dir {hf_dir}: tensor {name} (shape {list(shape)}) is missing')
        if found[name][0] != shape:
            raise ValueError(
                f'{found[name][1]}: tensor {name} has shape {list(found[name][0])} but '
                f'config.json describes {list(shape)}'
            )
    extra = sorted(n for n in found if n not in expected and not n.endswith('.rotary_emb.inv_freq'))
    if extra:
        raise ValueError(
            f'{found[extra[0]][1]}: holds weights config.json does not describe: '
            f'{", ".join(extra[:5])}' + (f' ... ({len(extra)} in all)' if len(extra) > 5 else '')
        )
    return mtp


def full_state_dict_from_hf_deepseek(config: dict, hf_state_dict, mtp_layers: int = 0):
    """A full (TP = EP = PP = 1) megatron-core state dict from DeepSeek-V3 tensors."""
    c = deepseek_config_namespace(config)
    return hfm_ds.deepseek_v3_hf_to_mcore_state_dict(
        hf_state_dict,
        c.num_hidden_layers,
        c.num_hidden_layers - sum(c.moe_layer_pattern),
        c.n_routed_experts,
        mtp_layers=mtp_layers,
    )


# ---------------------------------------------------------------------------------------------
# our args -> HF


def is_deepseek_args(args) -> bool:
    return bool(getattr(args, 'multi_latent_attention', False))


def _moe_pattern(args) -> List[int]:
    freq = args.moe_layer_freq
    if isinstance(freq, int):
        return [1 if i % freq == 0 else 0 for i in range(args.num_layers)]
    return list(freq)


def check_deepseek_args(args) -> None:
    """ValueError naming what an MLA model has that DeepseekV3ForCausalLM cannot hold."""
    reasons = []
    if args.position_embedding_type != 'rope' or getattr(args, 'normalization', '') != 'RMSNorm':
        reasons.append('RoPE and RMSNorm')
    if not args.swiglu or args.add_bias_linear:
        reasons.append('SwiGLU without linear biases')
    if not getattr(args, 'qk_layernorm', False):
        reasons.append('the latent norms (--qk-layernorm)')
    if not args.num_experts:
        reasons.append('MoE layers (--num-experts)')
    else:
        pattern = _moe_pattern(args)
        first_k = pattern.index(1) if 1 in pattern else len(pattern)
        if pattern != [0] * first_k + [1] * (len(pattern) - first_k):
            reasons.append('dense layers first, then MoE layers (--moe-layer-freq)')
        if args.moe_router_score_function != 'sigmoid' or not args.moe_router_enable_expert_bias:
            reasons.append('sigmoid routing with --moe-router-enable-expert-bias')
        if args.moe_router_pre_softmax:
            reasons.append('no --moe-router-pre-softmax')
        shared = args.moe_shared_expert_intermediate_size
        moe_ffn = args.moe_ffn_hidden_size or args.ffn_hidden_size
        if shared is not None and (shared % moe_ffn or args.moe_shared_expert_gate):
            reasons.append('ungated shared experts of a multiple of --moe-ffn-hidden-size')
    if getattr(args, 'rope_type', None) not in (None, 'yarn', 'rope'):
        reasons.append('rope or yarn rotary embeddings')
    if reasons:
        raise ValueError(
            'saver_hf: an MLA model converts to DeepseekV3ForCausalLM only with '
            + ', '.join(reasons)
        )


def deepseek_config_from_args(args, vocab_size: int, dtype: torch.dtype) -> dict:
    """config.json of the DeepseekV3ForCausalLM equivalent of an MLA + MoE model."""
    check_deepseek_args(args)
    pattern = _moe_pattern(args)
    moe_ffn = args.moe_ffn_hidden_size or args.ffn_hidden_size
    shared = args.moe_shared_expert_intermediate_size
    rope = {'rope_theta': float(args.rotary_base), 'rope_type': 'default'}
    if (args.rope_type or 'yarn') == 'yarn':
        rope.update(
            rope_type='yarn',
            factor=float(args.rotary_scaling_factor),
            original_max_position_embeddings=args.yarn_original_max_position_embeddings,
            beta_fast=float(args.yarn_beta_fast),
            beta_slow=float(args.yarn_beta_slow),
            mscale=float(args.mscale),
            mscale_all_dim=float(args.mscale_all_dim),
            truncate=bool(args.yarn_correction_range_round_to_int),
        )
        if not args.mscale_all_dim and args.mscale != 1.0:
            raise ValueError(
                f'saver_hf: --mscale {args.mscale} with --mscale-all-dim 0 has no '
                'DeepseekV3ForCausalLM equivalent (transformers then uses --mscale 1)'
            )
    groups = getattr(args, 'moe_router_num_groups', None)
    heads = args.num_attention_heads
    return {
        'architectures': ['DeepseekV3ForCausalLM'],
        'model_type': MODEL_TYPE,
        'vocab_size': vocab_size,
        'hidden_size': args.hidden_size,
        'intermediate_size': args.ffn_hidden_size,
        'moe_intermediate_size': moe_ffn,
        'num_hidden_layers': args.num_layers,
        'num_attention_heads': heads,
        'num_key_value_heads': heads,
        'n_shared_experts': (shared // moe_ffn) if shared else 0,
        'n_routed_experts': args.num_experts,
        'routed_scaling_factor': float(args.moe_router_topk_scaling_factor or 1.0),
        'kv_lora_rank': args.kv_lora_rank,
        'q_lora_rank': args.q_lora_rank,
        'qk_rope_head_dim': args.qk_pos_emb_head_dim,
        'qk_nope_head_dim': args.qk_head_dim,
        'v_head_dim': args.v_head_dim,
        'n_group': groups or 1,
        'topk_group': getattr(args, 'moe_router_group_topk', None) or 1,
        'num_experts_per_tok': args.moe_router_topk,
        'first_k_dense_replace': pattern.index(1) if 1 in pattern else len(pattern),
        'norm_topk_prob': args.moe_router_topk > 1,
        'hidden_act': 'silu',
        'max_position_embeddings': args.max_position_embeddings,
        'initializer_range': args.init_method_std,
        'rms_norm_eps': args.norm_epsilon,
        'tie_word_embeddings': not args.untie_embeddings_and_output_weights,
        'rope_parameters': rope,
        'rope_theta': float(args.rotary_base),
        'rope_interleave': True,
        'attention_bias': False,
        'attention_dropout': args.attention_dropout,
        'num_nextn_predict_layers': getattr(args, 'mtp_num_layers', None) or 0,
        'torch_dtype': {v: k for k, v in hfc._DTYPES.items()}.get(dtype, 'float32'),
    }


def deepseek_state_dict_from_full(config: dict, full: Dict[str, torch.Tensor]):
    """HF tensors (per-expert names, MTP modules as extra layers) from a full megatron-core
    state dict."""
    c = deepseek_config_namespace(config)
    out = hfm_ds.mcore_to_deepseek_v3_hf_state_dict(
        full,
        c.num_hidden_layers,
        c.num_hidden_layers - sum(c.moe_layer_pattern),
        c.n_routed_experts,
        true_vocab_size=c.vocab_size,
        mtp_layers=c.mtp_layers,
    )
    if c.tie_word_embeddings:
        out.pop('lm_head.weight', None)
    return out
