"""`SimpleTextGenerationController`: core_r0.8.0's name of the text generation controller (later
megatron-core calls it `TextGenerationController`; see text_generation_controller.py)."""

from megatron.core.inference.text_generation_controllers.text_generation_controller import (
    TextGenerationController,
)


class SimpleTextGenerationController(TextGenerationController):
    """Same as `TextGenerationController` (core_r0.8.0's name)."""


__all__ = ["SimpleTextGenerationController"]
