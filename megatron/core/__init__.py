"""megatron.core: the library. It never reads CLI arguments; it takes config dataclasses.

The top-level names are Megatron core_r0.8.0's (`from megatron.core import mpu, tensor_parallel`
in its pretrain scripts); `mpu` is the legacy name of `parallel_state`.
"""

import megatron.core.tensor_parallel
import megatron.core.utils  # noqa: F401 (megatron.core.utils, as in Megatron)
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel
from megatron.core.enums import ModelType
from megatron.core.inference_params import InferenceParams
from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.num_microbatches_calculator import init_num_microbatches_calculator
from megatron.core.timers import Timers

# Alias parallel_state as mpu, its legacy name.
mpu = parallel_state

__all__ = [
    "parallel_state",
    "tensor_parallel",
    "utils",
    "DistributedDataParallel",
    "InferenceParams",
    "init_num_microbatches_calculator",
    "ModelParallelConfig",
    "ModelType",
    "Timers",
]
