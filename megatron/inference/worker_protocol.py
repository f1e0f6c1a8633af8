"""The serving ranks' protocol: what rank 0 broadcasts before each unit of work (see
worker_loop.py), in its own module so that the generation paths (`vlm_generation.py`) and the
loop can both use it without importing each other.
"""

import torch

from megatron.core.utils import get_current_device

GENERATE_NUM = 0
BEAM_NUM = 1
ENGINE_STEP_NUM = 2
STOP_NUM = 3
VLM_GENERATE_NUM = 4
IDLE_NUM = 5
#: Seconds between idle engine steps on a multi-rank server (the waiting ranks' heartbeat).
HEARTBEAT_S = 5.0


def _send_choice(choice):
    """Broadcast rank 0's next unit of work to the waiting ranks."""
    tensor = torch.tensor([choice], dtype=torch.long, device=get_current_device())
    torch.distributed.broadcast(tensor, 0)
