"""pretrain_mamba.py --sft under context parallelism, end to end: a tiny hybrid (pattern M*-M,
RoPE) on packed arithmetic conversations at CP2 reproduces the CP1 losses and gradient norms.

The chat set and its flags are those of test_sft_context_parallel.py (`--sft-one-row-per-sample`,
so every layout packs the same conversations into the same samples; one or two per sample, each
padded to a multiple of 2 x cp). The Mamba states decay slowly (test_mamba_sft.slow_decay), so a
state carried across a conversation boundary, or a scan over a chunk order other than the
sequence's, would change the losses.

Tolerance: relative 1e-5 per iteration (fp32), gradient norms (logged with 3 decimals) 1.5e-3.
"""

import re

import pytest

from tests.functional_tests.mamba_utils import run_mamba_pretrain
from tests.functional_tests.test_mamba_sft import slow_decay
from tests.functional_tests.test_sft_context_parallel import (
    ITERS,
    _args,
    chat,  # noqa: F401 (fixture)
)
from tests.unit_tests.dist_utils import run_distributed

MAMBA = [
    "--num-layers", "4", "--hybrid-override-pattern", "M*-M", "--mamba-head-dim", "8",
    "--mamba-num-groups", "2", "--mamba-state-dim", "8", "--disable-bias-linear",
    "--squared-relu", "--no-bias-gelu-fusion",
]  # fmt: skip


def _run(chat, cache, cp):  # noqa: F811 (the fixture's value)
    argv = _args(chat, cache, cp, 1, None)
    argv = [a for a in argv if a not in ("--group-query-attention",)]
    i = argv.index("--num-query-groups")
    del argv[i : i + 2]
    i = argv.index("--num-layers")
    del argv[i : i + 2]
    outs = run_distributed(
        run_mamba_pretrain,
        world_size=cp,
        cp=cp,
        args=(MAMBA,),
        kwargs=dict(base_args=argv, adjust_model=slow_decay, capture_stdout=True),
        timeout=600,
    )
    result = outs[-1]
    assert result["iteration"] == ITERS
    losses = [float(result["train_losses"][i]["lm loss"]) for i in range(1, ITERS + 1)]
    norms = [float(x) for x in re.findall(r"grad norm: ([0-9.]+) \|", result["stdout"])]
    return losses, norms


def test_cp2_reproduces_cp1_packed_losses(chat, tmp_path):  # noqa: F811
    cache = str(tmp_path / "cache")
    cp1 = _run(chat, cache, 1)
    cp2 = _run(chat, cache, 2)
    assert len(cp1[1]) == ITERS
    assert cp2[0] == pytest.approx(cp1[0], rel=1e-5), (cp2, cp1)
    assert cp2[1] == pytest.approx(cp1[1], abs=1.5e-3), (cp2, cp1)
