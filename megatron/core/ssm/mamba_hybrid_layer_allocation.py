"""Which layer of a hybrid model is Mamba ('M'), attention ('*') or MLP ('-').

`allocate_layers(total_layers_count, attention_ratio, mlp_ratio, override_pattern)` reproduces
Megatron core_r0.8.0's allocation exactly (the same rounding, spacing and log lines):

- attention: a = round(L * attention_ratio) layers spread evenly, the pattern starting and ending
  with Mamba layers;
- MLP: k = round(L * mlp_ratio) of the remaining Mamba layers, spread the same way, never replacing
  an attention layer;
- an override pattern replaces the result; when a ratio is set its per-symbol counts must match
  the automatic pattern's.

Errors are `ValueError`s with one line.
"""

import logging
from typing import List, Optional

from megatron.core.datasets.utils import log_single_rank

logger = logging.getLogger(__name__)


class Symbols:
    """The layer symbols of a hybrid pattern."""

    MAMBA = 'M'
    ATTENTION = '*'
    MLP = '-'
    VALID = {MAMBA, ATTENTION, MLP}


def _allocate_auto(total_layers_count: int, target_attention_ratio: float, target_mlp_ratio: float):
    """The automatic pattern as a list of symbols."""
    layer_type_list = [Symbols.MAMBA] * total_layers_count

    # Attention: `spacing` Mamba layers per gap, a + 1 gaps around the a attention layers.
    attention_count = round(total_layers_count * target_attention_ratio)
    mamba_count = total_layers_count - attention_count
    spacing = mamba_count / (attention_count + 1)
    if attention_count > 0:
        budget = spacing
        for index in range(total_layers_count):
            if budget < 0.5:
                layer_type_list[index] = Symbols.ATTENTION
                budget += spacing
            else:
                budget -= 1

    # MLP: the same spreading over the Mamba layers that are left.
    mlp_count = round(total_layers_count * target_mlp_ratio)
    if mlp_count > 0:
        spacing = (mamba_count - mlp_count) / mlp_count
        budget = spacing
        for index in range(total_layers_count):
            if layer_type_list[index] == Symbols.MAMBA:
                if budget < 0.5:
                    layer_type_list[index] = Symbols.MLP
                    budget += spacing
                else:
                    budget -= 1
    return layer_type_list


def _allocate_override(total_layers_count: int, override_pattern: str) -> List[str]:
    """The override pattern as a list of symbols, after checking its length and symbols."""
    layer_type_list = list(override_pattern)
    if len(layer_type_list) != total_layers_count:
        raise ValueError(
            "The hybrid override pattern is the wrong length: "
            f"got {len(layer_type_list)}, expected {total_layers_count}"
        )
    for symbol in layer_type_list:
        if symbol not in Symbols.VALID:
            raise ValueError(
                f"In hybrid override pattern, '{symbol}' is not one of {Symbols.VALID}"
            )
    return layer_type_list


def _layer_counts_match(a: List[str], b: List[str]) -> bool:
    """Whether two patterns have the same number of layers of each type."""
    return all(a.count(symbol) == b.count(symbol) for symbol in Symbols.VALID)


def validate_hybrid_ratios(attention_ratio: float, mlp_ratio: float) -> None:
    """One-line errors for ratios outside [0, 1] or summing above 1."""
    for name, ratio in (
        ('hybrid_attention_ratio', attention_ratio),
        ('hybrid_mlp_ratio', mlp_ratio),
    ):
        if not 0.0 <= ratio <= 1.0:
            raise ValueError(f"{name} ({ratio}) must be in [0.0, 1.0]")
    if attention_ratio + mlp_ratio > 1.0:
        raise ValueError(
            f"hybrid_attention_ratio ({attention_ratio}) + hybrid_mlp_ratio ({mlp_ratio}) "
            "must not exceed 1.0"
        )


def _log_info(line: str) -> None:
    log_single_rank(logger, logging.INFO, line)


def _apply_override(
    total_layers_count: int,
    override_pattern: str,
    automatic: List[str],
    ratios_given: bool,
    verbose: bool,
) -> List[str]:
    """The override pattern's layer list, checked against the automatic one: with target ratios
    given, both must hold the same number of each layer type."""
    override = _allocate_override(total_layers_count, override_pattern)
    if verbose:
        _log_info("Using hybrid override pattern")
    if ratios_given and not _layer_counts_match(override, automatic):
        raise ValueError(
            "The number of each type of layer in the override pattern must match the number "
            "in the overridden pattern."
        )
    if not verbose:
        return override
    if override == automatic:
        _log_info("The override pattern matches the overridden pattern")
    else:
        _log_info("Warning: overriding pattern A with pattern B")
        _log_info(f"A: {''.join(automatic)}")
        _log_info(f"B: {''.join(override)}")
    return override


def _allocate(
    total_layers_count: int,
    target_attention_ratio: float,
    target_mlp_ratio: float,
    override_pattern: Optional[str],
    verbose: bool,
) -> List[str]:
    if total_layers_count <= 0:
        raise ValueError(f"num_layers ({total_layers_count}) must be positive")
    validate_hybrid_ratios(target_attention_ratio, target_mlp_ratio)
    automatic = _allocate_auto(total_layers_count, target_attention_ratio, target_mlp_ratio)
    if override_pattern is None:
        return automatic
    ratios_given = target_attention_ratio > 0.0 or target_mlp_ratio > 0.0
    return _apply_override(total_layers_count, override_pattern, automatic, ratios_given, verbose)


def check_hybrid_allocation(
    total_layers_count: int,
    target_attention_ratio: float,
    target_mlp_ratio: float,
    override_pattern: Optional[str] = None,
) -> List[str]:
    """The errors of `allocate_layers` without its log lines; returns the pattern."""
    return _allocate(
        total_layers_count, target_attention_ratio, target_mlp_ratio, override_pattern, False
    )


def allocate_layers(
    total_layers_count: int,
    target_attention_ratio: float,
    target_mlp_ratio: float,
    override_pattern: Optional[str] = None,
) -> List[str]:
    """The layer types of a hybrid model, one symbol per layer (Megatron's `allocate_layers`).

    Args:
        total_layers_count: L, all layers of the model (all pipeline stages).
        target_attention_ratio: fraction of attention layers, in [0, 1].
        target_mlp_ratio: fraction of MLP layers, in [0, 1] (the two sum to at most 1).
        override_pattern: a pattern of L symbols from {'M', '*', '-'} to use instead.

    Returns:
        The list of L symbols. Logged on rank 0 at INFO as Megatron does (nothing for a pure
        Mamba model without an override).
    """
    layer_type_list = _allocate(
        total_layers_count, target_attention_ratio, target_mlp_ratio, override_pattern, True
    )
    if target_attention_ratio > 0.0 or target_mlp_ratio > 0.0 or override_pattern is not None:
        attention_count = layer_type_list.count(Symbols.ATTENTION)
        mlp_count = layer_type_list.count(Symbols.MLP)
        total = total_layers_count
        for line in (
            "Hybrid allocation (M is mamba, * is attention, - is mlp):",
            ''.join(layer_type_list),
            f"{attention_count} attention layers in {total} total layers.",
            f"Target attention ratio: {target_attention_ratio:.2f}. "
            f"Actual attention ratio: {attention_count / total:.2f}.",
            f"{mlp_count} mlp layers in {total} total layers.",
            f"Target mlp ratio: {target_mlp_ratio:.2f}. Actual mlp ratio: {mlp_count / total:.2f}.",
        ):
            log_single_rank(logger, logging.INFO, line)
    return layer_type_list


if __name__ == "__main__":
    for case in ((48, 0.08, 0.5), (56, 0.08, 0.5), (10, 0.2, 0.0), (8, 0.25, 0.25)):
        print(case, ''.join(allocate_layers(*case)))
