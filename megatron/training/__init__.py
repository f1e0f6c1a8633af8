"""megatron.training: the application layer (arguments, global state, the training loop)."""

from .global_vars import (
    get_args,
    get_signal_handler,
    get_tensorboard_writer,
    get_timers,
    get_tokenizer,
)
from .initialize import initialize_megatron
from .training import get_model, get_train_valid_test_num_samples, pretrain
from .utils import is_last_rank, print_rank_0, print_rank_last
