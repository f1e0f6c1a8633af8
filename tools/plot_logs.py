"""Plot loss curves and throughput of one or several training runs, or compare two runs' losses.

A run is a TensorBoard directory or event file (--tensorboard-dir), or a saved training log (the
`iteration ... | lm loss: ... |` lines that pretrain_*.py print, e.g. `torchrun ... | tee
train.log`).

    # losses (training lines, validation markers) and throughput of several runs, overlaid:
    python tools/plot_logs.py runs/a/tb runs/b/train.log --output curves.png
    # regression check: exit 1 when a loss differs by more than atol + rtol * |a|:
    python tools/plot_logs.py --compare runs/a/tb runs/b/tb --rtol 1e-3

Throughput is samples/s from the elapsed time per iteration and the global batch size (tokens/s
with --seq-length). A log line holds the mean over its --log-interval, TensorBoard the value of
each iteration: compare like with like (or log with --log-interval 1). matplotlib is needed for
plots only: `pip install -e .[plot]`.
"""

import argparse
import glob
import math
import os
import re
import sys
from dataclasses import dataclass, field
from typing import Dict, Optional


@dataclass
class Run:
    """The series of one run: {loss key: {iteration: value}}, validation likewise, and per
    iteration the seconds per iteration and the global batch size (when logged)."""

    label: str
    losses: Dict[str, Dict[int, float]] = field(default_factory=dict)
    validation: Dict[str, Dict[int, float]] = field(default_factory=dict)
    seconds_per_iteration: Dict[int, float] = field(default_factory=dict)
    batch_size: Dict[int, float] = field(default_factory=dict)

    def samples_per_second(self) -> Dict[int, float]:
        return {
            it: self.batch_size[it] / sec
            for it, sec in self.seconds_per_iteration.items()
            if it in self.batch_size and sec > 0
        }


_ITERATION = re.compile(r'\biteration\s+(\d+)/\s*\d+\s*\|')
_VALIDATION = re.compile(
    r'validation loss at iteration (\d+)(?: on \d+-sample draw from (\w+) set)?'
)


def _fields(line):
    """{'key': 'value'} of the ` key: value |` fields of a log line."""
    out = {}
    for part in line.split('|'):
        key, sep, value = part.rpartition(': ')
        if sep:
            out[key.strip()] = value.strip()
    return out


def read_training_log(path: str, label: Optional[str] = None) -> Run:
    """A Run from the lines pretrain_*.py print (training and validation lines)."""
    run = Run(label or path)
    with open(path, errors='replace') as f:
        for line in f:
            match = _ITERATION.search(line)
            if match:
                it = int(match.group(1))
                fields = _fields(line[match.end() - 1 :])
                for key, value in fields.items():
                    if key.endswith('loss') and key != 'loss scale':
                        run.losses.setdefault(key, {})[it] = float(value)
                if 'elapsed time per iteration (ms)' in fields:
                    run.seconds_per_iteration[it] = (
                        float(fields['elapsed time per iteration (ms)']) / 1000.0
                    )
                if 'global batch size' in fields:
                    run.batch_size[it] = float(fields['global batch size'])
                continue
            match = _VALIDATION.search(line)
            if match and match.group(2) != 'test':
                it = int(match.group(1))
                for key, value in _fields(line[match.end() :]).items():
                    if key.endswith(' value'):
                        run.validation.setdefault(key[: -len(' value')], {})[it] = float(value)
    return run


def read_tensorboard(path: str, label: Optional[str] = None) -> Run:
    """A Run from the scalars training wrote with --tensorboard-dir (a directory or event file)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(path, size_guidance={'scalars': 0})
    acc.Reload()
    run = Run(label or path)
    for tag in acc.Tags()['scalars']:
        if tag.endswith(' vs samples'):
            continue
        values = {}
        for event in acc.Scalars(tag):
            # First value per step: after training, the test-set loss is written under the same
            # '<key> validation' tag and step as the final validation loss (as Megatron does).
            values.setdefault(event.step, event.value)
        if tag.endswith(' validation') and tag[: -len(' validation')].endswith('loss'):
            run.validation[tag[: -len(' validation')]] = values
        elif tag.endswith('loss'):
            run.losses[tag] = values
        elif tag == 'iteration-time':
            run.seconds_per_iteration = values
        elif tag == 'batch-size':
            run.batch_size = values
    return run


def read_run(path: str, label: Optional[str] = None) -> Run:
    """A TensorBoard directory / event file, or a training log."""
    is_events = os.path.isdir(path) or 'tfevents' in os.path.basename(path)
    if os.path.isdir(path) and not glob.glob(
        os.path.join(path, '**', '*tfevents*'), recursive=True
    ):
        raise ValueError(f'{path}: a directory without TensorBoard event files')
    if not os.path.exists(path):
        raise ValueError(f'{path}: no such file or directory')
    run = read_tensorboard(path, label) if is_events else read_training_log(path, label)
    if not run.losses:
        raise ValueError(f'{path}: no training losses found')
    return run


def compare(run_a: Run, run_b: Run, rtol: float, atol: float):
    """(number of compared values, worst [key, iteration, a, b, excess]) of the losses both runs
    logged at the same iteration; excess > 0 means beyond atol + rtol * |a|."""
    compared, worst = 0, None
    for key in sorted(set(run_a.losses) & set(run_b.losses)):
        a, b = run_a.losses[key], run_b.losses[key]
        for it in sorted(set(a) & set(b)):
            compared += 1
            both_nan = math.isnan(a[it]) and math.isnan(b[it])
            diff = 0.0 if both_nan else abs(a[it] - b[it])
            if math.isnan(diff):
                diff = math.inf
            excess = diff - (atol + rtol * abs(a[it]))
            if worst is None or excess > worst[4]:
                worst = [key, it, a[it], b[it], excess]
    return compared, worst


def plot(runs, output: str, seq_length: Optional[int] = None, title: Optional[str] = None):
    """One PNG: losses of every run overlaid (left), throughput (right)."""
    try:
        import matplotlib
    except ImportError:
        raise SystemExit('error: plotting needs matplotlib: pip install matplotlib (or .[plot])')
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_tput) = plt.subplots(1, 2, figsize=(11, 4), dpi=100)
    colors = plt.rcParams['axes.prop_cycle'].by_key()['color']
    for i, run in enumerate(runs):
        color = colors[i % len(colors)]
        for j, (key, values) in enumerate(sorted(run.losses.items())):
            its = sorted(values)
            style = ['-', '--', ':'][j % 3]
            ax_loss.plot(
                its, [values[t] for t in its], style, color=color, label=f'{run.label}: {key}'
            )
        for key, values in sorted(run.validation.items()):
            its = sorted(values)
            ax_loss.plot(
                its, [values[t] for t in its], 'o', color=color, label=f'{run.label}: {key} (valid)'
            )
        rate = run.samples_per_second()
        if rate:
            its = sorted(rate)
            scale = seq_length or 1
            ax_tput.plot(its, [rate[t] * scale for t in its], '-', color=color, label=run.label)
    ax_loss.set_xlabel('iteration')
    ax_loss.set_ylabel('loss')
    ax_loss.legend(fontsize=7)
    ax_loss.grid(alpha=0.3)
    ax_tput.set_xlabel('iteration')
    ax_tput.set_ylabel('tokens/s' if seq_length else 'samples/s')
    ax_tput.set_title('throughput')
    ax_tput.grid(alpha=0.3)
    if ax_tput.lines:
        ax_tput.legend(fontsize=7)
    else:
        ax_tput.text(
            0.5, 0.5, 'no iteration times logged', ha='center', transform=ax_tput.transAxes
        )
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(output)
    plt.close(fig)


def get_args(argv=None):
    parser = argparse.ArgumentParser(
        description='Plot loss curves and throughput of training runs, or compare two runs.'
    )
    parser.add_argument('runs', nargs='*', help='TensorBoard dirs / event files or training logs')
    parser.add_argument('--labels', nargs='+', default=None, help='one label per run')
    parser.add_argument('--output', default='loss_curves.png', help='PNG to write')
    parser.add_argument('--title', default=None)
    parser.add_argument(
        '--seq-length', type=int, default=None, help='tokens per sample: throughput in tokens/s'
    )
    parser.add_argument(
        '--compare', nargs=2, metavar=('A', 'B'), help='compare the losses of run A and run B'
    )
    parser.add_argument('--rtol', type=float, default=0.0, help='relative tolerance (--compare)')
    parser.add_argument('--atol', type=float, default=0.0, help='absolute tolerance (--compare)')
    args = parser.parse_args(argv)
    if not args.compare and not args.runs:
        parser.error('give at least one run, or --compare A B')
    if args.compare and args.runs:
        parser.error(
            f'--compare takes exactly two runs; {len(args.runs)} more given '
            f'({" ".join(args.runs)}): compare them two at a time'
        )
    for name in ('rtol', 'atol'):
        value = getattr(args, name)
        if not math.isfinite(value) or value < 0:
            parser.error(f'--{name} must be a finite number >= 0, got {value}')
    if args.labels and len(args.labels) != len(args.runs):
        parser.error(f'--labels: {len(args.labels)} labels for {len(args.runs)} runs')
    if not args.compare:
        directory = os.path.dirname(os.path.abspath(args.output))
        if not os.path.isdir(directory):
            parser.error(f'--output {args.output}: directory {directory} does not exist')
    return args


def main(argv=None) -> int:
    args = get_args(argv)
    try:
        if args.compare:
            run_a, run_b = (read_run(path) for path in args.compare)
            compared, worst = compare(run_a, run_b, args.rtol, args.atol)
            if compared == 0:
                print('error: the two runs share no (loss, iteration)', file=sys.stderr)
                return 2
            key, it, a, b, excess = worst
            verdict = 'DIFFER' if excess > 0 else 'match'
            print(
                f'{verdict}: {compared} values compared (rtol {args.rtol}, atol {args.atol}); '
                f'largest difference: {key} at iteration {it}: {a!r} vs {b!r}'
            )
            return 1 if excess > 0 else 0
        labels = args.labels or [None] * len(args.runs)
        runs = [read_run(path, label) for path, label in zip(args.runs, labels)]
    except ValueError as exc:
        print(f'error: {exc}', file=sys.stderr)
        return 2
    plot(runs, args.output, args.seq_length, args.title)
    print(f'wrote {args.output} ({len(runs)} run(s))')
    return 0


if __name__ == '__main__':
    sys.exit(main())
