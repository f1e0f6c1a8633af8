"""Checkpoint save / load time and size for a ~125M-parameter GPT; optimizer-state bytes per rank.

Each configuration runs as DP gloo (or NCCL on GPUs) ranks spawned by this script. Every rank
builds the model, optimizer and scheduler exactly as pretrain_gpt.py does
(`initialize_megatron` + `setup_model_and_optimizer`), takes one Adam step on synthetic gradients
(so the Adam moments exist), then:

- save: `save_checkpoint` into a fresh directory (wall time on rank 0 between two barriers;
  includes fsync and the tracker update);
- size: bytes of every file of the iteration directory (model_optim_rng.pt, distrib_optim.pt);
- load: a freshly built model/optimizer, `load_checkpoint` (wall time between barriers);
- optimizer state per rank: bytes of the inner optimizer's state tensors plus fp32 main copies that
  do not alias model parameters;
- reference: the same bytes with plain torch.save / torch.load. Each rank torch.saves (and
  fsyncs) one fp32 tensor per file it wrote in our save, of that file's size, in parallel with
  the other ranks; then each rank torch.loads (weights_only, no mmap) the model-file-sized file
  plus its own optimizer-shard-sized file: the bytes a rank needs to resume. Ratio = ours /
  reference (goal <= 1.5). Files sit in the page cache for both, so this is the software overhead
  over raw serialization; figures on a busy shared machine are noisy.

torch_dist (`--format torch_dist`, distributed checkpoints; --use-distributed-optimizer applies):

- sync save / load vs torch.save / torch.load of the same bytes (each rank its own .distcp
  bytes; goal <= 1.5);
- async save: the time the training loop is blocked (the save call: the state-dict build and
  pickling; the write list, planning and writing are the writer thread's) as a share of the
  sync save (goal <= 0.1), when the snapshot (the staging copy, in the writer thread) is taken
  (the next optimizer step waits for it if the forward and backward end earlier), and the time
  until the background write is finalized;
- fully parallel save at the run's DP vs a single writer per DP group
  (--no-ckpt-fully-parallel-save), DP > 1 only;
- resharded load: saved at --tp x --pp, loaded at --load-tp x --load-pp (same world size) vs the
  same-layout load.

Every torch_dist measurement is repeated (--repeats, ours and the reference alternating in the
same processes) and printed as median (min-max); next to the wall time (rank 0, between
barriers) the CPU time of all ranks' processes (all threads) shows the work done, which a
loaded machine does not inflate as much as the wall time.

Usage:
    python benchmarks/bench_checkpoint.py                        # GPT-2 small (124M), DP=1
    python benchmarks/bench_checkpoint.py --dp 1 2 4 --use-distributed-optimizer both
    python benchmarks/bench_checkpoint.py --num-layers 2 --hidden-size 128   # quick smoke run
    python benchmarks/bench_checkpoint.py --format torch_dist --world-size 4 --tp 2 --pp 2 \
        --load-tp 1 --load-pp 1 --use-distributed-optimizer yes      # 124M, torch_dist
    python benchmarks/bench_checkpoint.py --format torch_dist --world-size 4 --tp 1 --pp 1 \
        --use-distributed-optimizer yes                               # DP4: fully parallel save
"""

import argparse
import gc
import json
import os
import shutil
import sys
import tempfile
import time

from bench_checkpoint_common import REPO, _free_port, _synthetic_step


def _parse():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument('--num-layers', type=int, default=12)
    parser.add_argument('--hidden-size', type=int, default=768)
    parser.add_argument('--num-attention-heads', type=int, default=12)
    parser.add_argument('--seq-length', type=int, default=1024)
    parser.add_argument('--dp', type=int, nargs='+', default=[1], help='data-parallel sizes to run')
    parser.add_argument('--use-distributed-optimizer', choices=['no', 'yes', 'both'], default='no')
    parser.add_argument('--bf16', action='store_true', help='bf16 params with fp32 main params')
    parser.add_argument('--dir', default=None, help='checkpoint folder (default: a temp dir)')
    parser.add_argument('--json', default=None, help='also write the results to this file')
    parser.add_argument('--format', choices=['torch', 'torch_dist'], default='torch')
    parser.add_argument('--world-size', type=int, default=1, help='torch_dist: ranks')
    parser.add_argument('--tp', type=int, default=1, help='torch_dist: save layout TP')
    parser.add_argument('--pp', type=int, default=1, help='torch_dist: save layout PP')
    parser.add_argument('--load-tp', type=int, default=None, help='torch_dist: reshard to TP')
    parser.add_argument('--load-pp', type=int, default=None, help='torch_dist: reshard to PP')
    parser.add_argument(
        '--repeats', type=int, default=3, help='torch_dist: alternating repeats of each measurement'
    )
    parser.add_argument(
        '--ckpt-assume-constant-structure',
        action='store_true',
        help='torch_dist: pass the flag (saves reuse the plan, validation and DP distribution)',
    )
    parser.add_argument(
        '--profile',
        default=None,
        help='torch_dist: write cProfile CPU-time profiles of rank 0 (one per operation) here',
    )
    return parser.parse_args()


def _optimizer_state_bytes(model, optimizer) -> int:
    """Bytes of optimizer state tensors + main params that are not views of model params."""
    import torch

    model_storages = {p.untyped_storage().data_ptr() for chunk in model for p in chunk.parameters()}
    seen, total = set(), 0
    for opt in getattr(optimizer, 'chained_optimizers', [optimizer]):
        inner = opt.optimizer
        for state in inner.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor) and value.data_ptr() not in seen:
                    seen.add(value.data_ptr())
                    total += value.numel() * value.element_size()
        for group in inner.param_groups:
            for param in group['params']:
                if param.untyped_storage().data_ptr() in model_storages or param.data_ptr() in seen:
                    continue
                seen.add(param.data_ptr())
                total += param.numel() * param.element_size()
    return total


def _rank_main(rank, world_size, port, bench, use_dist_opt, ckpt_dir, result_file):
    os.environ.update(
        MASTER_ADDR='127.0.0.1',
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
    )
    sys.path.insert(0, REPO)
    import torch

    import pretrain_gpt
    from megatron.core.enums import ModelType
    from megatron.training import checkpointing
    from megatron.training.global_vars import get_args
    from megatron.training.initialize import initialize_megatron
    from megatron.training.training import setup_model_and_optimizer

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
        '1',
        '--global-batch-size',
        str(world_size),
        '--train-iters',
        '10',
        '--lr',
        '1e-4',
        '--tokenizer-type',
        'GPT2BPETokenizer',
        '--vocab-file',
        os.path.join(REPO, 'data', 'gpt2', 'gpt2-vocab.json'),
        '--merge-file',
        os.path.join(REPO, 'data', 'gpt2', 'gpt2-merges.txt'),
        '--save',
        ckpt_dir,
        '--save-interval',
        '1',
    ]
    if not torch.cuda.is_available():
        argv += ['--distributed-backend', 'gloo']
    if use_dist_opt:
        argv.append('--use-distributed-optimizer')
    if bench.bf16:
        argv.append('--bf16')

    import contextlib
    import io

    with contextlib.redirect_stdout(io.StringIO()):
        initialize_megatron(args_list=argv)
        model, optimizer, scheduler = setup_model_and_optimizer(
            pretrain_gpt.model_provider, ModelType.encoder_or_decoder
        )
    args = get_args()
    _synthetic_step(model, optimizer, scheduler, args)
    num_params = sum(p.numel() for chunk in model for p in chunk.parameters())
    opt_bytes = _optimizer_state_bytes(model, optimizer)

    def timed(fn):
        torch.distributed.barrier()
        start = time.perf_counter()
        with contextlib.redirect_stdout(io.StringIO()):
            out = fn()
        torch.distributed.barrier()
        return time.perf_counter() - start, out

    save_s, _ = timed(lambda: checkpointing.save_checkpoint(1, model, optimizer, scheduler, 0))

    del model, optimizer, scheduler  # keep one copy in memory at a time
    gc.collect()
    with contextlib.redirect_stdout(io.StringIO()):
        model, optimizer, scheduler = setup_model_and_optimizer(
            pretrain_gpt.model_provider, ModelType.encoder_or_decoder
        )
    args.consumed_train_samples = 0
    args.consumed_valid_samples = 0
    args.load = ckpt_dir
    load_s, (iteration, _) = timed(
        lambda: checkpointing.load_checkpoint(model, optimizer, scheduler)
    )
    assert iteration == 1
    ref_save_s, ref_load_s = _reference_io(
        checkpointing, torch, ckpt_dir, use_dist_opt, timed, rank
    )

    opt_bytes_all = [None] * world_size
    torch.distributed.all_gather_object(opt_bytes_all, opt_bytes)
    if rank == 0:
        iter_dir = checkpointing.get_checkpoint_name(ckpt_dir, 1, return_base_dir=True)
        files = {}
        for root, _, names in os.walk(iter_dir):
            for name in names:
                path = os.path.join(root, name)
                files[os.path.relpath(path, iter_dir)] = os.path.getsize(path)
        with open(result_file, 'w') as f:
            json.dump(
                {
                    'dp': world_size,
                    'distributed_optimizer': use_dist_opt,
                    'params': num_params,
                    'save_s': save_s,
                    'load_s': load_s,
                    'ref_save_s': ref_save_s,
                    'ref_load_s': ref_load_s,
                    'files': files,
                    'total_bytes': sum(files.values()),
                    'optimizer_state_bytes_per_rank': opt_bytes_all,
                },
                f,
            )
    torch.distributed.destroy_process_group()


def _reference_io(checkpointing, torch, ckpt_dir, use_dist_opt, timed, rank):
    """(save s, load s) of plain torch.save / torch.load on the bytes this rank wrote / needs."""
    from megatron.core import parallel_state as mpu
    from megatron.training.checkpoint import distrib_optim_shards

    model_file = checkpointing.get_checkpoint_name(ckpt_dir, 1)
    dp_rank = mpu.get_data_parallel_rank(with_context_parallel=True)
    shard_file = distrib_optim_shards.shard_name(model_file, dp_rank)
    ref_dir = os.path.join(ckpt_dir, 'reference')
    os.makedirs(ref_dir, exist_ok=True)
    ref_model = os.path.join(ref_dir, 'model.pt')
    ref_shard = os.path.join(ref_dir, f'shard{dp_rank}.pt')
    writes = []
    if dp_rank == 0:
        writes.append((ref_model, os.path.getsize(model_file)))
    if use_dist_opt:
        writes.append((ref_shard, os.path.getsize(shard_file)))
    tensors = [(name, torch.ones(size // 4, dtype=torch.float32)) for name, size in writes]

    def save():
        for name, tensor in tensors:
            with open(name, 'wb') as f:
                torch.save({'data': tensor}, f)
                f.flush()
                os.fsync(f.fileno())

    def load():
        torch.load(ref_model, weights_only=True)
        if use_dist_opt:
            torch.load(ref_shard, weights_only=True)

    save_s, _ = timed(save)
    tensors.clear()  # free the memory before the load
    load_s, _ = timed(load)
    return save_s, load_s


def _run_config(bench, world_size, use_dist_opt, base_dir):
    import torch.multiprocessing as mp

    ckpt_dir = tempfile.mkdtemp(prefix=f'ckpt_dp{world_size}_{int(use_dist_opt)}_', dir=base_dir)
    result_file = os.path.join(ckpt_dir, 'result.json')
    try:
        mp.spawn(
            _rank_main,
            args=(world_size, _free_port(), bench, use_dist_opt, ckpt_dir, result_file),
            nprocs=world_size,
            join=True,
        )
        with open(result_file) as f:
            return json.load(f)
    finally:
        shutil.rmtree(ckpt_dir, ignore_errors=True)


def main():
    bench = _parse()
    if bench.format == 'torch_dist':
        from bench_checkpoint_dist import main_dist

        return main_dist(bench)
    base_dir = bench.dir or tempfile.mkdtemp(prefix='bench_checkpoint_')
    os.makedirs(base_dir, exist_ok=True)
    choices = {'no': [False], 'yes': [True], 'both': [False, True]}
    dist_opt_values = choices[bench.use_distributed_optimizer]
    results = []
    mib = 1024.0**2
    print(
        f'{"DP":>3} {"dist-opt":>8} {"params":>12} {"ckpt MiB":>9} {"save s":>7} '
        f'{"save MiB/s":>10} '
        f'{"load s":>7} {"ref save":>8} {"ratio":>5} {"ref load":>8} {"ratio":>5} '
        f'{"opt-state MiB/rank":>20}',
        flush=True,
    )
    for world_size in bench.dp:
        for use_dist_opt in dist_opt_values:
            res = _run_config(bench, world_size, use_dist_opt, base_dir)
            results.append(res)
            per_rank = ', '.join(f'{b / mib:.1f}' for b in res['optimizer_state_bytes_per_rank'])
            print(
                f'{res["dp"]:>3} {str(use_dist_opt):>8} {res["params"]:>12,} '
                f'{res["total_bytes"] / mib:>9.1f} '
                f'{res["save_s"]:>7.2f} {res["total_bytes"] / mib / res["save_s"]:>10.1f} '
                f'{res["load_s"]:>7.2f} {res["ref_save_s"]:>8.2f} '
                f'{res["save_s"] / res["ref_save_s"]:>5.2f} {res["ref_load_s"]:>8.2f} '
                f'{res["load_s"] / res["ref_load_s"]:>5.2f} {per_rank:>20}',
                flush=True,
            )
            for name, size in sorted(res['files'].items()):
                if name.startswith('reference'):
                    continue
                print(f'      {name}: {size / mib:.1f} MiB', flush=True)
    if bench.json:
        with open(bench.json, 'w') as f:
            json.dump(results, f, indent=1)
    if bench.dir is None:
        shutil.rmtree(base_dir, ignore_errors=True)


if __name__ == '__main__':
    main()
