"""Checkpoint conversion time and peak memory: tools/checkpoint/convert.py against plain
torch.load / torch.save of the same bytes.

A GPT checkpoint at TP1 x PP1 (default ~350M parameters: 24 layers, hidden 1024, 16 heads,
GPT-2 vocabulary padded to 50304, fp32) is written with random weights, then:

- ours: `convert.py` TP1 -> TP2 x PP2, then TP2 x PP2 -> TP1 (each a fresh process; wall time and
  the peak resident memory of its processes);
- reference: a fresh process that torch.load()s every rank file of the source and torch.save()s
  the loaded objects into another directory (the same bytes read and written, no resharding).

Prints one line per direction with ours, the reference and the ratio.

Usage:
    python benchmarks/bench_convert.py            # ~350M GPT (about 1.4 GB per copy on disk)
    python benchmarks/bench_convert.py --small    # 2 layers, hidden 64: a quick smoke run
"""

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

_REFERENCE = r'''
import os, sys, torch
src, dst = sys.argv[1], sys.argv[2]
for root, _, files in os.walk(src):
    for name in files:
        path = os.path.join(root, name)
        out = os.path.join(dst, os.path.relpath(path, src))
        os.makedirs(os.path.dirname(out), exist_ok=True)
        if name.endswith('.pt'):
            torch.save(torch.load(path, map_location='cpu', weights_only=False), out)
'''


def _parse():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument('--small', action='store_true', help='2 layers, hidden 64 (smoke run)')
    parser.add_argument('--dir', default=None, help='work folder (default: a temp dir)')
    return parser.parse_args()


def _model_flags(small):
    if small:
        return [
            '--num-layers',
            '2',
            '--hidden-size',
            '64',
            '--num-attention-heads',
            '4',
            '--seq-length',
            '128',
            '--max-position-embeddings',
            '128',
        ]
    return [
        '--num-layers',
        '24',
        '--hidden-size',
        '1024',
        '--num-attention-heads',
        '16',
        '--seq-length',
        '1024',
        '--max-position-embeddings',
        '1024',
    ]


def write_source(save_dir, small):
    """A TP1 x PP1 checkpoint with random weights (the layout pretrain_gpt.py saves)."""
    import torch

    from megatron.training.arguments import parse_args
    from megatron.training.checkpoint.checkpoint_conversion import CheckpointWriter
    from megatron.training.validation.argument_validation import validate_args

    args = parse_args(
        args_list=_model_flags(small)
        + [
            '--micro-batch-size',
            '1',
            '--mock-data',
            '--tokenizer-type',
            'NullTokenizer',
            '--vocab-size',
            '50256',
        ]
    )
    args.world_size, args.rank = 1, 0
    import contextlib
    import io

    with contextlib.redirect_stdout(io.StringIO()):
        validate_args(args)
    args.padded_vocab_size = 50304
    h, f, L = args.hidden_size, args.ffn_hidden_size, args.num_layers
    g = torch.Generator().manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=g) * 0.02

    stage = {
        'embedding.word_embeddings.weight': rand(50304, h),
        'embedding.position_embeddings.weight': rand(args.max_position_embeddings, h),
    }
    for i in range(L):
        p = f'decoder.layers.{i}.'
        for norm in ('input_layernorm', 'pre_mlp_layernorm'):
            stage[p + norm + '.weight'], stage[p + norm + '.bias'] = torch.ones(h), torch.zeros(h)
        stage[p + 'self_attention.linear_qkv.weight'] = rand(3 * h, h)
        stage[p + 'self_attention.linear_qkv.bias'] = rand(3 * h)
        stage[p + 'self_attention.linear_proj.weight'] = rand(h, h)
        stage[p + 'self_attention.linear_proj.bias'] = rand(h)
        stage[p + 'mlp.linear_fc1.weight'], stage[p + 'mlp.linear_fc1.bias'] = rand(f, h), rand(f)
        stage[p + 'mlp.linear_fc2.weight'], stage[p + 'mlp.linear_fc2.bias'] = rand(h, f), rand(h)
    stage['decoder.final_layernorm.weight'] = torch.ones(h)
    stage['decoder.final_layernorm.bias'] = torch.zeros(h)
    params = sum(t.numel() for t in stage.values())
    CheckpointWriter(save_dir, 1, 1, 1, args, swiglu=False).write_stage(0, stage, True)
    CheckpointWriter(save_dir, 1, 1, 1, args, swiglu=False).finish()
    return params


_MEASURE = (
    'import resource, subprocess, sys; rc = subprocess.run(sys.argv[1:]).returncode; '
    'print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); sys.exit(rc)'
)


def _run(cmd):
    """Wall seconds and peak RSS (GiB, the largest process) of a command and its descendants.

    The command runs under a fresh measuring process, whose RUSAGE_CHILDREN covers only it.
    """
    start = time.time()
    proc = subprocess.run(
        [sys.executable, '-c', _MEASURE] + cmd,
        capture_output=True,
        text=True,
        cwd=REPO,
        env=dict(os.environ, PYTHONPATH=REPO),
    )
    seconds = time.time() - start
    if proc.returncode != 0:
        sys.exit(f'{cmd} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}')
    peak_kib = int(proc.stdout.strip().splitlines()[-1])
    return seconds, peak_kib / 1024**2


def _bytes(path):
    return sum(os.path.getsize(os.path.join(r, n)) for r, _, fs in os.walk(path) for n in fs)


def main():
    opts = _parse()
    work = opts.dir or tempfile.mkdtemp(prefix='bench_convert_')
    os.makedirs(work, exist_ok=True)
    src, tp2pp2, back = (os.path.join(work, n) for n in ('tp1', 'tp2pp2', 'tp1_back'))
    for path in (src, tp2pp2, back, src + '_ref', tp2pp2 + '_ref'):
        shutil.rmtree(path, ignore_errors=True)
    params = write_source(src, opts.small)
    print(
        f'source: {params / 1e6:.1f}M parameters, {_bytes(src) / 1024**3:.2f} GiB at TP1 x PP1'
        f' ({work}); figures are wall times on this machine as loaded at the moment'
    )
    convert = [
        sys.executable,
        os.path.join(REPO, 'tools', 'checkpoint', 'convert.py'),
        '--model-type',
        'GPT',
        '--loader',
        'mcore',
        '--saver',
        'mcore',
    ]
    steps = [
        (
            'TP1 -> TP2xPP2',
            src,
            tp2pp2,
            ['--target-tensor-parallel-size', '2', '--target-pipeline-parallel-size', '2'],
        ),
        (
            'TP2xPP2 -> TP1',
            tp2pp2,
            back,
            ['--target-tensor-parallel-size', '1', '--target-pipeline-parallel-size', '1'],
        ),
    ]
    for label, load, save, target in steps:
        ours_s, ours_gb = _run(convert + ['--load-dir', load, '--save-dir', save] + target)
        ref_s, ref_gb = _run([sys.executable, '-c', _REFERENCE, load, load + '_ref'])
        print(
            f'{label}: convert.py {ours_s:.1f} s, peak RSS {ours_gb:.2f} GiB | torch.load+save '
            f'{ref_s:.1f} s, peak RSS {ref_gb:.2f} GiB | ratio time {ours_s / ref_s:.2f}x, '
            f'memory {ours_gb / max(ref_gb, 1e-9):.2f}x',
            flush=True,
        )
    if opts.dir is None:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == '__main__':
    main()
