"""Pieces shared by the checkpoint plugins: the queue protocol and progress/memory lines."""

import os
import queue as queue_module
import resource
import sys
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
_REPO = os.path.dirname(os.path.dirname(_HERE))

_SAVER_PROCESS = None
_LOADER_PID = None
#: Seconds between the saver's checks that its loader still runs while it waits for a message.
LOADER_POLL_S = 2.0


class SaverExited(RuntimeError):
    """The saver process ended while the loader still had messages to send."""


def add_megatron_path(megatron_path=None) -> None:
    """Make `megatron` importable: --megatron-path first, else this repository."""
    for path in (_REPO, megatron_path):
        if path and path not in sys.path:
            sys.path.insert(0, path)


def check_save_dir(save_dir) -> None:
    """--save-dir is a directory that can be created and written (ValueError, one line)."""
    existing = save_dir
    while existing and not os.path.exists(existing):
        existing = os.path.dirname(existing.rstrip(os.sep)) or '.'
    if existing != save_dir and not os.path.isdir(existing):
        raise ValueError(f'--save-dir {save_dir}: {existing} is a file, not a directory')
    if existing == save_dir and not os.path.isdir(save_dir):
        raise ValueError(f'--save-dir {save_dir} is a file, not a directory')
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f'--save-dir {save_dir}: {existing} is not writable')


def set_saver_process(process) -> None:
    """Let `queue_put` notice a saver that died (instead of blocking on a full queue forever)."""
    global _SAVER_PROCESS
    _SAVER_PROCESS = process


def queue_put(queue, name, msg=None) -> None:
    """Send one named message ("sending <name>"); msg None sends the bare string `name`."""
    if msg is None:
        item = name
    else:
        print(f'sending {name}', flush=True)
        msg['name'] = name
        item = msg
    while True:
        try:
            queue.put(item, timeout=1.0)
            return
        except queue_module.Full:
            if _SAVER_PROCESS is not None and not _SAVER_PROCESS.is_alive():
                raise SaverExited(
                    f'the saver exited (code {_SAVER_PROCESS.exitcode}) before receiving "{name}"'
                )


def run_loader(queue, body, args) -> None:
    """Run a loader body; on any failure tell the saver ("exit") and re-raise."""
    try:
        body(queue, args)
    except BaseException:
        try:
            queue.put('exit', timeout=5.0)
        except queue_module.Full:
            pass
        raise


def set_loader_pid(pid) -> None:
    """The loader's (convert.py's own) process id, inherited by the forked saver, so that a saver
    whose loader was killed (SIGKILL, out of memory: no "exit" is ever sent) stops waiting."""
    global _LOADER_PID
    _LOADER_PID = pid


def _loader_gone() -> bool:
    # A forked child is re-parented when its parent dies.
    return _LOADER_PID is not None and os.getppid() != _LOADER_PID


def queue_get(queue, name=None, checking=True):
    """Receive the next message ("received <name>"); exit(1) on "exit", on a wrong name, or
    when the loader process is gone."""
    while True:
        try:
            val = queue.get(timeout=LOADER_POLL_S)
            break
        except queue_module.Empty:
            if _loader_gone():
                print(f'Loader process {_LOADER_PID} is gone, exiting saver', flush=True)
                sys.exit(1)
    if val == 'exit':
        print('Loader exited, exiting saver')
        sys.exit(1)
    if name is not None and checking and not isinstance(val, str) and val['name'] != name:
        got = val['name']
        print(f'Unexpected message. Expecting "{name}" but got "{got}". Exiting saver.')
        sys.exit(1)
    if name is not None and not isinstance(val, str):
        print(f'received {name}', flush=True)
    return val


def send_whole_model(queue, md, name, state_dict) -> None:
    """The short protocol of one-message models (vision encoders, LLaVA): the metadata, one
    message `name` holding the whole (TP = 1) state dict, then "done"."""
    queue.put(md)
    queue_put(queue, name, {'state dict': state_dict})
    queue_put(queue, 'done')


def receive_whole_model(queue, name, checking=True):
    """The saver's side of `send_whole_model` (after the metadata): the state dict."""
    msg = queue_get(queue, name, checking)
    state_dict = msg.pop('state dict')
    check_message(msg, checking)
    end = queue_get(queue, None, checking)
    if end != 'done':
        print(f'ERROR: got some more data but was expecting to be done ({end["name"]})')
        sys.exit(1)
    return state_dict


def check_message(msg, checking=True) -> None:
    """Exit(1) when a message still holds keys the saver did not use (unless --no-checking)."""
    if not checking:
        return
    leftover = [k for k in msg if k != 'name']
    if leftover:
        print(f'Unexpected values in {msg["name"]}:')
        for key in leftover:
            print(f'   {key}')
        print('Exiting. If you want to ignore this, use the argument --no-checking.')
        sys.exit(1)


def print_memory_usage(key, rank, num_ranks) -> None:
    """'> memory usage: '<key>', rank r / n, mem X/Y gb.' (peak RSS; estimated total)."""
    peak_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2
    print(
        f"> memory usage: '{key}', rank {rank} / {num_ranks}, "
        f"mem {peak_gb:.1f}/{peak_gb * num_ranks:.1f} gb.",
        flush=True,
    )


class Progress:
    """One line per step with the elapsed time: 'saver: layer 3/24 (12.5s)'."""

    def __init__(self, who, total):
        self.who, self.total, self.done, self.start = who, total, 0, time.time()

    def step(self, what):
        self.done += 1
        print(
            f'{self.who}: {what} {self.done}/{self.total} ({time.time() - self.start:.1f}s)',
            flush=True,
        )
