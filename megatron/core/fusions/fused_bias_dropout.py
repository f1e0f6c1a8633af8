"""Bias + dropout + residual add: `residual + dropout(x + bias)`."""

from typing import Optional, Tuple

import torch


def _bias_dropout_add_func(x_with_bias, residual, prob, training):
    x, bias = x_with_bias  # unpack
    if bias is not None:
        x = x + bias
    out = torch.nn.functional.dropout(x, p=prob, training=training)
    return residual + out


def bias_dropout_add_unfused(training: bool):
    """The bias-dropout-add function for `training` mode."""

    def _bias_dropout_add(x_with_bias, residual, prob):
        return _bias_dropout_add_func(x_with_bias, residual, prob, training)

    return _bias_dropout_add


def bias_dropout_add_fused_train(
    x_with_bias: Tuple[torch.Tensor, Optional[torch.Tensor]], residual: torch.Tensor, prob: float
) -> torch.Tensor:
    """Training-mode bias-dropout-add (the "fused" entry point; plain torch here)."""
    return _bias_dropout_add_func(x_with_bias, residual, prob, True)


def bias_dropout_add_fused_inference(
    x_with_bias: Tuple[torch.Tensor, Optional[torch.Tensor]], residual: torch.Tensor, prob: float
) -> torch.Tensor:
    """Inference-mode bias-dropout-add (no dropout)."""
    return _bias_dropout_add_func(x_with_bias, residual, prob, False)


def get_bias_dropout_add(training: bool, fused: bool):
    """The bias-dropout-add function: f((x, bias), residual, prob) = residual + dropout(x + bias).

    Args:
        training: apply dropout (True) or not.
        fused: pick the "fused" variant (the same maths in this implementation).
    """
    if fused:
        if training:
            return bias_dropout_add_fused_train
        return bias_dropout_add_fused_inference
    return bias_dropout_add_unfused(training)
