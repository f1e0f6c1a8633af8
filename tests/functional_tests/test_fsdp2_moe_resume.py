"""An MoE GPT at EP2 x DP4 under --use-torch-fsdp2 (experts sharded over the expert-data-parallel
group of 2, the rest over all 4 ranks) through pretrain_gpt.py on one pool of 4 gloo ranks
(2 layers of 4 SwiGLU experts, top-2, load-balancing loss, alltoall dispatcher, mock data):

- FSDP2 follows the uninterrupted DDP run within reduction noise and saves at iteration 3;
- resumed there with FSDP2 its losses are bit for bit its own;
- plain DDP resumes the FSDP2 checkpoint, and FSDP2 with grouped-GEMM experts under HSDP
  (2 replicas x 2 shards for the dense part) resumes it too: both follow the DDP run.
"""

from tests.functional_tests.test_dist_ckpt_resume import _close, _jobs, _merged
from tests.unit_tests.dist_utils import run_distributed

TRAIN_ITERS, STOP_AT = 6, 3
MOE = [
    '--num-layers', '2', '--num-experts', '4', '--moe-router-topk', '2',
    '--moe-aux-loss-coeff', '1e-2', '--swiglu', '--ffn-hidden-size', '64',
    '--disable-bias-linear', '--train-iters', str(TRAIN_ITERS), '--use-dist-ckpt',
    '--expert-model-parallel-size', '2', '--moe-token-dispatcher-type', 'alltoall',
]  # fmt: skip
FSDP2 = ['--use-torch-fsdp2']


def _check_follows(reference, losses, first, name):
    assert sorted(losses) == list(range(first, TRAIN_ITERS + 1)), name
    for it, value in losses.items():
        assert _close(value, reference[it]), (name, it, value, reference[it])


def test_fsdp2_expert_parallel_trains_and_resumes_like_ddp(tmp_path):
    ckpt = str(tmp_path / 'ckpt')
    resume = ['--load', ckpt, '--ckpt-step', str(STOP_AT)]
    jobs = [
        MOE,
        MOE + FSDP2 + ['--save', ckpt, '--save-interval', str(STOP_AT)],
        MOE + FSDP2 + resume,
        MOE + resume,
        MOE + FSDP2 + ['--moe-grouped-gemm', '--num-distributed-optimizer-instances', '2'] + resume,
    ]
    outs = run_distributed(_jobs, world_size=4, args=(jobs,), timeout=900)
    ddp, fsdp2, fsdp2_resumed, ddp_resumed, hsdp_grouped = _merged(outs)
    _check_follows(ddp, fsdp2, 1, 'FSDP2 EP2 against DDP')
    assert fsdp2_resumed == {it: fsdp2[it] for it in range(STOP_AT + 1, TRAIN_ITERS + 1)}
    _check_follows(ddp, ddp_resumed, STOP_AT + 1, 'FSDP2 -> DDP')
    _check_follows(ddp, hsdp_grouped, STOP_AT + 1, 'FSDP2 -> HSDP, grouped experts')
