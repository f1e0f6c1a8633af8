"""Tensor- and pipeline-parallel overhead on gloo: tokens/s of TP=2 and PP=2 against TP=1.

Three layouts of the same GPT and the same global batch (`--num-microbatches` micro-batches):
- TP1: one process with 2 torch threads (the reference: both cores, no communication);
- TP2: 2 processes x 1 thread, tensor parallel (all-reduces); TP2+SP the same with
  --sequence-parallel (all-gathers / reduce-scatters);
- PP2: 2 processes x 1 thread, 1F1B pipeline over the micro-batches (p2p sends/receives).
Every rank runs pretrain_gpt.py's pieces (initialize_megatron, setup_model_and_optimizer: GPTModel,
DDP, Megatron optimizer; train_step with pretrain_gpt.forward_step and the dataloader's mask).
The layouts run one after the other, `--repeats` rounds in turn, so load from other processes
spreads over all of them; the figure is the median step time of each layout.

Usage: python benchmarks/bench_parallel_overhead.py [--steps 3] [--repeats 1]
       [--num-layers 4 --hidden-size 256 --num-attention-heads 8 --seq-length 256 --vocab 8192]
"""

import argparse
import contextlib
import io
import json
import os
import socket
import statistics
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAYOUTS = {
    'TP1 (2 threads)': (1, 1, 1, 2, False),
    'TP2 (2x1 thread)': (2, 2, 1, 1, False),
    'TP2+SP (2x1 thread)': (2, 2, 1, 1, True),
    'PP2 (2x1 thread)': (2, 1, 2, 1, False),
}  # world, tp, pp, threads, sequence parallel


def _free_port():
    with socket.socket() as sock:
        sock.bind(('127.0.0.1', 0))
        return sock.getsockname()[1]


def _rank_main(rank, world, tp, pp, threads, sp, port, bench, result_file):
    os.environ.update(
        MASTER_ADDR='127.0.0.1',
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
    )
    sys.path.insert(0, REPO)
    import torch

    torch.set_num_threads(threads)
    import pretrain_gpt
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.enums import ModelType
    from megatron.core.utils import get_model_config
    from megatron.training.global_vars import get_args
    from megatron.training.initialize import initialize_megatron
    from megatron.training.training import setup_model_and_optimizer, train_step
    from megatron.training.utils import get_ltor_masks_and_position_ids

    argv = [
        '--num-layers',
        str(bench.num_layers),
        '--hidden-size',
        str(bench.hidden_size),
        '--num-attention-heads',
        str(bench.num_attention_heads),
        '--seq-length',
        str(bench.seq_length),
        '--max-position-embeddings',
        str(bench.seq_length),
        '--micro-batch-size',
        str(bench.micro_batch_size),
        '--global-batch-size',
        str(bench.micro_batch_size * bench.num_microbatches),
        '--train-iters',
        '100',
        '--lr',
        '1e-4',
        '--tokenizer-type',
        'NullTokenizer',
        '--vocab-size',
        str(bench.vocab - 1),
        '--make-vocab-size-divisible-by',
        '128',
        '--attention-dropout',
        '0',
        '--hidden-dropout',
        '0',
        '--clip-grad',
        '1.0',
        '--tensor-model-parallel-size',
        str(tp),
        '--pipeline-model-parallel-size',
        str(pp),
        '--distributed-backend',
        'gloo',
    ]
    if sp:
        argv.append('--sequence-parallel')
    with contextlib.redirect_stdout(io.StringIO()):
        initialize_megatron(args_list=argv)
        model, optimizer, scheduler = setup_model_and_optimizer(
            pretrain_gpt.model_provider, ModelType.encoder_or_decoder
        )
    args = get_args()
    config = get_model_config(model[0])
    config.grad_scale_func = optimizer.scale_loss
    config.finalize_model_grads_func = finalize_model_grads
    g = torch.Generator().manual_seed(0)
    seq = torch.randint(
        0, bench.vocab - 1, (bench.micro_batch_size, bench.seq_length + 1), generator=g
    )
    tokens, labels = seq[:, :-1].contiguous(), seq[:, 1:].contiguous()
    mask, loss_mask, position_ids = get_ltor_masks_and_position_ids(tokens, -1, False, False, False)
    batch = {
        'tokens': tokens,
        'labels': labels,
        'loss_mask': loss_mask,
        'attention_mask': mask,
        'position_ids': position_ids,
    }
    times = []
    for i in range(bench.steps + 1):
        args.curr_iteration = i
        torch.distributed.barrier()
        start = time.perf_counter()
        train_step(
            pretrain_gpt.forward_step,
            iter([batch] * bench.num_microbatches),
            model,
            optimizer,
            scheduler,
            config,
        )
        torch.distributed.barrier()
        if i > 0:
            times.append(time.perf_counter() - start)
    if rank == 0:
        with open(result_file, 'w') as f:
            json.dump(times, f)
    torch.distributed.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--num-layers', type=int, default=4)
    parser.add_argument('--hidden-size', type=int, default=256)
    parser.add_argument('--num-attention-heads', type=int, default=8)
    parser.add_argument('--seq-length', type=int, default=256)
    parser.add_argument('--vocab', type=int, default=8192)
    parser.add_argument('--micro-batch-size', type=int, default=1)
    parser.add_argument('--num-microbatches', type=int, default=8)
    parser.add_argument('--steps', type=int, default=3, help='timed steps after one warm-up')
    parser.add_argument('--repeats', type=int, default=1)
    bench = parser.parse_args()
    import torch.multiprocessing as mp

    times = {name: [] for name in LAYOUTS}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(bench.repeats):
            for name, (world, tp, pp, threads, sp) in LAYOUTS.items():
                result = os.path.join(tmp, f'{r}_{tp}_{pp}_{sp}.json')
                mp.spawn(
                    _rank_main,
                    args=(world, tp, pp, threads, sp, _free_port(), bench, result),
                    nprocs=world,
                    join=True,
                )
                with open(result) as f:
                    times[name] += json.load(f)
    tokens = bench.micro_batch_size * bench.num_microbatches * bench.seq_length
    med = {name: statistics.median(t) for name, t in times.items()}
    print(
        f'GPT {bench.num_layers} layers, hidden {bench.hidden_size}, seq {bench.seq_length}, '
        f'vocab {bench.vocab}, {bench.num_microbatches} micro-batches of '
        f'{bench.micro_batch_size}'
    )
    for name, t in med.items():
        print(f'{name:>20}: {t * 1000:8.1f} ms/step  {tokens / t:8.1f} tokens/s')
    ref = med['TP1 (2 threads)']
    for name in ('TP2 (2x1 thread)', 'TP2+SP (2x1 thread)', 'PP2 (2x1 thread)'):
        print(f'ratio {name} / TP1 (tokens/s): {ref / med[name]:.3f}')


if __name__ == '__main__':
    main()
