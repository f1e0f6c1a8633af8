"""Placeholders used in layer specs for submodules a layer does not have."""

import torch


class IdentityOp(torch.nn.Module):
    """Returns its first input unchanged; accepts and ignores any other argument."""

    def __init__(self, *args, **kwargs):
        super().__init__()

    def forward(self, x, *args, **kwargs):
        return x


class IdentityFuncOp(IdentityOp):
    """Stands in for a factory such as `get_bias_dropout_add(training, fused)`.

    Calling it returns a function that in turn returns its first input unchanged.
    """

    def forward(self, *args, **kwargs):
        return super().forward
