"""`GlobalMemoryBuffer`: scratch tensors reused across steps (one per name and dtype).

Megatron keeps it in `megatron.core.utils` (re-exported there); `parallel_state` holds the global
instance. Its own module, so that neither of those imports the other.
"""

import torch

from megatron.core.device import get_current_device


class GlobalMemoryBuffer:
    """Scratch tensors reused across calls, one per (name, dtype), grown on demand.

    Used for temporary activations that would otherwise be allocated every step (e.g. the
    attention score buffer of baddbmm). A returned tensor stays valid until the next
    get_tensor() call with the same name and dtype.
    """

    def __init__(self):
        self.buffer = {}

    def get_tensor(self, tensor_shape, dtype, name):
        """A tensor of `tensor_shape` and `dtype` backed by the buffer `name` (contents
        undefined)."""
        required_len = 1
        for dim in tensor_shape:
            required_len *= dim
        key = (name, dtype)
        if key not in self.buffer or self.buffer[key].numel() < required_len:
            self.buffer[key] = torch.empty(
                required_len, dtype=dtype, device=get_current_device(), requires_grad=False
            )
        return self.buffer[key][0:required_len].view(*tensor_shape)
