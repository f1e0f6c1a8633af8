"""Run pretrain_gpt.py under real `torchrun` launchers for the fault tests: start in a new
process group, follow the output, find workers by rank, and always kill the group at the end."""

import os
import re
import signal
import socket
import subprocess
import sys
import time

from tests.functional_tests.gpt_utils import MERGES, REPO, VOCAB

#: A tiny GPT (the data flags come with each launcher): start-up dominates, each iteration takes
#: milliseconds.
TINY = [
    '--num-layers',
    '2',
    '--hidden-size',
    '32',
    '--num-attention-heads',
    '4',
    '--seq-length',
    '16',
    '--max-position-embeddings',
    '16',
    '--micro-batch-size',
    '2',
    '--lr',
    '1e-3',
    '--vocab-file',
    VOCAB,
    '--merge-file',
    MERGES,
    '--make-vocab-size-divisible-by',
    '64',
    '--log-interval',
    '1',
    '--eval-iters',
    '1',
    '--eval-interval',
    '100000',
    '--seed',
    '1234',
    '--distributed-backend',
    'gloo',
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


class Launcher:
    """One `torchrun ... pretrain_gpt.py` process group whose output goes to `log_path`."""

    def __init__(self, torchrun_args, train_args, log_path, env=None, data_args=('--mock-data',)):
        """`data_args`: the data flags. Jobs that train should pass a small preprocessed corpus
        with a shared `--data-cache-path`: every worker is a fresh process, and mock data makes
        each of them shuffle the synthetic corpus's ~12M training samples anew (seconds)."""
        self.log_path = log_path
        cmd = [
            sys.executable,
            '-m',
            'torch.distributed.run',
            *torchrun_args,
            os.path.join(REPO, 'pretrain_gpt.py'),
            *TINY,
            *data_args,
            *train_args,
        ]
        full_env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS='1', **(env or {}))
        self.log = open(log_path, 'w')
        self.proc = subprocess.Popen(
            cmd,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=full_env,
            cwd=REPO,
            start_new_session=True,
        )

    def output(self) -> str:
        with open(self.log_path) as f:
            return f.read()

    def wait_for(self, pattern: str, timeout: float) -> str:
        """Block until `pattern` (regex) appears in the output; return the output."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            text = self.output()
            if re.search(pattern, text):
                return text
            if self.proc.poll() is not None:
                text = self.output()
                if re.search(pattern, text):
                    return text
                raise AssertionError(
                    f'launcher exited ({self.proc.returncode}) before {pattern!r}:\n{text[-3000:]}'
                )
            time.sleep(0.2)
        raise AssertionError(f'no {pattern!r} within {timeout} s:\n{self.output()[-3000:]}')

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f'launcher still running after {timeout} s:\n{self.output()[-3000:]}'
            ) from None

    def worker_pid(self, rank: int) -> int:
        """Pid of the worker with global rank `rank` among the launcher's children."""
        for pid in _children(self.proc.pid):
            try:
                with open(f'/proc/{pid}/environ', 'rb') as f:
                    env = f.read().split(b'\0')
            except OSError:
                continue
            if f'RANK={rank}'.encode() in env:
                return pid
        raise AssertionError(f'no worker with RANK={rank} under launcher {self.proc.pid}')

    def kill(self) -> None:
        """SIGKILL the workers (torchrun starts each in its own session) and the launcher's
        process group, then reap."""
        for pid in _children(self.proc.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            pass
        self.log.close()


def _children(pid: int):
    out = []
    for entry in os.listdir('/proc'):
        if not entry.isdigit():
            continue
        try:
            with open(f'/proc/{entry}/stat') as f:
                fields = f.read().rsplit(')', 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(entry))
    return out


def losses(text: str):
    """{iteration: lm loss} from the log (the last value seen for an iteration)."""
    out = {}
    for m in re.finditer(r'iteration +(\d+)/ *\d+ \|.*?lm loss: ([0-9.E+-]+) \|', text):
        out[int(m.group(1))] = float(m.group(2))
    return out
