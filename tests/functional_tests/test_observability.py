"""Observability flags end to end: one tiny GPT run on two data-parallel gloo ranks with every
logging flag of Megatron core_r0.8.0 set, W&B in offline mode and the torch profiler on one
iteration; then what each flag must have produced is read back from disk: the TensorBoard event
file, the W&B run file, the Chrome trace and progress.txt. Plus the start-up errors of the flags.
"""

import glob
import json
import os
import re
import struct
import sys
import time

import pytest

from tests.functional_tests.gpt_utils import REPO
from tests.unit_tests.dist_utils import run_distributed

TRAIN_ITERS = 3

RUN_ARGS = [
    '--num-layers', '2', '--hidden-size', '32', '--num-attention-heads', '4',
    '--seq-length', '16', '--max-position-embeddings', '16', '--micro-batch-size', '1',
    '--global-batch-size', '4', '--train-iters', str(TRAIN_ITERS), '--lr', '1e-3', '--mock-data',
    '--tokenizer-type', 'NullTokenizer', '--vocab-size', '4095', '--eval-iters', '1',
    '--eval-interval', '2', '--log-interval', '1', '--num-workers', '0',
    '--distributed-backend', 'gloo', '--transformer-impl', 'local',
    '--save-interval', '2',
    # Every logging flag of r0.8's logging group that changes what is written.
    '--log-params-norm', '--log-num-zeros-in-grad', '--log-throughput', '--log-progress',
    '--timing-log-level', '2', '--log-timers-to-tensorboard', '--log-batch-size-to-tensorboard',
    '--log-validation-ppl-to-tensorboard', '--log-memory-to-tensorboard',
    '--log-world-size-to-tensorboard',
]  # fmt: skip
# Iteration index 1 (the log's iteration 2) on rank 0, through torch.profiler.
PROFILE_ARGS = [
    '--profile', '--use-pytorch-profiler', '--profile-step-start', '1', '--profile-step-end', '2',
    '--profile-ranks', '0',
]  # fmt: skip


def _pretrain_worker(argv):
    if REPO not in sys.path:
        sys.path.insert(0, REPO)
    import pretrain_gpt
    from megatron.core.enums import ModelType
    from megatron.training.global_vars import destroy_global_vars
    from megatron.training.training import pretrain

    saved = {k: os.environ.get(k) for k in ('WANDB_MODE', 'WANDB_SILENT')}
    os.environ.update(WANDB_MODE='offline', WANDB_SILENT='true')
    destroy_global_vars()
    try:
        result = pretrain(
            pretrain_gpt.train_valid_test_datasets_provider,
            pretrain_gpt.model_provider,
            ModelType.encoder_or_decoder,
            pretrain_gpt.forward_step,
            args_list=argv,
        )
    finally:
        destroy_global_vars()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    return {it: v['lm loss'] for it, v in result['train_losses'].items()}


def _tensorboard_scalars(path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(path, size_guidance={'scalars': 0})
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()['scalars']}


def _wandb_records(run_file):
    """(history rows, run record) of an offline W&B run file (a LevelDB-style log of protobuf
    records: a 7-byte header, 32 KiB blocks of chunks with a 7-byte header each). The file is
    complete once its `exit` record is there (W&B's service may still be writing it for a moment
    after `wandb.finish()` returns on a loaded machine)."""
    from wandb.proto import wandb_internal_pb2

    deadline = time.time() + 30
    while True:
        records = _wandb_raw_records(open(run_file, 'rb').read())
        kinds = []
        for raw in records:
            record = wandb_internal_pb2.Record()
            record.ParseFromString(raw)
            kinds.append(record.WhichOneof('record_type'))
        if 'exit' in kinds or time.time() > deadline:
            break
        time.sleep(0.5)
    history, run = [], None
    for raw in records:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        if record.WhichOneof('record_type') == 'history':
            history.append(
                {
                    (i.key or '/'.join(i.nested_key)): json.loads(i.value_json)
                    for i in record.history.item
                }
            )
        elif record.WhichOneof('record_type') == 'run':
            run = record.run
    assert run is not None, f'no run record in {run_file}: {kinds}'
    return history, run


def _wandb_raw_records(data):
    """The records of a LevelDB-style log (chunk types: 1 full, 2 first, 3 middle, 4 last)."""
    pos, pending, records = 7, b'', []
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack('<IHB', data[pos : pos + 7])
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last chunk of one
            records.append(pending)
            pending = b''
    return records


@pytest.fixture(scope='module')
def logged_run(tmp_path_factory):
    pytest.importorskip('wandb')
    root = tmp_path_factory.mktemp('observability')
    argv = RUN_ARGS + PROFILE_ARGS + [
        '--tensorboard-dir', str(root / 'tb'), '--save', str(root / 'ckpt'),
        '--wandb-project', 'megatron-test', '--wandb-exp-name', 'tiny-gpt',
        '--wandb-save-dir', str(root / 'wandb'),
    ]  # fmt: skip
    outs = run_distributed(_pretrain_worker, world_size=2, args=(argv,), timeout=300)
    return root, outs[-1]


def test_tensorboard_gets_every_logging_flag(logged_run):
    root, losses = logged_run
    scalars = _tensorboard_scalars(str(root / 'tb'))
    assert sorted(scalars['lm loss']) == [1, 2, 3]
    for it, loss in losses.items():
        assert scalars['lm loss'][it] == pytest.approx(loss, rel=1e-6)
    expected = {
        'learning-rate',  # on unless --no-log-learnig-rate-to-tensorboard
        'loss-scale',  # on unless --no-log-loss-scale-to-tensorboard
        'batch-size',  # --log-batch-size-to-tensorboard
        'world-size',  # --log-world-size-to-tensorboard
        'grad-norm',
        'num-zeros',  # --log-num-zeros-in-grad
        'params-norm',  # --log-params-norm
        'iteration-time',  # --log-timers-to-tensorboard
        'throughput',  # --log-throughput with --log-timers-to-tensorboard
        'forward-backward-time',  # --log-timers-to-tensorboard: the timers
        'lm loss validation',
        'lm loss validation ppl',  # --log-validation-ppl-to-tensorboard
        'mem-rss-bytes',  # --log-memory-to-tensorboard (CPU run: the resident set)
    }
    assert expected <= set(scalars), sorted(expected - set(scalars))
    assert set(scalars['world-size'].values()) == {2.0}
    assert set(scalars['batch-size'].values()) == {4.0}
    assert all(v > 0 for v in scalars['mem-rss-bytes'].values())
    assert all(v >= 0 for v in scalars['num-zeros'].values())


def test_wandb_offline_run_gets_the_same_scalars(logged_run):
    root, losses = logged_run
    runs = glob.glob(str(root / 'wandb' / 'wandb' / 'offline-run-*' / 'run-*.wandb'))
    assert len(runs) == 1, runs  # the last rank only
    history, run = _wandb_records(runs[0])
    assert run.project == 'megatron-test' and run.display_name == 'tiny-gpt'
    by_step = {}
    for row in history:
        by_step.setdefault(row['_step'], {}).update(row)
    for it, loss in losses.items():
        assert by_step[it]['lm loss'] == pytest.approx(loss, rel=1e-6)
        for key in ('learning-rate', 'grad-norm', 'params-norm', 'num-zeros', 'iteration-time'):
            assert key in by_step[it], (it, sorted(by_step[it]))
    assert 'lm loss validation' in by_step[2]
    assert not any(key.endswith(' vs samples') for row in history for key in row)


def test_profiler_trace_covers_the_window(logged_run):
    root, _ = logged_run
    traces = glob.glob(str(root / 'tb' / 'rank0.*.pt.trace.json'))
    assert len(traces) == 1, os.listdir(root / 'tb')  # --profile-ranks 0: rank 0 only
    events = json.load(open(traces[0]))['traceEvents']
    steps = {e['name'] for e in events if e.get('name', '').startswith('ProfilerStep#')}
    assert steps == {'ProfilerStep#1'}  # iteration index 1 only
    names = {e.get('name', '') for e in events}
    assert any(name.startswith('aten::') for name in names)  # the ops of the step


def test_progress_log(logged_run):
    root, _ = logged_run
    lines = open(root / 'ckpt' / 'progress.txt').read().splitlines()
    fields = [line.split('\t') for line in lines]
    assert [f[3] for f in fields] == ['Starting job', 'Saved checkpoint', 'Saved checkpoint']
    assert fields[0][2] == '# GPUs: 2'
    saved = fields[1]
    assert saved[4] == 'Iteration: 2'
    assert re.fullmatch(r'Job throughput: \d+\.\d TFLOP/s/GPU', saved[5])
    assert re.fullmatch(r'Cumulative throughput: \d+\.\d TFLOP/s/GPU', saved[6])
    assert float(saved[7].split(': ')[1]) > 0
    assert saved[8] == 'Tokens (in billions): 0.00'


def _validate(argv):
    from megatron.training.arguments import parse_args, validate_args

    args = parse_args(args_list=RUN_ARGS + argv)
    args.world_size, args.rank = 2, 0
    return validate_args(args, {})


@pytest.mark.parametrize(
    'argv, message',
    [
        (['--wandb-project', 'p', '--wandb-save-dir', '/tmp'], r'needs --wandb-exp-name'),
        (['--wandb-project', 'p', '--wandb-exp-name', 'e'], r'needs --wandb-save-dir, or --save'),
        (['--use-pytorch-profiler'], r'^--use-pytorch-profiler does nothing without --profile$'),
        (
            PROFILE_ARGS[:2] + ['--tensorboard-dir', '/tmp']
            + ['--profile-step-start', '3', '--profile-step-end', '3'],
            r'--profile-step-start \(3\) must be >= 0 and below --profile-step-end \(3\)',
        ),
        (
            PROFILE_ARGS[:2] + ['--tensorboard-dir', '/tmp', '--profile-ranks', '0', '2'],
            r'--profile-ranks \[2\] are not global ranks of this job \(world size 2\)',
        ),
        (['--profile', '--use-pytorch-profiler'], r'writes its trace to --tensorboard-dir'),
    ],
)  # fmt: skip
def test_flag_errors_before_any_work(argv, message):
    pytest.importorskip('wandb')
    with pytest.raises(ValueError, match=message) as err:
        _validate(argv)
    assert '\n' not in str(err.value)


def test_nsys_profile_needs_cuda():
    # RUN_ARGS runs on gloo, which is the CPU also on a GPU host.
    with pytest.raises(ValueError, match=r'needs a GPU \(and NCCL\); add --use-pytorch-profiler'):
        _validate(['--profile'])


def test_wandb_missing_is_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, 'wandb', None)  # as if not installed
    with pytest.raises(ValueError) as err:
        _validate(['--wandb-project', 'p', '--wandb-exp-name', 'e', '--wandb-save-dir', '/tmp'])
    assert str(err.value) == (
        '--wandb-project p needs the wandb package, which is not installed: pip install wandb '
        '(or pip install -e .[wandb])'
    )


def test_audit_table_names_every_logging_flag():
    from megatron.training.arguments import get_args_parser

    table = open(os.path.join(REPO, 'docs', 'observability.md')).read().split('## Audit')[1]
    audited = set(re.findall(r'`(--[a-z0-9-]+)`', table))
    parser = get_args_parser()
    logging_flags = {
        option
        for group in parser._action_groups
        if group.title in ('logging', 'one logger', 'straggler')
        for action in group._group_actions
        for option in action.option_strings
    }
    profile_flags = {'--profile', '--profile-step-start', '--profile-step-end', '--profile-ranks'}
    wanted = logging_flags | profile_flags | {'--use-pytorch-profiler', '--log-interval'}
    assert len(logging_flags) > 20
    assert wanted <= audited, sorted(wanted - audited)


def test_wandb_writer_needs_no_tensorboard():
    """Megatron writes W&B only inside its TensorBoard branch; here the scalar writer exists with
    W&B alone (the fan-out the run above exercises with both)."""
    wandb = pytest.importorskip('wandb')
    from megatron.training import global_vars
    from megatron.training.logging.scalar_writers import get_scalar_writer

    assert global_vars.get_tensorboard_writer() is None and get_scalar_writer() is None
    global_vars.set_wandb_writer(wandb)
    try:
        writer = get_scalar_writer()
        assert writer is not None and writer.tensorboard is None and writer.wandb is wandb
    finally:
        global_vars._GLOBAL_WANDB_WRITER = None
