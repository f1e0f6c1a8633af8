"""Exact resume through pretrain_gpt.py: the resumed iterations reproduce the uninterrupted losses.

- TP=2, PP=2 (4 gloo ranks, harness workers): an uninterrupted reference run; a run stopped by
  `--exit-interval` (which saves before leaving); the same command again with `--load`. The losses
  of the resumed iterations equal the reference's bit for bit (fp32 on CPU). The same at TP=2 with
  dropout on, where the torch and model-parallel RNG states must be restored too.
- DP=2 with `--use-distributed-optimizer`: a reference run (harness ranks); a torchrun job with
  `--exit-signal-handler` that receives SIGTERM (sent to torchrun, which forwards it) after a few
  iterations and saves; the same torchrun command again, which loads that checkpoint in fresh
  processes and continues with the reference's losses.

Losses are compared through `float.hex`, i.e. bitwise. When run as a script (`torchrun
test_resume.py OUT_PREFIX ARGS...`) this file is the torchrun worker: it runs pretrain_gpt's
`pretrain()` and writes the per-iteration losses of the last pipeline stage to OUT_PREFIX.rankN.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import threading

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

#: Tiny GPT on mock data.
RESUME_ARGS = [
    '--num-layers',
    '4',
    '--hidden-size',
    '32',
    '--num-attention-heads',
    '4',
    '--seq-length',
    '16',
    '--max-position-embeddings',
    '16',
    '--attention-dropout',
    '0.0',
    '--hidden-dropout',
    '0.0',
    '--micro-batch-size',
    '1',
    '--global-batch-size',
    '4',
    '--lr',
    '1e-2',
    '--min-lr',
    '1e-3',
    '--lr-decay-style',
    'cosine',
    '--lr-warmup-iters',
    '2',
    '--weight-decay',
    '0.01',
    '--clip-grad',
    '1.0',
    '--seed',
    '1234',
    '--mock-data',
    '--tokenizer-type',
    'NullTokenizer',
    '--vocab-size',
    '4095',  # mock ids < 4096
    '--split',
    '98,2,0',
    '--num-workers',
    '0',
    '--log-interval',
    '1',
    '--eval-interval',
    '1000',
    '--eval-iters',
    '1',
    '--distributed-backend',
    'gloo',
    '--save-interval',
    '1000',
]


def _hex_losses(train_losses):
    """{iteration: lm loss as float.hex} (exact)."""
    return {int(it): float(losses['lm loss']).hex() for it, losses in train_losses.items()}


def _run_pretrain_in_worker(extra_args, base_args=None):
    """pretrain() on this harness rank (flags: `base_args`, default RESUME_ARGS, then
    `extra_args`); returns the hex losses (last stage) or {}."""
    if REPO not in sys.path:
        sys.path.insert(0, REPO)
    import pretrain_gpt
    from megatron.core.enums import ModelType
    from megatron.training.global_vars import destroy_global_vars
    from megatron.training.training import pretrain

    destroy_global_vars()
    try:
        result = pretrain(
            pretrain_gpt.train_valid_test_datasets_provider,
            pretrain_gpt.model_provider,
            ModelType.encoder_or_decoder,
            pretrain_gpt.forward_step,
            args_list=list(RESUME_ARGS if base_args is None else base_args) + list(extra_args),
        )
    finally:
        destroy_global_vars()
    return _hex_losses(result['train_losses'])


def _stop_and_resume_runs(work_dir, train_iters, stop_at, layout_args):
    """Reference run; run stopped by --exit-interval; the same command again with --load."""
    common = list(layout_args) + ['--train-iters', str(train_iters)]
    reference = _run_pretrain_in_worker(common + ['--save', os.path.join(work_dir, 'ref')])
    resume_dir = os.path.join(work_dir, 'resume')
    stopped = _run_pretrain_in_worker(
        common + ['--save', resume_dir, '--load', resume_dir, '--exit-interval', str(stop_at)]
    )
    resumed = _run_pretrain_in_worker(common + ['--save', resume_dir, '--load', resume_dir])
    return reference, stopped, resumed


def _check_resume(reference, stopped, resumed, train_iters, stop_at):
    assert sorted(reference) == list(range(1, train_iters + 1))
    assert stopped == {it: reference[it] for it in range(1, stop_at + 1)}
    assert resumed == {it: reference[it] for it in range(stop_at + 1, train_iters + 1)}, (
        f'resumed losses {resumed} differ from the uninterrupted run {reference}'
    )


def test_exact_resume_tp2_pp2(tmp_path):
    from tests.unit_tests.dist_utils import run_distributed

    train_iters, stop_at = 6, 3
    layout = ['--tensor-model-parallel-size', '2', '--pipeline-model-parallel-size', '2']
    outs = run_distributed(
        _stop_and_resume_runs,
        world_size=4,
        tp=2,
        pp=2,
        args=(str(tmp_path), train_iters, stop_at, layout),
        timeout=600,
    )
    reference, stopped, resumed = next(o for o in outs if o[0])  # a last-stage rank has the losses
    _check_resume(reference, stopped, resumed, train_iters, stop_at)


def test_exact_resume_with_dropout_tp2(tmp_path):
    """With dropout on, exact resume also needs the torch and model-parallel RNG states restored."""
    from tests.unit_tests.dist_utils import run_distributed

    train_iters, stop_at = 4, 2
    layout = [
        '--tensor-model-parallel-size',
        '2',
        '--attention-dropout',
        '0.1',
        '--hidden-dropout',
        '0.1',
    ]
    outs = run_distributed(
        _stop_and_resume_runs,
        world_size=2,
        tp=2,
        args=(str(tmp_path), train_iters, stop_at, layout),
        timeout=600,
    )
    reference, stopped, resumed = outs[0]
    _check_resume(reference, stopped, resumed, train_iters, stop_at)


# ---------------------------------------------------------------------------------------------
# torchrun + SIGTERM


def _free_port():
    with socket.socket() as sock:
        sock.bind(('127.0.0.1', 0))
        return sock.getsockname()[1]


def _torchrun(nproc, out_prefix, extra_args, base_args=None):
    env = dict(os.environ, OMP_NUM_THREADS='1', PYTHONUNBUFFERED='1')
    cmd = (
        [
            sys.executable,
            '-m',
            'torch.distributed.run',
            '--nproc-per-node',
            str(nproc),
            '--master-addr',
            '127.0.0.1',
            '--master-port',
            str(_free_port()),
            os.path.abspath(__file__),
            out_prefix,
        ]
        + list(RESUME_ARGS if base_args is None else base_args)
        + list(extra_args)
    )
    return subprocess.Popen(
        cmd,
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def _read_losses(out_prefix, nproc):
    merged = {}
    for rank in range(nproc):
        path = f'{out_prefix}.rank{rank}'
        if os.path.exists(path):
            with open(path) as f:
                merged.update({int(k): v for k, v in json.load(f).items()})
    return merged


def _finish(proc, timeout):
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f'torchrun job did not finish within {timeout}s:\n{out[-5000:]}')
    return out


def _run_until_signal(out_prefix, extra_args, signal_after_iteration, timeout, base_args=None):
    """Start a torchrun job, SIGTERM torchrun once the log shows `signal_after_iteration`."""
    proc = _torchrun(2, out_prefix, extra_args, base_args)
    lines, sent = [], threading.Event()
    marker = f' iteration {signal_after_iteration:8d}/'

    def pump():
        for line in proc.stdout:
            lines.append(line)
            if not sent.is_set() and marker in line:
                proc.send_signal(signal.SIGTERM)  # to torchrun only; it forwards to the workers
                sent.set()

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        reader.join(timeout=5)
        tail = ''.join(lines)[-5000:]
        pytest.fail(f'torchrun job did not exit after SIGTERM within {timeout}s:\n{tail}')
    reader.join(timeout=5)
    return sent.is_set(), ''.join(lines)


def test_sigterm_saves_and_resumes_distributed_optimizer(tmp_path):
    """DP=2, --use-distributed-optimizer: SIGTERM -> checkpoint -> rerun the same command."""
    from megatron.training import checkpointing
    from tests.functional_tests.gpt_utils import write_short_documents
    from tests.unit_tests.dist_utils import run_distributed

    train_iters = 24  # margin: the job must still be training when SIGTERM arrives
    common = ['--use-distributed-optimizer', '--train-iters', str(train_iters)]
    # Short documents instead of mock data: the torchrun workers are fresh processes, which
    # would each shuffle the mock corpus's ~12M samples anew.
    data = write_short_documents(str(tmp_path / 'docs_text_document'))
    base = [a for a in RESUME_ARGS if a != '--mock-data']
    base += ['--data-path', data, '--data-cache-path', str(tmp_path / 'index_cache')]
    # The uninterrupted reference runs in the (warm) harness ranks: same code, same gloo numerics.
    outs = run_distributed(
        _run_pretrain_in_worker,
        world_size=2,
        args=(common + ['--save', str(tmp_path / 'ref')], base),
        timeout=300,
    )
    reference = next(o for o in outs if o)
    assert sorted(reference) == list(range(1, train_iters + 1))

    ckpt = str(tmp_path / 'ckpt')
    command = common + ['--save', ckpt, '--load', ckpt, '--exit-signal-handler']
    sent, out = _run_until_signal(str(tmp_path / 'sig_losses'), command, 2, 300, base)
    assert sent, f'the run never logged iteration 2:\n{out[-5000:]}'
    assert 'exiting program after receiving SIGTERM' in out, out[-5000:]
    tracker = checkpointing.get_checkpoint_tracker_filename(ckpt)
    stopped_at, release = checkpointing.read_metadata(tracker)
    assert not release and 2 <= stopped_at < train_iters, out[-5000:]
    stopped = _read_losses(str(tmp_path / 'sig_losses'), 2)
    assert stopped == {it: reference[it] for it in range(1, stopped_at + 1)}
    iter_dir = checkpointing.get_checkpoint_name(ckpt, stopped_at, return_base_dir=True)
    files = sorted(os.listdir(os.path.join(iter_dir, 'mp_rank_00')))
    assert files == ['distrib_optim_dp000.pt', 'distrib_optim_dp001.pt', 'model_optim_rng.pt']

    res_prefix = str(tmp_path / 'resumed_losses')
    out = _finish(_torchrun(2, res_prefix, command, base), timeout=300)
    assert f'successfully loaded checkpoint from {ckpt}' in out, out[-5000:]
    resumed = _read_losses(res_prefix, 2)
    assert resumed == {it: reference[it] for it in range(stopped_at + 1, train_iters + 1)}, (
        f'resumed losses {resumed} differ from the uninterrupted run {reference}'
    )


def _worker_main(out_prefix, args_list):
    """torchrun worker: pretrain() from pretrain_gpt.py; the last stage writes its losses."""
    sys.path.insert(0, REPO)
    import torch

    import pretrain_gpt
    from megatron.core.enums import ModelType
    from megatron.training.training import pretrain

    result = pretrain(
        pretrain_gpt.train_valid_test_datasets_provider,
        pretrain_gpt.model_provider,
        ModelType.encoder_or_decoder,
        pretrain_gpt.forward_step,
        args_list=args_list,
    )
    losses = _hex_losses(result['train_losses'])
    if losses:
        with open(f'{out_prefix}.rank{torch.distributed.get_rank()}', 'w') as f:
            json.dump(losses, f)


if __name__ == '__main__':
    _worker_main(sys.argv[1], sys.argv[2:])
