"""Theoretical memory (Megatron's formulas and printed lines) checked by hand, through
tools/report_theoretical_memory.py, and against the measured memory of a CPU training run."""

import json
import os
import pathlib
import subprocess
import sys
from types import SimpleNamespace

from megatron.training.theoretical_memory_usage import report_theoretical_memory

REPO = pathlib.Path(__file__).resolve().parents[3]


def _args(**overrides):
    kw = dict(
        group_query_attention=False,
        num_query_groups=None,
        num_attention_heads=16,
        num_experts=None,
        swiglu=False,
        hidden_size=1024,
        num_layers=24,
        kv_channels=64,
        ffn_hidden_size=4096,
        padded_vocab_size=50304,
        untie_embeddings_and_output_weights=False,
        pipeline_model_parallel_size=1,
        tensor_model_parallel_size=2,
        use_distributed_optimizer=False,
        data_parallel_size=1,
        seq_length=2048,
        micro_batch_size=4,
        virtual_pipeline_model_parallel_size=None,
        sequence_parallel=True,
        recompute_granularity='selective',
    )
    kw.update(overrides)
    return SimpleNamespace(**kw)


def test_lines_by_hand(capsys):
    h, L, V, s, b, tp = 1024, 24, 50304, 2048, 4, 2
    # Q, K, V, O (4 h^2) + MLP (8 h^2) + 2 norms (4 h) per layer, final norm (2 h).
    transformer = L * (12 * h * h + 4 * h) + 2 * h
    shard = (transformer + h * V) / tp
    weights_mb = shard * 18 / 2**20
    per_layer = s * b * h * 34  # 18 + 4 f / h with f = 4h
    act = (per_layer * L + 8 * s * b + s * b * h + 4 * s * b * h * (1 + V / h)) / tp / 2**20
    args = _args()
    report_theoretical_memory(args, verbose=True)
    out = capsys.readouterr().out.splitlines()
    assert args.num_query_groups == 16  # Megatron's side effect without GQA
    assert out == [
        f"Number of parameters in transformer layers in billions:  {transformer / 1e9:.2f}",
        f"Number of parameters in embedding layers in billions: {h * V / 1e9:.2f}",
        f"Total number of parameters in billions: {(transformer + h * V) / 1e9:.2f}",
        f"Number of parameters in most loaded shard in billions: {shard / 1e9:.4f}",
        f"Activation memory footprint per transformer layer: {per_layer / tp / 2**20:.1f} MB",
        f"Theoretical memory footprints: weight and optimizer={weights_mb:.2f} MB, "
        f"activation={act:.2f} MB, total={weights_mb + act:.2f} MB",
        "",
    ]


def test_pipeline_and_distributed_optimizer(capsys):
    args = _args(
        pipeline_model_parallel_size=4,
        virtual_pipeline_model_parallel_size=2,
        use_distributed_optimizer=True,
        data_parallel_size=4,
        sequence_parallel=False,
    )
    report_theoretical_memory(args, verbose=True)
    out = capsys.readouterr().out.splitlines()
    h, L, V = 1024, 24, 50304
    transformer = L * (12 * h * h + 4 * h) + 2 * h
    other = transformer / 8 / 1e9
    assert out[4] == f"Number of parameters in other shards in billions: {other:.4f}"
    shard = (transformer / 4 + h * V) / 2
    assert out[-1] == (
        f"Theoretical memory footprints: weight and optimizer={shard * (6 + 12 / 4) / 2**20:.2f} MB"
    )


MEASURE = r'''
import os, resource, sys, json, contextlib, io
os.environ.update(MASTER_ADDR='127.0.0.1', MASTER_PORT=sys.argv[1], RANK='0', WORLD_SIZE='1')
sys.path.insert(0, os.getcwd())
import torch
import pretrain_gpt
from megatron.core.enums import ModelType
from megatron.training.global_vars import get_args
from megatron.training.initialize import initialize_megatron
from megatron.training.training import setup_model_and_optimizer
from megatron.training.theoretical_memory_usage import compute_weight_and_optimizer_memory
argv = ['--num-layers', '4', '--hidden-size', '256', '--num-attention-heads', '4',
        '--seq-length', '32', '--max-position-embeddings', '32', '--micro-batch-size', '1',
        '--global-batch-size', '1', '--train-iters', '2', '--lr', '1e-4',
        '--tokenizer-type', 'NullTokenizer', '--vocab-size', '4095',
        '--distributed-backend', 'gloo']
with contextlib.redirect_stdout(io.StringIO()):
    initialize_megatron(args_list=argv)
def rss():
    # Peak resident set (VmHWM) since the last reset below; ru_maxrss cannot be reset, and an
    # earlier import may already have peaked above what the model adds.
    with open('/proc/self/status') as f:
        for line in f:
            if line.startswith('VmHWM:'):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
def reset_peak():
    with open('/proc/self/clear_refs', 'w') as f:
        f.write('5')  # Linux: reset VmHWM to the current resident set
def current():
    with open('/proc/self/statm') as f:
        return int(f.read().split()[1]) * os.sysconf('SC_PAGE_SIZE')
# Warm-up: the first Adam step imports modules lazily (tens of MB); keep that out of the count.
_p = torch.nn.Parameter(torch.zeros(4))
_p.grad = torch.zeros(4)
torch.optim.Adam([_p]).step()
reset_peak()
before, before_now = rss(), current()
with contextlib.redirect_stdout(io.StringIO()):
    model, optimizer, _ = setup_model_and_optimizer(pretrain_gpt.model_provider,
                                                    ModelType.encoder_or_decoder)
for chunk in model:
    for p in chunk.parameters():
        p.main_grad.normal_()
optimizer.step()  # the Adam moments now exist
after, after_now = rss(), current()
print(json.dumps({'measured': after - before, 'resident': after_now - before_now,
                  'theory': compute_weight_and_optimizer_memory(get_args())}))
'''


def test_theory_against_measured_cpu_peak():
    """Weights + optimizer of a ~4.2M-parameter GPT in fp32 on CPU, over model and optimizer
    construction and one Adam step. The resident memory held afterwards is 16 bytes per
    parameter (weight, grad buffer, two moments) against the theory's 18 (a 16-bit weight plus an
    fp32 main copy), plus allocator overhead: within 0.7x-1.3x of the theory (0.97x measured).
    The peak resident memory also holds the transient temporaries of the initialisation and of
    the Adam step: within 0.8x-1.6x (1.08x measured). Large allocations are memory-mapped
    (MALLOC_MMAP_THRESHOLD_) so freed temporaries leave the resident set."""
    import socket

    with socket.socket() as sock:
        sock.bind(('127.0.0.1', 0))
        port = str(sock.getsockname()[1])
    env = dict(os.environ, PYTHONPATH=str(REPO), MALLOC_MMAP_THRESHOLD_='65536')
    proc = subprocess.run(
        [sys.executable, '-c', MEASURE, port],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=str(REPO),
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert 0.7 <= result['resident'] / result['theory'] <= 1.3, result
    assert 0.8 <= result['measured'] / result['theory'] <= 1.6, result


def test_report_tool_prints_the_weight_line():
    """The tool parses a training command line, builds the tokenizer for the padded vocabulary
    and prints the lines without any process group (TP1: sequence parallelism is switched off,
    so only the weight and optimizer line)."""
    argv = [
        '--num-layers',
        '24',
        '--hidden-size',
        '1024',
        '--num-attention-heads',
        '16',
        '--seq-length',
        '2048',
        '--max-position-embeddings',
        '2048',
        '--micro-batch-size',
        '4',
        '--global-batch-size',
        '64',
        '--tokenizer-type',
        'GPT2BPETokenizer',
        '--vocab-file',
        str(REPO / 'data/gpt2/gpt2-vocab.json'),
        '--merge-file',
        str(REPO / 'data/gpt2/gpt2-merges.txt'),
    ]
    proc = subprocess.run(
        [sys.executable, str(REPO / 'tools/report_theoretical_memory.py')] + argv,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=str(REPO),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    h, L, V = 1024, 24, 50304
    shard = L * (12 * h * h + 4 * h) + 2 * h + h * V
    assert proc.stdout.splitlines()[-1] == (
        f"Theoretical memory footprints: weight and optimizer={shard * 18 / 2**20:.2f} MB"
    )
    assert f"Number of parameters in most loaded shard in billions: {shard / 1e9:.4f}" in (
        proc.stdout
    )
