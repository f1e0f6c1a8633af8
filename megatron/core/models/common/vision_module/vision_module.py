"""Base class of the vision encoders (Megatron's `VisionModule`).

It adds nothing to `MegatronModule` beyond the name: the vision models share the config handling
and the checkpoint hooks of every megatron-core module.
"""

from megatron.core.transformer.module import MegatronModule


class VisionModule(MegatronModule):
    """A megatron-core module that encodes images.

    Args:
        config (TransformerConfig): the encoder's transformer config.
    """
