"""torch_dist measurements of bench_checkpoint.py (`--format torch_dist`); see its docstring.

Phases, each one set of spawned ranks (`mp.spawn`) of the same world size:

- save (the --tp x --pp layout): one Adam step, then `--repeats` rounds of [our sync save,
  torch.save + fsync of the same bytes per rank] in alternating order, then `--repeats` + 1
  asynchronous saves (the first allocates the snapshot buffers). Before each timed save its side
  deletes its previous files (untimed), so both write into the same page-cache room;
- load (same layout): `--repeats` rounds of [our load, torch.load of the same bytes];
- load at --load-tp x --load-pp (resharded), and for DP > 1 sync saves with
  --no-ckpt-fully-parallel-save (a single writer per DP group).

Times: wall on rank 0 between barriers (the slowest rank), and CPU: the process CPU time of
every rank (all threads) summed. The async save's blocked time is the slowest rank's time in
`save_checkpoint` (the state-dict build, pickling, scheduling); its CPU is the main threads'
CPU.
"""

import contextlib
import cProfile
import io
import json
import os
import pstats
import shutil
import statistics
import sys
import tempfile
import time

from bench_checkpoint_common import REPO, _free_port, _synthetic_step


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
    if bench.ckpt_assume_constant_structure:
        argv.append('--ckpt-assume-constant-structure')
    return argv + list(extra)


class _Meter:
    """Wall (rank 0, between barriers) and CPU (all ranks' processes) of collective steps."""

    def __init__(self, torch, rank, profile_dir):
        self.torch = torch
        self.rank = rank
        self.profile_dir = profile_dir

    def _sum(self, value, op='sum'):
        torch = self.torch
        t = torch.tensor([value], dtype=torch.float64)
        reduce_op = (
            torch.distributed.ReduceOp.SUM if op == 'sum' else torch.distributed.ReduceOp.MAX
        )
        torch.distributed.all_reduce(t, op=reduce_op)
        return float(t.item())

    def _profiled(self, fn, name):
        if self.profile_dir is None or self.rank != 0 or name is None:
            return fn()
        prof = cProfile.Profile(time.thread_time)  # CPU of the calling thread
        prof.enable()
        try:
            return fn()
        finally:
            prof.disable()
            out = io.StringIO()
            pstats.Stats(prof, stream=out).sort_stats('cumulative').print_stats(40)
            with open(os.path.join(self.profile_dir, f'{name}.txt'), 'w') as f:
                f.write(out.getvalue())

    def measure(self, fn, name=None):
        """(wall s, CPU s of all ranks) of fn() run by every rank."""
        self.torch.distributed.barrier()
        cpu0, start = time.process_time(), time.perf_counter()
        with contextlib.redirect_stdout(io.StringIO()):
            self._profiled(fn, name)
        self.torch.distributed.barrier()
        wall = time.perf_counter() - start
        return wall, self._sum(time.process_time() - cpu0)

    def measure_async(self, save, finalize, writers_finished, wait_staged, name=None):
        """(blocked s (slowest rank), main-thread CPU s (all ranks), finalize s, total s,
        snapshot taken after s (slowest rank))."""
        torch = self.torch
        torch.distributed.barrier()
        start, cpu0 = time.perf_counter(), time.thread_time()
        with contextlib.redirect_stdout(io.StringIO()):
            self._profiled(save, name)
        blocked = time.perf_counter() - start
        blocked_cpu = time.thread_time() - cpu0
        # Training's next optimizer step waits for the snapshot only if its forward and
        # backward take less than this (from the start of the save call).
        wait_staged()
        staged = time.perf_counter() - start
        while not writers_finished():  # the background write (training would run meanwhile)
            time.sleep(0.01)
        torch.distributed.barrier()
        fin_start = time.perf_counter()
        with contextlib.redirect_stdout(io.StringIO()):
            self._profiled(finalize, None if name is None else name + '_finalize')
        torch.distributed.barrier()
        end = time.perf_counter()
        return (
            self._sum(blocked, 'max'),
            self._sum(blocked_cpu),
            end - fin_start,
            end - start,
            self._sum(staged, 'max'),
        )


def _remove_iteration(ckpt_dir, iteration):
    shutil.rmtree(os.path.join(ckpt_dir, f'iter_{iteration:07d}'), ignore_errors=True)


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
    from megatron.training.global_vars import get_args
    from megatron.training.initialize import initialize_megatron
    from megatron.training.training import setup_model_and_optimizer

    with contextlib.redirect_stdout(io.StringIO()):
        initialize_megatron(args_list=_argv(bench, ckpt_dir, world_size=world_size, **cfg))
        model, optimizer, scheduler = setup_model_and_optimizer(
            pretrain_gpt.model_provider, ModelType.encoder_or_decoder
        )
    args = get_args()
    meter = _Meter(torch, rank, bench.profile)
    state = (model, optimizer, scheduler)
    if phase.startswith('save'):
        _synthetic_step(model, optimizer, scheduler, args)
        result = _save_phase(torch, args, state, meter, ckpt_dir, rank, bench, phase)
    else:
        result = _load_phase(torch, args, state, meter, ckpt_dir, rank, bench, phase)
    if rank == 0:
        result['params'] = sum(p.numel() for chunk in model for p in chunk.parameters())
        with open(result_file, 'w') as f:
            json.dump(result, f)
    torch.distributed.destroy_process_group()


def _save_phase(torch, args, state, meter, ckpt_dir, rank, bench, phase):
    from megatron.training import checkpointing
    from megatron.training.checkpoint import checkpointing_dist

    result = {'save': [], 'ref_save': [], 'async': []}
    iteration = 0
    ref = None

    def ours(name):
        # Each side first drops its previous files (untimed), so both write into a page
        # cache with the same room: otherwise one side's writes pay for reclaiming the other's.
        nonlocal iteration
        iteration += 1
        torch.distributed.barrier()
        if rank == 0:
            _remove_iteration(ckpt_dir, iteration - 1)
        it = iteration
        result['save'].append(
            meter.measure(lambda: checkpointing.save_checkpoint(it, *state, 0), name)
        )

    def reference():
        ref.remove()
        result['ref_save'].append(meter.measure(ref.save))

    for i in range(bench.repeats):
        name = f'{phase}_sync' if i == bench.repeats - 1 else None
        if phase == 'save_single':
            ours(name)
        elif ref is None:  # the bytes each rank writes: one reference file per .distcp
            ours(name)
            ref = _Reference(torch, ckpt_dir, rank, iteration)
            reference()
        elif i % 2:
            reference()
            ours(name)
        else:
            ours(name)
            reference()
    if phase == 'save_single':
        return result
    args.async_save = True
    for i in range(bench.repeats + 1):  # the first snapshot allocates its buffers
        iteration += 1
        it = iteration
        torch.distributed.barrier()
        if rank == 0:
            _remove_iteration(ckpt_dir, iteration - 1)
        result['async'].append(
            meter.measure_async(
                lambda: checkpointing.save_checkpoint(it, *state, 0),
                lambda: checkpointing.maybe_finalize_async_save(blocking=True),
                checkpointing_dist.async_writers_finished,
                checkpointing_dist.wait_for_async_staging,
                f'{phase}_async' if i == bench.repeats else None,
            )
        )
    result['last_iteration'] = iteration
    return result


def _load_phase(torch, args, state, meter, ckpt_dir, rank, bench, phase):
    from megatron.training import checkpointing

    result = {'load': [], 'ref_load': []}
    ref = _Reference(torch, ckpt_dir, rank, None) if phase == 'load' else None

    def ours():
        args.consumed_train_samples = 0
        args.consumed_valid_samples = 0
        iteration, _ = checkpointing.load_checkpoint(*state)
        assert iteration == bench.last_iteration, iteration

    for i in range(bench.repeats):
        name = f'{phase}' if i == bench.repeats - 1 else None
        if ref is not None and i % 2:
            result['ref_load'].append(meter.measure(ref.load))
        result['load'].append(meter.measure(ours, name))
        if ref is not None and not i % 2:
            result['ref_load'].append(meter.measure(ref.load))
    return result


class _Reference:
    """torch.save (fsync) / torch.load (weights only) of the bytes this rank wrote in our save:
    one fp32 tensor per .distcp file, of that file's size."""

    def __init__(self, torch, ckpt_dir, rank, iteration):
        self.torch = torch
        self.dir = os.path.join(ckpt_dir, f'reference{rank}')
        if iteration is None:  # load phase: the files the save phase wrote
            self.names = sorted(os.path.join(self.dir, n) for n in os.listdir(self.dir))
            self.tensors = []
            return
        iter_dir = os.path.join(ckpt_dir, f'iter_{iteration:07d}')
        sizes = [
            os.path.getsize(os.path.join(iter_dir, n))
            for n in sorted(os.listdir(iter_dir))
            if n.startswith(f'__{rank}_')
        ]
        os.makedirs(self.dir, exist_ok=True)
        self.names = [os.path.join(self.dir, f'{i}.pt') for i in range(len(sizes))]
        self.tensors = [torch.ones(size // 4, dtype=torch.float32) for size in sizes]

    def remove(self):
        for name in self.names:  # fresh files, like our save's
            if os.path.exists(name):
                os.remove(name)

    def save(self):
        for name, tensor in zip(self.names, self.tensors):
            with open(name, 'wb') as f:
                self.torch.save({'data': tensor}, f)
                f.flush()
                os.fsync(f.fileno())

    def load(self):
        for name in self.names:
            self.torch.load(name, weights_only=True)


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


def _checkpoint_bytes(ckpt_dir, iteration):
    iter_dir = os.path.join(ckpt_dir, f'iter_{iteration:07d}')
    return sum(os.path.getsize(os.path.join(iter_dir, n)) for n in os.listdir(iter_dir))


def _stat(values):
    return statistics.median(values), min(values), max(values)


def _fmt(values, digits=2):
    med, lo, hi = _stat(values)
    return f'{med:.{digits}f} ({lo:.{digits}f}-{hi:.{digits}f})'


def _compare(label, ours, ref, ref_label):
    """One line: ours and the reference, wall median (min-max) and CPU, and their ratios."""
    ow, oc = [w for w, _ in ours], [c for _, c in ours]
    rw, rc = [w for w, _ in ref], [c for _, c in ref]
    paired = [a / b for a, b in zip(ow, rw)]
    ratio = statistics.median(ow) / statistics.median(rw)
    cpu_ratio = statistics.median(oc) / statistics.median(rc)
    print(
        f'{label:<14} wall {_fmt(ow)} s, CPU {statistics.median(oc):.2f} s | {ref_label} wall '
        f'{_fmt(rw)} s, CPU {statistics.median(rc):.2f} s | ratio {ratio:.2f} (paired '
        f'{min(paired):.2f}-{max(paired):.2f}), CPU ratio {cpu_ratio:.2f}',
        flush=True,
    )
    return {'wall_ratio': ratio, 'cpu_ratio': cpu_ratio}


def _report_async(saved):
    sync_wall = statistics.median(w for w, _ in saved['save'])
    sync_cpu = statistics.median(c for _, c in saved['save'])
    runs = saved['async']
    out = {}
    for what, rows in (('first', runs[:1]), ('steady', runs[1:])):
        blocked = [r[0] for r in rows]
        cpu = [r[1] for r in rows]
        fin = [r[2] for r in rows]
        total = [r[3] for r in rows]
        staged = [r[4] for r in rows]
        share = statistics.median(blocked) / sync_wall
        cpu_share = statistics.median(cpu) / sync_cpu
        out[what] = {
            'blocked_share': share,
            'cpu_share': cpu_share,
            'staged_s': statistics.median(staged),
        }
        print(
            f'async save ({what}, {len(rows)}x) blocked {_fmt(blocked, 3)} s = {share:.3f} of '
            f'the sync save (median); main-thread CPU {statistics.median(cpu):.2f} s = '
            f'{cpu_share:.3f} of the sync save CPU; snapshot taken after {_fmt(staged, 3)} s '
            f'(overlaps the next forward/backward); finalize {_fmt(fin, 3)} s; written and '
            f'finalized after {statistics.median(total):.2f} s',
            flush=True,
        )
    return out


def main_dist(bench):
    base_dir = bench.dir or tempfile.mkdtemp(prefix='bench_checkpoint_dist_')
    os.makedirs(base_dir, exist_ok=True)
    if bench.profile:
        os.makedirs(bench.profile, exist_ok=True)
    dist_opt = bench.use_distributed_optimizer == 'yes'
    layout = dict(tp=bench.tp, pp=bench.pp, dist_opt=dist_opt)
    mib = 1024.0**2
    out = {}
    try:
        ckpt = tempfile.mkdtemp(dir=base_dir)
        saved = _spawn(bench, 'save', layout, ckpt)
        bench.last_iteration = saved['last_iteration']
        same = _spawn(bench, 'load', layout, ckpt)
        out.update(saved=saved, same_layout_load=same)
        out['bytes'] = _checkpoint_bytes(ckpt, bench.last_iteration)
        print(
            f'{saved["params"]:,} params (rank 0), world {bench.world_size}, TP{bench.tp} x '
            f'PP{bench.pp}, distributed optimizer {dist_opt}, checkpoint '
            f'{out["bytes"] / mib:.0f} MiB, {bench.repeats} repeats'
            + (', --ckpt-assume-constant-structure' if bench.ckpt_assume_constant_structure else '')
        )
        print('wall: median (min-max) s on rank 0 between barriers; CPU: all ranks, median')
        out['sync_save'] = _compare('sync save', saved['save'], saved['ref_save'], 'torch.save')
        out['load'] = _compare('load', same['load'], same['ref_load'], 'torch.load')
        out['async'] = _report_async(saved)
        if bench.load_tp or bench.load_pp:
            other = dict(
                tp=bench.load_tp or bench.tp, pp=bench.load_pp or bench.pp, dist_opt=dist_opt
            )
            resharded = _spawn(bench, 'load_resharded', other, ckpt)
            out['resharded_load'] = resharded
            out['reshard'] = _compare(
                f'TP{other["tp"]}xPP{other["pp"]} load',
                resharded['load'],
                same['load'],
                'same-layout load',
            )
        dp = bench.world_size // (bench.tp * bench.pp)
        if dp > 1:
            single = tempfile.mkdtemp(dir=base_dir)
            single_layout = dict(layout, extra=['--no-ckpt-fully-parallel-save'])
            saved_single = _spawn(bench, 'save_single', single_layout, single)
            out['single_writer_save'] = saved_single
            out['fully_parallel'] = _compare(
                f'DP{dp} parallel', saved['save'], saved_single['save'], 'single writer'
            )
    finally:
        if bench.dir is None:
            shutil.rmtree(base_dir, ignore_errors=True)
    if bench.json:
        with open(bench.json, 'w') as f:
            json.dump(out, f, indent=1)
