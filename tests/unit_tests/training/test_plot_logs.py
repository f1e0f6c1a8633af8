"""tools/plot_logs.py: reads training logs (the lines `format_log_line` / the validation print
produce) and TensorBoard event files, plots several runs into one PNG, and its --compare mode
exits non-zero when two runs' losses differ beyond the tolerance."""

import os
from datetime import datetime

import pytest

from megatron.training.logging.training_log import format_log_line
from megatron.training.loop.evaluation import format_validation_line
from tools import plot_logs

LOSSES = {1: 10.5, 2: 9.75, 3: 9.125, 4: 8.5}


def _write_log(path, losses, ms=250.0, extra_key=None):
    """A training log as pretrain_gpt.py prints it (with noise lines around)."""
    lines = ['> building GPT model ...', 'training ...']
    for it, loss in losses.items():
        keys = {'lm loss': loss}
        if extra_key:
            keys[extra_key] = loss / 10
        lines.append(
            format_log_line(
                it, len(losses), 8 * it, ms, 1e-3, 8, keys, 1.0, grad_norm=1.5,
                timestamp=datetime(2024, 1, 1),
            )
        )  # fmt: skip
        if it == 2:
            lines.append(format_validation_line('iteration 2', {'lm loss': loss + 0.25}))
    lines.append(
        format_validation_line('iteration 4 on 32-sample draw from test set', {'lm loss': 1.0})
    )
    path.write_text('\n'.join(lines) + '\n')
    return str(path)


def _write_tensorboard(directory, losses):
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(log_dir=str(directory))
    for it, loss in losses.items():
        writer.add_scalar('lm loss', loss, it)
        writer.add_scalar('lm loss vs samples', loss, it * 8)
        writer.add_scalar('iteration-time', 0.5, it)
        writer.add_scalar('batch-size', 8, it)
    writer.add_scalar('lm loss validation', 9.0, 2)
    writer.close()
    return str(directory)


def test_reads_training_log_and_tensorboard(tmp_path):
    log = plot_logs.read_run(_write_log(tmp_path / 'train.log', LOSSES, extra_key='sop loss'))
    assert log.losses['lm loss'] == LOSSES
    assert log.losses['sop loss'] == pytest.approx({k: v / 10 for k, v in LOSSES.items()})
    assert log.validation == {'lm loss': {2: 10.0}}  # the test-set line is not validation
    assert log.samples_per_second() == {it: 8 / 0.25 for it in LOSSES}
    tb = plot_logs.read_run(_write_tensorboard(tmp_path / 'tb', LOSSES))
    assert tb.losses == {'lm loss': LOSSES}
    assert tb.validation == {'lm loss': {2: 9.0}}
    assert tb.samples_per_second() == {it: 16.0 for it in LOSSES}


def test_plot_writes_one_png_for_several_runs(tmp_path):
    pytest.importorskip('matplotlib')
    a = _write_log(tmp_path / 'a.log', LOSSES)
    b = _write_tensorboard(tmp_path / 'tb', {k: v + 0.5 for k, v in LOSSES.items()})
    out = tmp_path / 'curves.png'
    code = plot_logs.main(
        [a, b, '--labels', 'log', 'tb', '--output', str(out), '--seq-length', '64']
    )
    assert code == 0
    data = out.read_bytes()
    assert data[:8] == b'\x89PNG\r\n\x1a\n' and len(data) > 10_000


def test_compare_exit_codes(tmp_path, capsys):
    a = _write_log(tmp_path / 'a.log', LOSSES)
    same = _write_tensorboard(tmp_path / 'same', LOSSES)
    off = {**LOSSES, 3: LOSSES[3] * (1 + 2e-3)}
    drifted = _write_log(tmp_path / 'drifted.log', off)
    assert plot_logs.main(['--compare', a, same]) == 0  # log vs TensorBoard, exact
    assert 'match: 4 values compared' in capsys.readouterr().out
    assert plot_logs.main(['--compare', a, drifted, '--rtol', '1e-3']) == 1
    out = capsys.readouterr().out
    assert out.startswith('DIFFER') and 'lm loss at iteration 3' in out
    assert plot_logs.main(['--compare', a, drifted, '--rtol', '3e-3']) == 0
    other = _write_log(tmp_path / 'other.log', {10: 1.0})
    assert plot_logs.main(['--compare', a, other]) == 2
    assert plot_logs.main(['--compare', a, str(tmp_path / 'missing.log')]) == 2
    assert 'no such file' in capsys.readouterr().err


def test_readme_picture_exists():
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    readme = open(os.path.join(root, 'README.md')).read()
    assert '](docs/images/quickstart_loss.png)' in readme
    png = open(os.path.join(root, 'docs', 'images', 'quickstart_loss.png'), 'rb').read()
    assert png[:8] == b'\x89PNG\r\n\x1a\n' and len(png) < 200_000


@pytest.mark.parametrize(
    'extra,message',
    [
        (['--rtol', 'nan'], '--rtol must be a finite number >= 0, got nan'),
        (['--atol', 'inf'], '--atol must be a finite number >= 0, got inf'),
        (['--atol=-1e-3'], '--atol must be a finite number >= 0, got -0.001'),
    ],
)
def test_compare_tolerances_must_be_finite_and_non_negative(tmp_path, capsys, extra, message):
    a = _write_log(tmp_path / 'a.log', LOSSES)
    far = _write_log(tmp_path / 'far.log', {it: v + 80 for it, v in LOSSES.items()})
    with pytest.raises(SystemExit) as info:
        plot_logs.main(['--compare', a, far] + extra)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_compare_third_run_and_output_directory_refused(tmp_path, capsys):
    a = _write_log(tmp_path / 'a.log', LOSSES)
    with pytest.raises(SystemExit) as info:
        plot_logs.main(['--compare', a, a, a])
    assert info.value.code == 2
    assert '--compare takes exactly two runs; 1 more given' in capsys.readouterr().err
    missing = tmp_path / 'nowhere' / 'curves.png'
    with pytest.raises(SystemExit) as info:
        plot_logs.main([a, '--output', str(missing)])
    assert info.value.code == 2
    assert f'directory {missing.parent} does not exist' in capsys.readouterr().err
