"""megatron.core: the library. It never reads CLI arguments; it takes config dataclasses."""

import megatron.core.parallel_state
import megatron.core.tensor_parallel
import megatron.core.utils
from megatron.core.enums import ModelType
from megatron.core.inference_params import InferenceParams
from megatron.core.model_parallel_config import ModelParallelConfig

__all__ = [
    "parallel_state",
    "tensor_parallel",
    "utils",
    "InferenceParams",
    "ModelParallelConfig",
    "ModelType",
]
