"""Pipeline bubble of 1F1B vs interleaved 1F1B, measured on CPU with spawned gloo ranks.

For a fixed model (a stack of `--num-layers` layers), `--num-microbatches` micro-batches and PP=4,
every rank times (with Megatron's timer names, through `config.timers`) the time its schedule spends
blocked in p2p communication and in forward/backward compute. The bubble of a stage is

    idle / total = (time in p2p sends/receives) / (time of the whole forward_backward call)

and it is printed beside the theory of the Megatron-LM papers: bubble time over ideal compute time
(p - 1) / m for 1F1B and (p - 1) / (v m) for v interleaved chunks, and the same bubble as a fraction
of the step, (p - 1) / (m + p - 1) and (p - 1) / (v m + p - 1), which is what idle / total measures.

Two compute modes:
  --compute matmul  real Linear+GELU layers. The ranks share the machine's cores, so when cores
                    are fewer than stages the steady state (all stages busy) runs slower than the
                    fill/drain phases and the measured bubble is distorted.
  --compute sleep   each layer sleeps a fixed time in forward (and twice that in backward), as if
                    every stage had its own device; this isolates the schedule's bubble.

Example:
    python benchmarks/bench_pipeline.py --compute sleep
    python benchmarks/bench_pipeline.py --compute matmul --hidden-size 256
"""

import argparse
import collections
import dataclasses
import os
import socket
import sys
import time

import torch
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.core import parallel_state  # noqa: E402
from megatron.core.enums import ModelType  # noqa: E402
from megatron.core.model_parallel_config import ModelParallelConfig  # noqa: E402
from megatron.core.pipeline_parallel import get_forward_backward_func  # noqa: E402

P2P_TIMERS = (
    'forward-recv',
    'backward-recv',
    'forward-send',
    'backward-send',
    'forward-send-backward-recv',
    'backward-send-forward-recv',
    'forward-send-forward-recv',
    'backward-send-backward-recv',
    'forward-backward-send-forward-backward-recv',
)
COMPUTE_TIMERS = ('forward-compute', 'backward-compute')


class _Timer:
    def __init__(self):
        self.elapsed = 0.0
        self._start = None

    def start(self, barrier=False):
        self._start = time.perf_counter()

    def stop(self, barrier=False):
        self.elapsed += time.perf_counter() - self._start
        self._start = None


class AccumulatingTimers:
    """Minimal stand-in for Megatron's Timers: `timers(name, log_level=..)` -> start/stop."""

    def __init__(self):
        self.timers = collections.defaultdict(_Timer)

    def __call__(self, name, log_level=None):
        return self.timers[name]

    def reset(self):
        self.timers.clear()

    def total(self, names):
        return sum(self.timers[n].elapsed for n in names if n in self.timers)


@dataclasses.dataclass
class BenchConfig(ModelParallelConfig):
    hidden_size: int = 64
    num_layers: int = 16


class _SleepLayerFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, seconds):
        ctx.seconds = seconds
        time.sleep(seconds)
        return x * 1.0

    @staticmethod
    def backward(ctx, grad):
        time.sleep(2 * ctx.seconds)
        return grad * 1.0, None


class SleepLayer(torch.nn.Module):
    def __init__(self, seconds):
        super().__init__()
        self.seconds = seconds
        self.scale = torch.nn.Parameter(torch.ones(()))

    def forward(self, x):
        return _SleepLayerFn.apply(x * self.scale, self.seconds)


class StageStack(torch.nn.Module):
    """`num_local` layers of the stack; a 1-wide head and MSE loss target on the last stage."""

    def __init__(self, config, pre_process, post_process, num_local, compute, sleep_s):
        super().__init__()
        self.config = config
        self.model_type = ModelType.encoder_or_decoder
        self.pre_process = pre_process
        self.post_process = post_process
        self.input_tensor = None
        h = config.hidden_size
        if compute == 'sleep':
            self.layers = torch.nn.ModuleList(SleepLayer(sleep_s) for _ in range(num_local))
        else:
            self.layers = torch.nn.ModuleList(
                torch.nn.Sequential(
                    torch.nn.Linear(h, 4 * h), torch.nn.GELU(), torch.nn.Linear(4 * h, h)
                )
                for _ in range(num_local)
            )

    def set_input_tensor(self, input_tensor):
        self.input_tensor = input_tensor[0] if isinstance(input_tensor, list) else input_tensor

    def forward(self, x):
        hidden = x if self.pre_process else self.input_tensor  # [s, b, h]
        for layer in self.layers:
            hidden = hidden + layer(hidden)
        return hidden


def _forward_step(data_iterator, model):
    x = next(data_iterator)
    out = model(x)

    def loss_func(output):
        loss = output.float().pow(2).mean()
        return loss, {'loss': loss.detach()}

    return out, loss_func


def _run_rank(rank, world_size, port, args, result_q):
    torch.set_num_threads(1)
    torch.distributed.init_process_group(
        'gloo', init_method=f'tcp://127.0.0.1:{port}', rank=rank, world_size=world_size
    )
    results = {}
    for schedule, vp in (('1F1B', None), ('interleaved', args.virtual_stages)):
        parallel_state.destroy_model_parallel()
        parallel_state.initialize_model_parallel(
            pipeline_model_parallel_size=world_size, virtual_pipeline_model_parallel_size=vp
        )
        timers = AccumulatingTimers()
        config = BenchConfig(
            pipeline_model_parallel_size=world_size,
            virtual_pipeline_model_parallel_size=vp,
            pipeline_dtype=torch.float32,
            hidden_size=args.hidden_size,
            num_layers=args.num_layers,
            timers=timers,
            deallocate_pipeline_outputs=True,
            overlap_p2p_comm=bool(vp and args.overlap_p2p_comm),
            batch_p2p_comm=not (vp and args.overlap_p2p_comm),
        )
        chunks = []
        num_chunks = vp or 1
        per_chunk = args.num_layers // (world_size * num_chunks)
        for c in range(num_chunks):
            if vp is not None:
                parallel_state.set_virtual_pipeline_model_parallel_rank(c)
            torch.manual_seed(c * world_size + rank)
            chunks.append(
                StageStack(
                    config,
                    parallel_state.is_pipeline_first_stage(),
                    parallel_state.is_pipeline_last_stage(),
                    per_chunk,
                    args.compute,
                    args.sleep_ms_per_layer / 1000.0,
                )
            )
        if vp is not None:
            parallel_state.set_virtual_pipeline_model_parallel_rank(0)
        data = [
            torch.randn(args.seq_length, args.micro_batch_size, args.hidden_size)
            for _ in range(args.num_microbatches)
        ]
        fb = get_forward_backward_func()
        p2p, compute, totals = [], [], []
        for step in range(args.warmup_steps + args.steps):
            timers.reset()
            torch.distributed.barrier()
            fb(
                forward_step_func=_forward_step,
                data_iterator=[iter(data) for _ in chunks] if vp else iter(data),
                model=chunks if vp else chunks[0],
                num_microbatches=args.num_microbatches,
                seq_length=args.seq_length,
                micro_batch_size=args.micro_batch_size,
            )
            total = timers.total(['forward-backward'])
            if step >= args.warmup_steps:
                p2p.append(timers.total(P2P_TIMERS))
                compute.append(timers.total(COMPUTE_TIMERS))
                totals.append(total)
        results[schedule] = {'p2p': p2p, 'compute': compute, 'total': totals}
    result_q.put((rank, results))
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument('--pipeline-model-parallel-size', type=int, default=4)
    parser.add_argument('--virtual-stages', type=int, default=2)
    parser.add_argument('--num-layers', type=int, default=16)
    parser.add_argument('--num-microbatches', type=int, default=8)
    parser.add_argument('--hidden-size', type=int, default=128)
    parser.add_argument('--seq-length', type=int, default=64)
    parser.add_argument('--micro-batch-size', type=int, default=4)
    parser.add_argument('--compute', choices=('sleep', 'matmul'), default='sleep')
    parser.add_argument('--sleep-ms-per-layer', type=float, default=5.0)
    parser.add_argument(
        '--overlap-p2p-comm',
        action='store_true',
        help='interleaved schedule with overlapped, unbatched p2p (then only idle/step is '
        'meaningful: waits on background transfers are not timed as p2p)',
    )
    parser.add_argument('--steps', type=int, default=3)
    parser.add_argument('--warmup-steps', type=int, default=1)
    args = parser.parse_args()

    p, v, m = args.pipeline_model_parallel_size, args.virtual_stages, args.num_microbatches
    if args.num_layers % (p * v) != 0:
        raise ValueError(f"--num-layers ({args.num_layers}) must be divisible by p*v ({p * v})")

    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        port = s.getsockname()[1]
    ctx = mp.get_context('spawn')
    result_q = ctx.Queue()
    procs = [ctx.Process(target=_run_rank, args=(r, p, port, args, result_q)) for r in range(p)]
    for proc in procs:
        proc.start()
    results = dict(result_q.get(timeout=1800) for _ in procs)
    for proc in procs:
        proc.join()

    print(
        f"pipeline bubble, PP={p}, micro-batches={m}, virtual stages={v},"
        f" layers={args.num_layers}, "
        f"compute={args.compute}"
        + (
            f" ({args.sleep_ms_per_layer} ms/layer fwd, 2x bwd)"
            if args.compute == 'sleep'
            else f" (hidden {args.hidden_size}, seq {args.seq_length}, mbs {args.micro_batch_size})"
        )
        + f", {os.cpu_count()} CPU cores"
        + (", interleaved with overlap_p2p_comm" if args.overlap_p2p_comm else "")
    )
    theory = {
        '1F1B': ((p - 1) / m, (p - 1) / (m + p - 1)),
        'interleaved': ((p - 1) / (v * m), (p - 1) / (v * m + p - 1)),
    }
    print(
        "p2p-wait/own: time blocked in p2p / the stage's own forward_backward time"
        " (its fill/drain\n"
        "idle before its first and after its last p2p is partly outside its own call);\n"
        "idle/step: 1 - compute / pipeline step, pipeline step = slowest stage's forward_backward\n"
        "(all stages start together after a barrier)."
    )
    print(
        f"{'schedule':<12} {'stage':>5} {'p2p-wait/own':>12} {'idle/step':>10}"
        f" {'own s':>7} {'step s':>7}"
    )
    summary = {}
    for schedule in ('1F1B', 'interleaved'):
        steps = args.steps
        pipeline_step = [
            max(results[r][schedule]['total'][i] for r in range(p)) for i in range(steps)
        ]
        waits, idles = [], []
        for rank in range(p):
            res = results[rank][schedule]
            wait = sum(res['p2p'][i] / res['total'][i] for i in range(steps)) / steps
            idle = sum(1 - res['compute'][i] / pipeline_step[i] for i in range(steps)) / steps
            own = sum(res['total']) / steps
            waits.append(wait)
            idles.append(idle)
            print(
                f"{schedule:<12} {rank:>5} {wait:>12.3f} {idle:>10.3f} {own:>7.3f} "
                f"{sum(pipeline_step) / steps:>7.3f}"
            )
        t_ratio, t_frac = theory[schedule]
        summary[schedule] = (sum(waits) / p, sum(idles) / p, sum(pipeline_step) / steps)
        print(
            f"{schedule:<12} {'mean':>5} {summary[schedule][0]:>12.3f}"
            f" {summary[schedule][1]:>10.3f}"
            f"{'':>8} {summary[schedule][2]:>7.3f}   theory: bubble/compute {t_ratio:.3f}, "
            f"bubble/step {t_frac:.3f}"
        )
    ratio = summary['1F1B'][2] / summary['interleaved'][2]
    print(
        f"step time 1F1B / interleaved = {ratio:.2f} (theory for equal compute: "
        f"{(m + p - 1) / m * v * m / (v * m + p - 1):.2f})"
    )


if __name__ == '__main__':
    main()
