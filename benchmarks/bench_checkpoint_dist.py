"""torch_dist measurements of bench_checkpoint.py (`--format torch_dist`); see its docstring."""

import contextlib
import io
import json
import os
import shutil
import sys
import tempfile
import time

from bench_checkpoint import REPO, _free_port, _synthetic_step


def _argv(bench, ckpt_dir, tp, pp, world_size, dist_opt, extra=()):
    import torch

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
        '--load',
        ckpt_dir,
        '--save-interval',
        '1',
        '--use-dist-ckpt',
        '--tensor-model-parallel-size',
        str(tp),
        '--pipeline-model-parallel-size',
        str(pp),
        '--use-cpu-initialization',
    ]
    if not torch.cuda.is_available():
        argv += ['--distributed-backend', 'gloo']
    if dist_opt:
        argv.append('--use-distributed-optimizer')
    if bench.bf16:
        argv.append('--bf16')
    return argv + list(extra)


def _rank_main(rank, world_size, port, bench, phase, cfg, ckpt_dir, result_file):
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

    with contextlib.redirect_stdout(io.StringIO()):
        initialize_megatron(args_list=_argv(bench, ckpt_dir, world_size=world_size, **cfg))
        model, optimizer, scheduler = setup_model_and_optimizer(
            pretrain_gpt.model_provider, ModelType.encoder_or_decoder
        )
    args = get_args()

    def timed(fn):
        torch.distributed.barrier()
        start = time.perf_counter()
        with contextlib.redirect_stdout(io.StringIO()):
            out = fn()
        torch.distributed.barrier()
        return time.perf_counter() - start, out

    result = {}
    if phase == 'save':
        _synthetic_step(model, optimizer, scheduler, args)
        result['save_s'], _ = timed(
            lambda: checkpointing.save_checkpoint(1, model, optimizer, scheduler, 0)
        )
        args.async_save = True
        for iteration in (2, 3):  # the first snapshot allocates its buffers, the next reuse them
            torch.distributed.barrier()
            start = time.perf_counter()
            with contextlib.redirect_stdout(io.StringIO()):
                checkpointing.save_checkpoint(iteration, model, optimizer, scheduler, 0)
            blocked = time.perf_counter() - start
            waited, _ = timed(lambda: checkpointing.maybe_finalize_async_save(blocking=True))
            result[f'async_blocked_s_{iteration}'] = blocked
            result[f'async_total_s_{iteration}'] = blocked + waited
        result.update(_reference(torch, ckpt_dir, rank, timed))
    else:
        args.consumed_train_samples = 0
        args.consumed_valid_samples = 0
        result['load_s'], (iteration, _) = timed(
            lambda: checkpointing.load_checkpoint(model, optimizer, scheduler)
        )
        assert iteration == 3, iteration
    if rank == 0:
        result['params'] = sum(p.numel() for chunk in model for p in chunk.parameters())
        with open(result_file, 'w') as f:
            json.dump(result, f)
    torch.distributed.destroy_process_group()


def _reference(torch, ckpt_dir, rank, timed):
    """torch.save (fsync) / torch.load of the bytes this rank wrote, one file per .distcp."""
    iter_dir = os.path.join(ckpt_dir, 'iter_0000001')
    sizes = [
        os.path.getsize(os.path.join(iter_dir, n))
        for n in os.listdir(iter_dir)
        if n.startswith(f'__{rank}_')
    ]
    ref_dir = os.path.join(ckpt_dir, f'reference{rank}')
    os.makedirs(ref_dir, exist_ok=True)
    tensors = [torch.ones(size // 4, dtype=torch.float32) for size in sizes]
    names = [os.path.join(ref_dir, f'{i}.pt') for i in range(len(sizes))]

    def save():
        for name, tensor in zip(names, tensors):
            with open(name, 'wb') as f:
                torch.save({'data': tensor}, f)
                f.flush()
                os.fsync(f.fileno())

    def load():
        for name in names:
            torch.load(name, weights_only=True)

    ref_save_s, _ = timed(save)
    tensors.clear()
    ref_load_s, _ = timed(load)
    return {'ref_save_s': ref_save_s, 'ref_load_s': ref_load_s, 'bytes_rank0': sum(sizes)}


def _spawn(bench, phase, cfg, ckpt_dir):
    import torch.multiprocessing as mp

    result_file = os.path.join(ckpt_dir, f'result_{phase}.json')
    mp.spawn(
        _rank_main,
        args=(bench.world_size, _free_port(), bench, phase, cfg, ckpt_dir, result_file),
        nprocs=bench.world_size,
        join=True,
    )
    with open(result_file) as f:
        return json.load(f)


def _checkpoint_bytes(ckpt_dir):
    iter_dir = os.path.join(ckpt_dir, 'iter_0000003')
    return sum(os.path.getsize(os.path.join(iter_dir, n)) for n in os.listdir(iter_dir))


def main_dist(bench):
    base_dir = bench.dir or tempfile.mkdtemp(prefix='bench_checkpoint_dist_')
    os.makedirs(base_dir, exist_ok=True)
    dist_opt = bench.use_distributed_optimizer == 'yes'
    layout = dict(tp=bench.tp, pp=bench.pp, dist_opt=dist_opt)
    mib = 1024.0**2
    out = {}
    try:
        ckpt = tempfile.mkdtemp(dir=base_dir)
        saved = _spawn(bench, 'save', layout, ckpt)
        same = _spawn(bench, 'load', layout, ckpt)
        out.update(saved=saved, same_layout_load=same, bytes=_checkpoint_bytes(ckpt))
        print(
            f'{saved["params"]:,} params, world {bench.world_size}, TP{bench.tp} x PP{bench.pp}, '
            f'distributed optimizer {dist_opt}, checkpoint {out["bytes"] / mib:.0f} MiB'
        )
        print(
            f'sync save   {saved["save_s"]:7.2f} s   torch.save same bytes '
            f'{saved["ref_save_s"]:7.2f} s   ratio {saved["save_s"] / saved["ref_save_s"]:.2f}'
        )
        print(
            f'load        {same["load_s"]:7.2f} s   torch.load same bytes '
            f'{saved["ref_load_s"]:7.2f} s   ratio {same["load_s"] / saved["ref_load_s"]:.2f}'
        )
        for it, what in ((2, 'first'), (3, 'steady')):
            blocked, total = saved[f'async_blocked_s_{it}'], saved[f'async_total_s_{it}']
            print(
                f'async save ({what}) blocked {blocked:.3f} s = {blocked / saved["save_s"]:.3f} '
                f'of the sync save; written and finalized after {total:.2f} s'
            )
        if bench.load_tp or bench.load_pp:
            other = dict(
                tp=bench.load_tp or bench.tp, pp=bench.load_pp or bench.pp, dist_opt=dist_opt
            )
            resharded = _spawn(bench, 'load', other, ckpt)
            out['resharded_load'] = resharded
            print(
                f'resharded load to TP{other["tp"]} x PP{other["pp"]} {resharded["load_s"]:7.2f} s'
                f'   same-layout load {same["load_s"]:7.2f} s   ratio '
                f'{resharded["load_s"] / same["load_s"]:.2f}'
            )
        dp = bench.world_size // (bench.tp * bench.pp)
        if dp > 1:
            single = tempfile.mkdtemp(dir=base_dir)
            single_layout = dict(layout, extra=['--no-ckpt-fully-parallel-save'])
            saved_single = _spawn(bench, 'save', single_layout, single)
            out['single_writer_save'] = saved_single
            print(
                f'fully parallel save at DP{dp} {saved["save_s"]:7.2f} s   single writer per DP '
                f'group {saved_single["save_s"]:7.2f} s   ratio '
                f'{saved["save_s"] / saved_single["save_s"]:.2f}'
            )
    finally:
        if bench.dir is None:
            shutil.rmtree(base_dir, ignore_errors=True)
    if bench.json:
        with open(bench.json, 'w') as f:
            json.dump(out, f, indent=1)
