"""Data parallelism: DistributedDataParallel with contiguous bucketed gradient buffers."""

from .distributed_data_parallel import DistributedDataParallel
from .distributed_data_parallel_config import DistributedDataParallelConfig
from .finalize_model_grads import finalize_model_grads
from .param_and_grad_buffer import ParamAndGradBuffer, shard_buffer
