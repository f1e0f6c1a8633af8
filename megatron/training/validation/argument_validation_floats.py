"""Start-up checks of every floating-point flag: finite, and inside its range.

argparse's `float` accepts `nan`, `inf` and any sign, which later fail far from the flag (a NaN
capacity, a negative jitter in a uniform distribution, a NaN learning rate). Every flag the parser
declares with `type=float` must be finite (none has a meaning for NaN or infinity); the flags in
RANGES must also lie in their interval. A flag left at None (unset) is not checked.
"""

import math
from typing import Dict, Tuple

#: dest -> (low, high, low inclusive, high inclusive); None = unbounded on that side.
RANGES: Dict[str, Tuple] = {
    'rotary_percent': (0.0, 1.0, False, True),
    'norm_epsilon': (0.0, None, False, None),
    'attention_dropout': (0.0, 1.0, True, False),
    'hidden_dropout': (0.0, 1.0, True, False),
    'retro_encoder_hidden_dropout': (0.0, 1.0, True, False),
    'retro_encoder_attention_dropout': (0.0, 1.0, True, False),
    'weight_decay': (0.0, None, True, None),
    'start_weight_decay': (0.0, None, True, None),
    'end_weight_decay': (0.0, None, True, None),
    'clip_grad': (0.0, None, True, None),
    'adam_beta1': (0.0, 1.0, True, False),
    'adam_beta2': (0.0, 1.0, True, False),
    'adam_eps': (0.0, None, False, None),
    'sgd_momentum': (0.0, 1.0, True, True),
    'init_method_std': (0.0, None, True, None),
    'lr': (0.0, None, True, None),
    'lr_warmup_fraction': (0.0, 1.0, True, True),
    'lr_warmup_init': (0.0, None, True, None),
    'min_lr': (0.0, None, True, None),
    'decoupled_lr': (0.0, None, True, None),
    'decoupled_min_lr': (0.0, None, True, None),
    'loss_scale': (0.0, None, False, None),
    'initial_loss_scale': (0.0, None, False, None),
    'min_loss_scale': (0.0, None, False, None),
    'loss_scale_window': (0.0, None, False, None),
    'watchdog_timeout': (0.0, None, False, None),
    'sample_rate': (0.0, 1.0, False, True),
    'mask_prob': (0.0, 1.0, True, True),
    'short_seq_prob': (0.0, 1.0, True, True),
    'query_in_block_prob': (0.0, 1.0, True, True),
    'classes_fraction': (0.0, 1.0, False, True),
    'data_per_class_fraction': (0.0, 1.0, False, True),
    'moe_aux_loss_coeff': (0.0, None, True, None),
    'moe_z_loss_coeff': (0.0, None, True, None),
    'moe_input_jitter_eps': (0.0, 1.0, False, False),
    'moe_router_topk_scaling_factor': (0.0, None, False, None),
    'moe_router_bias_update_rate': (0.0, None, True, None),
    'inference_dynamic_batching_buffer_size_gb': (0.0, None, False, None),
    'hybrid_attention_ratio': (0.0, 1.0, True, True),
    'hybrid_mlp_ratio': (0.0, 1.0, True, True),
}


def _interval(low, high, low_in, high_in) -> str:
    left = '-inf' if low is None else f'{low:g}'
    right = 'inf' if high is None else f'{high:g}'
    return f'{"[" if low_in else "("}{left}, {right}{"]" if high_in else ")"}'


def _inside(value: float, low, high, low_in, high_in) -> bool:
    if low is not None and (value < low or (value == low and not low_in)):
        return False
    if high is not None and (value > high or (value == high and not high_in)):
        return False
    return True


def float_flags(parser) -> Dict[str, str]:
    """{dest: option string} of every flag the parser declares with type=float."""
    return {a.dest: a.option_strings[0] for a in parser._actions if a.type is float}


def validate_float_flags(args, parser) -> None:
    """Raise ValueError naming the first float flag that is not finite or out of its range."""
    for dest, flag in float_flags(parser).items():
        value = getattr(args, dest, None)
        if value is None or not isinstance(value, float):
            continue
        if not math.isfinite(value):
            raise ValueError(f'{flag} must be a finite number, got {value}')
        bounds = RANGES.get(dest)
        if bounds is not None and not _inside(value, *bounds):
            raise ValueError(f'{flag} must be in {_interval(*bounds)}, got {value:g}')
