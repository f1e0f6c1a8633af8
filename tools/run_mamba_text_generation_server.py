"""Serve a hybrid Mamba checkpoint over HTTP (Megatron core_r0.8.0's script name).

The same server as tools/run_text_generation_server.py (its flags, endpoints and engine), with
--is-hybrid-model set, so the model is a MambaModel built from the Mamba flags (or, with
--use-checkpoint-args, from the checkpoint's own). Example:

    python tools/run_mamba_text_generation_server.py --load CKPT --use-checkpoint-args \\
        --vocab-file data/gpt2/gpt2-vocab.json --merge-file data/gpt2/gpt2-merges.txt
"""

import os
import sys

sys.path.append(os.path.abspath(os.path.dirname(__file__)))

from run_text_generation_server import main  # noqa: E402

from megatron.training.run_control.errors import run_main  # noqa: E402

if __name__ == "__main__":
    run_main(main, args_defaults={'is_hybrid_model': True})
