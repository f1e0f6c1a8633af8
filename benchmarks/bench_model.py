"""Peak memory and throughput of one GPT forward+backward with no / selective / full recompute.

Each mode runs in its own subprocess (a fresh allocator and a fresh peak counter):
- CUDA: peak = torch.cuda.max_memory_allocated() during the measured steps, minus the memory
  allocated before them (weights and gradients), i.e. the activation peak.
- CPU: peak = growth of the process's maximum resident set size (getrusage ru_maxrss) over the
  measured steps, after a short warm-up step at a tiny sequence length has allocated weights and
  gradients; tokens/s from the wall time of the measured steps.

Usage:
    python benchmarks/bench_model.py                     # ~100M params, seq 1024, micro batch 1
    python benchmarks/bench_model.py --num-layers 2 --hidden-size 128 --seq-length 128  # quick
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import time

MODES = {
    "none": {},
    "selective": {"recompute_granularity": "selective"},
    "full (uniform, 1)": {
        "recompute_granularity": "full",
        "recompute_method": "uniform",
        "recompute_num_layers": 1,
    },
}


def _parse():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--num-layers", type=int, default=12)
    parser.add_argument("--hidden-size", type=int, default=768)
    parser.add_argument("--num-attention-heads", type=int, default=12)
    parser.add_argument("--vocab-size", type=int, default=16384)
    parser.add_argument("--seq-length", type=int, default=1024)
    parser.add_argument("--micro-batch-size", type=int, default=1)
    parser.add_argument("--steps", type=int, default=2, help="measured forward+backward steps")
    parser.add_argument("--threads", type=int, default=0, help="torch threads on CPU (0 = default)")
    parser.add_argument("--mode", default=None, help=argparse.SUPPRESS)  # worker mode
    return parser.parse_args()


def _maxrss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _worker(args) -> dict:
    import torch

    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core.utils import get_current_device

    if args.threads:
        torch.set_num_threads(args.threads)
    cuda = torch.cuda.is_available()
    torch.distributed.init_process_group(
        backend="nccl" if cuda else "gloo",
        init_method=f"tcp://127.0.0.1:{_free_port()}",
        rank=0,
        world_size=1,
    )
    parallel_state.initialize_model_parallel()
    torch.manual_seed(1234)
    model_parallel_cuda_manual_seed(1234)

    config = TransformerConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        hidden_dropout=0.1,
        attention_dropout=0.1,
        **MODES[args.mode],
    )
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=args.vocab_size,
        max_sequence_length=args.seq_length,
        share_embeddings_and_output_weights=True,
    ).to(get_current_device())
    model.train()
    num_params = sum(p.numel() for p in model.parameters())
    device = get_current_device()

    def step(seq):
        tokens = torch.randint(0, args.vocab_size, (args.micro_batch_size, seq), device=device)
        position_ids = (
            torch.arange(seq, device=device).unsqueeze(0).expand(args.micro_batch_size, -1)
        )
        loss = model(tokens, position_ids, None, labels=tokens)
        loss.mean().backward()

    step(8)  # allocates the gradients
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = _maxrss_bytes()
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        step(args.seq_length)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    peak = (torch.cuda.max_memory_allocated() if cuda else _maxrss_bytes()) - base
    torch.distributed.destroy_process_group()
    tokens_per_step = args.micro_batch_size * args.seq_length
    return {
        "mode": args.mode,
        "params": num_params,
        "device": "cuda" if cuda else f"cpu ({torch.get_num_threads()} threads)",
        "peak_activation_mib": peak / 2**20,
        "step_s": min(times),
        "tokens_per_s": tokens_per_step / min(times),
    }


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main():
    args = _parse()
    if args.mode is not None:
        print("RESULT " + json.dumps(_worker(args)), flush=True)
        return
    rows = []
    for mode in MODES:
        cmd = [sys.executable, os.path.abspath(__file__), "--mode", mode] + [
            a for a in sys.argv[1:]
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
        if proc.returncode != 0 or not lines:
            sys.stderr.write(proc.stdout + proc.stderr)
            raise SystemExit(f"mode {mode!r} failed (exit {proc.returncode})")
        rows.append(json.loads(lines[-1][len("RESULT ") :]))
        print(f"  done: {mode}", file=sys.stderr, flush=True)

    r0 = rows[0]
    print(
        f"GPT fwd+bwd: {r0['params'] / 1e6:.1f}M params, layers {args.num_layers}, hidden "
        f"{args.hidden_size}, heads {args.num_attention_heads}, vocab {args.vocab_size}, seq "
        f"{args.seq_length}, micro batch {args.micro_batch_size}, device {r0['device']}"
    )
    print(f"{'recompute':<20} {'peak act. mem (MiB)':>20} {'step (s)':>10} {'tokens/s':>10}")
    for r in rows:
        print(
            f"{r['mode']:<20} {r['peak_activation_mib']:>20.1f} {r['step_s']:>10.2f}"
            f" {r['tokens_per_s']:>10.1f}"
        )


if __name__ == "__main__":
    main()
