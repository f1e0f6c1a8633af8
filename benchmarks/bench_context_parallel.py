"""Context parallelism: tokens/s, per-rank activation memory and communication wait of CP2
against CP1 on long sequences.

Layouts of the same small GPT (megatron.core GPTModel, RoPE, causal attention, fp32) and the same
sequence, forward + backward + the gradient all-reduce over the CP group (the optimizer step does
not depend on CP and is left out):
- CP1: one process, one torch thread (the reference);
- CP2 p2p / all_gather / a2a: two processes, one thread each, the sequence split in the
  load-balanced dual-chunk layout.

Printed per sequence length: ms/step and tokens/s (median of the timed steps and rounds), the
tokens/s ratio CP2 / CP1 (goal >= 1.6 on two free cores) and, robust to other load on the
machine, the same ratio of the main thread's CPU time per step (the compute each rank does,
without the time it waits), the activation memory per rank (bytes autograd saves
for backward during one forward, counted once per storage; CPU has no allocator statistics) and
its ratio to CP1 (about 1 / cp), the share of the step a rank spends in CP communication calls
(ring waits, all-gather / reduce-scatter, all-to-all; gradient all-reduce reported apart) and the
first-step loss difference to CP1 (exactness).

`--device cuda`: with two or more GPUs the same comparison on NCCL (peak allocated memory instead
of saved bytes); with one GPU the attention kernels per block instead: the fused flash block
(bf16) and the explicit block against torch SDPA on the whole sequence, forward + backward, with
their agreement.

Usage: python benchmarks/bench_context_parallel.py [--seq-lengths 4096 8192] [--steps 3]
       [--num-layers 2 --hidden-size 256 --num-attention-heads 8 --vocab 1024]
       [--comm-types p2p all_gather a2a] [--repeats 1] [--device cpu|cuda]
"""

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _free_port():
    with socket.socket() as sock:
        sock.bind(('127.0.0.1', 0))
        return sock.getsockname()[1]


class _CommTimer:
    """Wraps the CP modules' communication calls and sums the seconds spent inside them."""

    def __init__(self):
        self.seconds = 0.0

    def wrap(self, module, name):
        inner = getattr(module, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        setattr(module, name, timed)


def _saved_bytes(step_forward, parameters):
    """Bytes autograd saves for backward during `step_forward()`, one count per storage,
    parameters excluded (they do not depend on CP): the activation memory."""
    import torch

    weights = {p.untyped_storage().data_ptr() for p in parameters}
    storages = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in weights:
            storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = step_forward()
    return loss, sum(storages.values())


def _rank_main(rank, world, comm, port, bench, seq, result_file):
    os.environ.update(MASTER_ADDR='127.0.0.1', MASTER_PORT=str(port))
    sys.path.insert(0, REPO)
    import torch

    torch.set_num_threads(1)
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer.context_parallel import all_gather_attention as ag_module
    from megatron.core.transformer.context_parallel import all_to_all as a2a_module
    from megatron.core.transformer.context_parallel import (
        cp_global_positions,
        get_batch_on_this_cp_rank,
    )
    from megatron.core.transformer.context_parallel import ring_attention as ring_module
    from megatron.core.transformer.transformer_config import TransformerConfig

    cuda = bench.device == 'cuda'
    if cuda:
        torch.cuda.set_device(rank)
    torch.distributed.init_process_group('nccl' if cuda else 'gloo', rank=rank, world_size=world)
    ps.initialize_model_parallel(context_parallel_size=world)
    torch.manual_seed(1234)
    model_parallel_cuda_manual_seed(1234)
    config = TransformerConfig(
        num_layers=bench.num_layers,
        hidden_size=bench.hidden_size,
        num_attention_heads=bench.num_attention_heads,
        ffn_hidden_size=4 * bench.hidden_size,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        context_parallel_size=world,
        cp_comm_type=comm,
        use_cpu_initialization=True,
    )
    device = torch.device('cuda', rank) if cuda else torch.device('cpu')
    model = GPTModel(
        config,
        get_gpt_layer_local_spec(),
        vocab_size=bench.vocab,
        max_sequence_length=seq,
        position_embedding_type='rope',
    ).to(device)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, bench.vocab, (1, seq + 1), generator=gen)
    batch = {'tokens': tokens[:, :-1], 'labels': tokens[:, 1:]}
    batch = get_batch_on_this_cp_rank(batch, world, rank)
    batch = {k: v.to(device) for k, v in batch.items()}
    position_ids = cp_global_positions(seq, world, rank, device=device).unsqueeze(0)
    group = ps.get_context_parallel_group()

    comm_timer, grad_timer = _CommTimer(), _CommTimer()
    comm_timer.wrap(ring_module, '_wait')
    comm_timer.wrap(ag_module, '_gather_kv_natural')
    comm_timer.wrap(ag_module, '_scatter_dkv_to_owners')
    comm_timer.wrap(a2a_module, '_all_to_all')

    def forward():
        losses = model(batch['tokens'], position_ids, None, labels=batch['labels'])
        return losses.sum() / seq  # the global token mean, summed over the CP ranks below

    def step():
        loss = forward()
        loss.backward()
        start = time.perf_counter()
        grads = [p.grad for p in model.parameters()]
        flat = torch.cat([g.reshape(-1) for g in grads])
        if world > 1:
            torch.distributed.all_reduce(flat, group=group)
        grad_timer.seconds += time.perf_counter() - start
        model.zero_grad(set_to_none=True)
        return loss.detach()

    loss, saved = _saved_bytes(forward, list(model.parameters()))
    total = loss.detach().clone()
    del loss  # frees the graph
    if world > 1:
        torch.distributed.all_reduce(total, group=group)
    model.zero_grad(set_to_none=True)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    step()  # warm-up
    times, cpu, comm, grad = [], [], [], []
    for _ in range(bench.steps):
        comm_timer.seconds = grad_timer.seconds = 0.0
        if cuda:
            torch.cuda.synchronize()
        torch.distributed.barrier()
        start, start_cpu = time.perf_counter(), time.thread_time()
        step()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        cpu.append(time.thread_time() - start_cpu)
        comm.append(comm_timer.seconds)
        grad.append(grad_timer.seconds)
    peak = torch.cuda.max_memory_allocated() - base if cuda else saved
    # The slowest rank sets the pace.
    stats = torch.tensor([statistics.median(x) for x in (times, cpu, comm, grad)])
    torch.distributed.all_reduce(stats, op=torch.distributed.ReduceOp.MAX)
    if rank == 0:
        with open(result_file, 'w') as f:
            json.dump(
                {
                    'step': stats[0].item(),
                    'cpu': stats[1].item(),
                    'comm': stats[2].item(),
                    'grad': stats[3].item(),
                    'memory': peak,
                    'loss': total.item(),
                },
                f,
            )
    torch.distributed.destroy_process_group()


def _run_layout(world, comm, bench, seq, tmp):
    import torch.multiprocessing as mp

    result = os.path.join(tmp, f'{world}_{comm}_{seq}.json')
    mp.spawn(
        _rank_main, args=(world, comm, _free_port(), bench, seq, result), nprocs=world, join=True
    )
    with open(result) as f:
        return json.load(f)


def _median_results(runs):
    """Per-key median over repeated runs of one layout (loss and memory do not vary)."""
    return {key: statistics.median(run[key] for run in runs) for key in runs[0]}


def _cpu_or_multi_gpu(bench, world):
    print(
        f'GPT {bench.num_layers} layers, hidden {bench.hidden_size}, '
        f'{bench.num_attention_heads} heads, vocab {bench.vocab}, batch 1, fp32, '
        f'device {bench.device}, CP{world} as {world} processes x 1 thread; median of '
        f'{bench.steps} steps x {bench.repeats} rounds (layouts alternate)'
    )
    memory_name = 'saved for backward' if bench.device == 'cpu' else 'peak allocated'
    layouts = [(1, 'p2p')] + [(world, comm) for comm in bench.comm_types]
    with tempfile.TemporaryDirectory() as tmp:
        for seq in bench.seq_lengths:
            runs = {layout: [] for layout in layouts}
            for _ in range(bench.repeats):
                for layout in layouts:
                    runs[layout].append(_run_layout(*layout, bench, seq, tmp))
            ref = _median_results(runs[layouts[0]])
            print(f'\nseq {seq}')
            print(
                f'  CP1             : {ref["step"] * 1e3:9.1f} ms/step '
                f'{seq / ref["step"]:8.1f} tokens/s  {memory_name} {ref["memory"] / 2**20:7.1f} MiB'
            )
            for layout in layouts[1:]:
                res = _median_results(runs[layout])
                print(
                    f'  CP{world} {layout[1]:<11}: {res["step"] * 1e3:9.1f} ms/step '
                    f'{seq / res["step"]:8.1f} tokens/s  {memory_name} '
                    f'{res["memory"] / 2**20:7.1f} MiB/rank'
                )
                print(
                    f'RESULT context parallel: seq {seq} CP{world} {layout[1]}: '
                    f'ratio tokens/s CP{world}/CP1 {ref["step"] / res["step"]:.3f} '
                    f'(main-thread CPU time per step: {ref["cpu"] / res["cpu"]:.3f})   '
                    f'memory/rank CP{world}/CP1 {res["memory"] / ref["memory"]:.3f}   '
                    f'attention comm wait {100 * res["comm"] / res["step"]:.1f}% of the step, '
                    f'grad all-reduce {100 * res["grad"] / res["step"]:.1f}%   '
                    f'loss diff to CP1 {abs(res["loss"] - ref["loss"]) / ref["loss"]:.1e}'
                )


def _single_gpu_kernels(bench):
    """Per-block attention kernels on one GPU: fused flash block and explicit block vs SDPA."""
    import torch

    sys.path.insert(0, REPO)
    from megatron.core.transformer.context_parallel.block_attention import (
        block_backward,
        block_forward,
    )

    device = torch.device('cuda')
    heads, dim = bench.num_attention_heads, bench.hidden_size // bench.num_attention_heads
    for seq in bench.seq_lengths:
        for dtype in (torch.bfloat16, torch.float32):
            gen = torch.Generator(device=device).manual_seed(0)
            q, k, v, dout = (
                torch.randn(1, heads, seq, dim, device=device, dtype=dtype, generator=gen)
                for _ in range(4)
            )
            scale = dim**-0.5

            def ours():
                out, lse = block_forward(q, k, v, causal=True, scale=scale)
                return out, block_backward(dout, q, k, v, out, lse, causal=True, scale=scale)

            def sdpa():
                qs, ks, vs = (t.detach().requires_grad_() for t in (q, k, v))
                out = torch.nn.functional.scaled_dot_product_attention(
                    qs, ks, vs, is_causal=True, scale=scale
                )
                out.backward(dout)
                return out, (qs.grad, ks.grad, vs.grad)

            timings = {}
            for name, fn in (('block kernel', ours), ('torch SDPA', sdpa)):
                fn()
                torch.cuda.synchronize()
                start = time.perf_counter()
                for _ in range(bench.steps):
                    result = fn()
                torch.cuda.synchronize()
                timings[name] = ((time.perf_counter() - start) / bench.steps, result)
            (t_ours, (o1, g1)), (t_ref, (o2, g2)) = timings['block kernel'], timings['torch SDPA']
            err = max(
                (a.float() - b.float()).abs().max().item() for a, b in zip((o1,) + g1, (o2,) + g2)
            )
            kind = 'flash' if dtype == torch.bfloat16 else 'explicit'
            # RESULT lines are what benchmarks/gpu/run_all.sh collects into its summary.
            print(
                f'RESULT context parallel: seq {seq} {str(dtype)} ({kind} block): '
                f'{t_ours * 1e3:.2f} ms fwd+bwd, '
                f'torch SDPA {t_ref * 1e3:8.2f} ms, ratio {t_ref / t_ours:.3f}, '
                f'max abs diff {err:.1e}'
            )


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--seq-lengths', type=int, nargs='+', default=[4096, 8192])
    parser.add_argument('--num-layers', type=int, default=2)
    parser.add_argument('--hidden-size', type=int, default=256)
    parser.add_argument('--num-attention-heads', type=int, default=8)
    parser.add_argument('--vocab', type=int, default=1024)
    parser.add_argument('--steps', type=int, default=3, help='timed steps after one warm-up')
    parser.add_argument('--repeats', type=int, default=1, help='rounds over the layouts')
    parser.add_argument('--comm-types', nargs='+', default=['p2p', 'all_gather', 'a2a'])
    parser.add_argument('--device', choices=['cpu', 'cuda'], default='cpu')
    bench = parser.parse_args()
    if bench.device == 'cuda':
        import torch

        if torch.cuda.device_count() >= 2:
            _cpu_or_multi_gpu(bench, 2)
        else:
            _single_gpu_kernels(bench)
        return
    _cpu_or_multi_gpu(bench, 2)


if __name__ == '__main__':
    main()
