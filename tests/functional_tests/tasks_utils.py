"""Shared pieces of the tasks/ end-to-end tests: run `tasks/main.py`'s main() inside a
`run_distributed` rank and read the numbers of Megatron's result lines."""

import contextlib
import io
import re
import sys

from tests.functional_tests.gpt_utils import REPO


def run_task(args_list):
    """tasks.main.main(args_list) on this rank; returns (its result, what this rank printed)."""
    if REPO not in sys.path:
        sys.path.insert(0, REPO)
    from megatron.training.global_vars import destroy_global_vars
    from tasks.main import main

    destroy_global_vars()
    buffer = io.StringIO()
    try:
        with contextlib.redirect_stdout(buffer):
            result = main(list(args_list))
    finally:
        destroy_global_vars()
    return result, buffer.getvalue()


def result_fields(line):
    """{'avg loss': 10.8, ...} from a ' validation results on TASK | k: v | ...' line."""
    fields = {}
    for part in line.split('|')[1:]:
        if ':' in part:
            key, value = part.split(':', 1)
            fields[key.strip()] = float(value)
    return fields


def accuracy_lines(stdout):
    """[(epoch, name, correct, total)] of every ' > |epoch: E| metrics for NAME: ...' line."""
    pattern = re.compile(
        r' > \|epoch: (-?\d+)\| metrics for (\S+): correct / total = (\d+) / (\d+) = '
    )
    return [(int(e), n, int(c), int(t)) for e, n, c, t in pattern.findall(stdout)]
