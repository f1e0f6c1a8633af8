"""Calling an `autograd.Function` where no graph is recorded.

`Function.apply` builds a backward node, checks its inputs for views and versions and wraps its
outputs, even under `torch.no_grad()`: some tens of microseconds a call. A decode step of the
inference engine makes a few dozen such calls (every tensor parallel linear layer and region
mapping) around GEMMs of a few rows, so on a CPU that bookkeeping is a measurable part of the
step. With gradients disabled, `apply_function` runs the Function's `forward` alone: the same
arithmetic and the same collectives, in the same order, as `apply` would run.
"""

import torch


class _NoGraphContext:
    """What a Function's forward may call on its ctx, for a call that records no graph."""

    def save_for_backward(self, *tensors):
        pass

    def mark_dirty(self, *tensors):
        pass

    def mark_non_differentiable(self, *tensors):
        pass

    def set_materialize_grads(self, value):
        pass


def apply_function(function, *args):
    """`function.apply(*args)`, or, with gradients disabled, its forward without autograd.

    Args:
        function: a `torch.autograd.Function` subclass whose forward takes (ctx, *args).
    """
    if torch.is_grad_enabled():
        return function.apply(*args)
    return function.forward(_NoGraphContext(), *args)
