"""One device policy (`megatron.core.device.uses_cuda`, re-exported by megatron.core.utils):
CUDA iff a CUDA device exists and the backend is not gloo. A GPU host is simulated by patching
`torch.cuda.is_available` (and `current_device`), the hardware probe the rule reads; the rule's
users are the real modules."""

import pathlib
import re

import torch

from megatron.core.utils import get_current_device, uses_cuda
from tests.unit_tests.dist_utils import run_distributed

REPO = pathlib.Path(__file__).resolve().parents[2]


class _FakeGpuHost:
    """Pretend a CUDA device exists (no CUDA call is made by the code under test on gloo)."""

    def __enter__(self):
        self._saved = torch.cuda.is_available, torch.cuda.current_device
        torch.cuda.is_available = lambda: True
        torch.cuda.current_device = lambda: 0
        return self

    def __exit__(self, *exc):
        torch.cuda.is_available, torch.cuda.current_device = self._saved


def test_rule_without_process_group():
    if not torch.cuda.is_available():
        assert not uses_cuda() and not uses_cuda("nccl") and not uses_cuda("gloo")
        assert get_current_device() == torch.device("cpu")
    with _FakeGpuHost():
        assert uses_cuda() and uses_cuda("nccl")
        assert not uses_cuda("gloo")
        assert get_current_device() == torch.device("cuda", 0)


def _gloo_on_gpu_host():
    from megatron.core import tensor_parallel
    from megatron.core.tensor_parallel import random as tp_random
    from megatron.core.timers import Timers
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.training import dist_signal_handler

    with _FakeGpuHost():
        config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2)
        layer = tensor_parallel.ColumnParallelLinear(
            8, 8, config=config, init_method=torch.nn.init.zeros_, bias=True, gather_output=True
        )
        timers = Timers(log_level=2, log_option="minmax")
        timers("step", log_level=0).start()
        out, _ = layer(torch.ones(2, 8))
        timers("step").stop()
        minmax = timers._get_global_min_max_time(["step"], True, True, 1.0)
        return {
            "uses_cuda": uses_cuda(),
            "current": str(get_current_device()),
            "weight": str(layer.weight.device),
            "out": str(out.device),
            "signal": str(dist_signal_handler.get_device()),
            "rng_cuda": tp_random._device_rng_is_cuda(),
            "timer_ok": "step" in minmax,
        }


def test_gloo_on_gpu_host_is_cpu_everywhere():
    for out in run_distributed(_gloo_on_gpu_host, world_size=2, tp=2):
        assert out == {
            "uses_cuda": False,
            "current": "cpu",
            "weight": "cpu",
            "out": "cpu",
            "signal": "cpu",
            "rng_cuda": False,
            "timer_ok": True,
        }


def test_no_other_device_probe():
    """Device choices go through the helper: `torch.cuda.is_available()` appears only there."""
    offences = []
    for path in sorted((REPO / "megatron").rglob("*.py")):
        if path == REPO / "megatron" / "core" / "device.py":
            continue
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"torch\.cuda\.is_available\(\)|distributed\.get_backend\(\)", line):
                offences.append(f"{path.relative_to(REPO)}:{lineno}: {line.strip()}")
    assert not offences, "\n".join(offences)
