"""Print the theoretical memory of a training command line without running it (no GPU needed).

    python tools/report_theoretical_memory.py --num-layers 24 --hidden-size 1024 \\
        --num-attention-heads 16 --seq-length 2048 --max-position-embeddings 2048 \\
        --micro-batch-size 4 --global-batch-size 64 --tokenizer-type GPT2BPETokenizer \\
        --vocab-file data/gpt2/gpt2-vocab.json --merge-file data/gpt2/gpt2-merges.txt \\
        --sequence-parallel --recompute-granularity selective

The number of micro-batches is not taken into account (no pipeline discount), as in Megatron.
"""

import os
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir)))

from megatron.training import get_args  # noqa: E402
from megatron.training.initialize import initialize_megatron  # noqa: E402
from megatron.training.theoretical_memory_usage import report_theoretical_memory  # noqa: E402

if __name__ == "__main__":
    initialize_megatron(allow_no_cuda=True, skip_mpu_initialization=True)
    report_theoretical_memory(get_args(), num_microbatches=None, verbose=True)
