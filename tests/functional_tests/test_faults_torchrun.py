"""Faults under real torchrun launchers: a frozen rank is reported by the watchdog, workers die
with their launcher, `--max-restarts` resumes from the last checkpoint with the uninterrupted
losses, and a two-node job (two launchers, c10d rendezvous on 127.0.0.1) trains and resumes
with the same losses (the two-node run is also the restart test's uninterrupted reference)."""

import os
import re
import signal
import time

import pytest

from tests.functional_tests.torchrun_utils import Launcher, free_port, losses


def _standalone(nproc, port, *extra):
    return [
        '--nproc-per-node',
        str(nproc),
        '--master-addr',
        '127.0.0.1',
        '--master-port',
        str(port),
        *extra,
    ]


@pytest.fixture(scope='module')
def corpus(gpt_data_prefix, tmp_path_factory):
    """Data flags of the jobs that train: the session's preprocessed corpus, with one index cache
    for the module, so only the first worker of a plan builds its indices."""
    cache = str(tmp_path_factory.mktemp('torchrun_index_cache'))
    return ['--data-path', gpt_data_prefix, '--data-cache-path', cache, '--split', '98,2,0']


def test_argument_error_is_one_line_once_under_torchrun(tmp_path):
    run = Launcher(
        _standalone(2, free_port()),
        ['--global-batch-size', '4', '--train-iters', '2', '--tensor-model-parallel-size', '3'],
        str(tmp_path / 'log'),
    )
    try:
        assert run.wait(300) == 1
    finally:
        run.kill()
    text = run.output()
    expected = (
        'error: world size (2) is not divisible by --tensor-model-parallel-size (3) x '
        '--pipeline-model-parallel-size (1) x --context-parallel-size (1) = 3'
    )
    assert [line for line in text.splitlines() if 'error:' in line] == [expected], text
    # No worker traceback (torchrun's own failure summary follows, from the launcher).
    assert 'pretrain_gpt.py", line' not in text and '[rank' not in text, text


def test_refusal_is_printed_even_when_rank_0_is_late(tmp_path):
    """Every rank refuses the arguments, but rank 0 is held back (SIGSTOP, as a slow or loaded
    rank 0 is): another rank prints the line, once, before the launcher stops the job (rank 0
    alone printed it, and torchrun killed it first when rank 1 exited before it)."""
    run = Launcher(
        _standalone(2, free_port()),
        ['--global-batch-size', '4', '--train-iters', '2', '--tensor-model-parallel-size', '3'],
        str(tmp_path / 'log'),
    )
    try:
        deadline = time.time() + 120
        while True:
            try:
                rank0 = run.worker_pid(0)
                break
            except AssertionError:
                assert time.time() < deadline, run.output()
                time.sleep(0.02)
        os.kill(rank0, signal.SIGSTOP)
        # Rank 1 refuses and exits; torchrun then stops the job (rank 0 cannot react while
        # stopped: it gets the launcher's SIGTERM once continued).
        run.wait_for(r'closing signal SIGTERM|Sending process \d+ closing signal', 120)
        os.kill(rank0, signal.SIGCONT)
        assert run.wait(120) == 1
    finally:
        run.kill()
    text = run.output()
    expected = (
        'error: world size (2) is not divisible by --tensor-model-parallel-size (3) x '
        '--pipeline-model-parallel-size (1) x --context-parallel-size (1) = 3'
    )
    assert [line for line in text.splitlines() if 'error:' in line] == [expected], text


def test_frozen_rank_is_reported_by_the_watchdog(tmp_path, corpus):
    run = Launcher(
        _standalone(2, free_port()),
        ['--global-batch-size', '4', '--train-iters', '100000', '--watchdog-timeout', '6'],
        str(tmp_path / 'log'),
        data_args=corpus,
    )
    try:
        run.wait_for(r'iteration +3/', 120)
        frozen = run.worker_pid(1)
        os.kill(frozen, signal.SIGSTOP)
        stopped_at = time.time()
        text = run.wait_for(r'watchdog: .*--watchdog-timeout 6\)', 60)
        # Found after the timeout, long before --distributed-timeout-minutes (10 min).
        assert time.time() - stopped_at < 30
        line = re.search(r'watchdog: .*', text).group(0)
        assert re.search(
            # Heartbeats go out on a poll interval, so the frozen rank's last one may still name
            # initialization; the rank, the silence and the waiting operation are what matter.
            r"rank 1 stopped making progress: no heartbeat for \d+ s \(last "
            r"heartbeat in '(initialization|training iteration)' at iteration \d+\)",
            line,
        ), line
        assert re.search(
            r"rank 0 has waited \d+ s in 'training iteration' at iteration \d+", line
        ), line
        assert text.count('watchdog:') == 1
        # torchrun saw rank 0 exit and stops the job; the stopped rank cannot act on the
        # launcher's SIGTERM, so spare the test torchrun's 30 s grace period.
        run.wait_for(r'closing signal SIGTERM', 30)
        os.kill(frozen, signal.SIGKILL)
        assert run.wait(60) != 0
        assert re.search(r'exitcode *: 3 ', run.output())
    finally:
        run.kill()


def test_workers_exit_when_the_launcher_dies(tmp_path, corpus):
    run = Launcher(
        _standalone(2, free_port()),
        ['--global-batch-size', '4', '--train-iters', '100000'],
        str(tmp_path / 'log'),
        data_args=corpus,
    )
    try:
        run.wait_for(r'iteration +2/', 120)
        workers = [run.worker_pid(0), run.worker_pid(1)]
        os.kill(run.proc.pid, signal.SIGKILL)
        run.proc.wait(10)
        deadline = time.time() + 15
        while time.time() < deadline and any(os.path.exists(f'/proc/{w}') for w in workers):
            time.sleep(0.2)
        alive = [
            w
            for w in workers
            if os.path.exists(f'/proc/{w}')
            and open(f'/proc/{w}/stat').read().rsplit(')', 1)[1].split()[0] != 'Z'
        ]
        assert alive == [], 'orphaned workers still running'
        assert 'the launcher (pid %d) is gone; exiting' % run.proc.pid in run.output()
    finally:
        run.kill()


#: 12 iterations on 2 ranks (DP2), a checkpoint every 3.
TRAIN = ['--global-batch-size', '4', '--train-iters', '12', '--save-interval', '3']


def _two_nodes(tmp_path, name, train_args, data_args):
    """Two torchrun launchers ("nodes") of one worker each, c10d rendezvous on 127.0.0.1."""
    port = free_port()
    rdzv = [
        '--nnodes',
        '2',
        '--nproc-per-node',
        '1',
        '--rdzv-backend',
        'c10d',
        '--rdzv-endpoint',
        f'127.0.0.1:{port}',
        '--rdzv-id',
        f'reliab-{name}',
    ]
    nodes = [
        Launcher(rdzv, train_args, str(tmp_path / f'{name}-node{i}.log'), data_args=data_args)
        for i in range(2)
    ]
    try:
        codes = [node.wait(300) for node in nodes]
        outputs = [node.output() for node in nodes]
    finally:
        for node in nodes:
            node.kill()
    assert codes == [0, 0], '\n'.join(o[-2000:] for o in outputs)
    return ''.join(outputs)


@pytest.fixture(scope='module')
def two_node_reference(tmp_path_factory, corpus):
    """The uninterrupted run of TRAIN on two nodes, saving every 3 iterations: (its losses,
    the checkpoint folder, a scratch folder). Two ranks of DP2 compute the same losses however
    they are launched, so this is also the reference of the single-node restart test."""
    tmp = tmp_path_factory.mktemp('two_nodes')
    ckpt = str(tmp / 'ckpt')
    text = _two_nodes(tmp, 'first', TRAIN + ['--save', ckpt], corpus)
    assert 'using world size: 2, data-parallel size: 2' in text
    reference = losses(text)
    assert sorted(reference) == list(range(1, 13)), text[-3000:]
    assert open(os.path.join(ckpt, 'latest_checkpointed_iteration.txt')).read() == '12'
    return reference, ckpt, tmp, corpus


def test_max_restarts_resumes_with_uninterrupted_losses(tmp_path, two_node_reference):
    reference, corpus = two_node_reference[0], two_node_reference[3]
    ckpt = str(tmp_path / 'ckpt')
    run = Launcher(
        _standalone(2, free_port(), '--max-restarts', '1'),
        TRAIN + ['--save', ckpt, '--load', ckpt],
        str(tmp_path / 'run.log'),
        data_args=corpus,
    )
    try:
        run.wait_for(r'successfully saved checkpoint from iteration +6 ', 300)
        os.kill(run.worker_pid(1), signal.SIGKILL)
        assert run.wait(500) == 0, run.output()[-3000:]
    finally:
        run.kill()
    text = run.output()
    resumed = [
        int(i)
        for i in re.findall(
            r'successfully loaded checkpoint from .* at iteration '
            r'(\d+)',
            text,
        )
    ]
    assert resumed and resumed[0] >= 6 and resumed[0] % 3 == 0, text[-3000:]
    after = text[text.index('successfully loaded checkpoint') :]
    got = losses(after)
    assert sorted(got) == list(range(resumed[0] + 1, 13))
    for it, loss in got.items():
        assert loss == reference[it], (it, loss, reference[it])
    assert open(os.path.join(ckpt, 'latest_checkpointed_iteration.txt')).read() == '12'


def test_two_nodes_on_one_machine_train_and_resume(two_node_reference):
    """The two-node job resumes from its iteration-6 checkpoint, on two nodes again, with the
    uninterrupted losses."""
    reference, ckpt, tmp, corpus = two_node_reference
    second = _two_nodes(tmp, 'second', TRAIN + ['--load', ckpt, '--ckpt-step', '6'], corpus)
    assert re.search(r'successfully loaded checkpoint from .* at iteration 6', second)
    got = losses(second)
    assert sorted(got) == list(range(7, 13))
    for it, loss in got.items():
        assert loss == reference[it], (it, loss, reference[it])
