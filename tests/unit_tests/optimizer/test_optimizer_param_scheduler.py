"""OptimizerParamScheduler against closed-form schedules written from Megatron's
megatron/core/optimizer_param_scheduler.py."""

import math

import pytest
import torch

from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

MAX_LR, MIN_LR, INIT_LR = 1.0e-3, 1.0e-5, 1.0e-4
W, D = 100, 1000  # warmup and decay steps (samples)


def _optimizer():
    p1 = torch.nn.Parameter(torch.zeros(2))
    p2 = torch.nn.Parameter(torch.zeros(2))
    return torch.optim.SGD(
        [
            {'params': [p1], 'wd_mult': 1.0, 'lr_mult': 1.0},
            {'params': [p2], 'wd_mult': 0.0, 'lr_mult': 0.5},
        ],
        lr=0.0,
    )


def _scheduler(style, warmup=W, **kwargs):
    args = dict(
        init_lr=INIT_LR,
        max_lr=MAX_LR,
        min_lr=MIN_LR,
        lr_warmup_steps=warmup,
        lr_decay_steps=D,
        lr_decay_style=style,
        start_wd=0.1,
        end_wd=0.1,
        wd_incr_steps=D,
        wd_incr_style='constant',
    )
    args.update(kwargs)
    return OptimizerParamScheduler(_optimizer(), **args)


def _expected_lr(style, n, warmup=W, wsd_steps=None, wsd_style=None):
    """The closed-form learning rate, written independently of the implementation."""
    if warmup > 0 and n <= warmup:
        return INIT_LR + (MAX_LR - INIT_LR) * n / warmup
    if style == 'constant':
        return MAX_LR
    if n > D:
        return MIN_LR
    if style == 'inverse-square-root':
        return max(MIN_LR, MAX_LR * math.sqrt(max(warmup, 1)) / math.sqrt(max(n, 1)))
    r = (n - warmup) / (D - warmup)
    if style == 'linear':
        coeff = 1 - r
    elif style == 'cosine':
        coeff = 0.5 * (math.cos(math.pi * r) + 1)
    else:  # WSD
        anneal_start = D - wsd_steps
        if n <= anneal_start:
            coeff = 1.0
        else:
            q = (n - anneal_start) / wsd_steps
            coeff = {
                'linear': 1 - q,
                'cosine': 0.5 * (math.cos(math.pi * q) + 1),
                'exponential': 2 * 0.5**q - 1,
            }[wsd_style]
    return MIN_LR + coeff * (MAX_LR - MIN_LR)


STEPS = [0, 1, 50, 100, 101, 250, 550, 900, 999, 1000, 1001, 5000]


@pytest.mark.parametrize('style', ['constant', 'linear', 'cosine', 'inverse-square-root'])
def test_lr_decay_styles_match_closed_form(style):
    sched = _scheduler(style)
    done = 0
    for n in STEPS:
        sched.step(n - done)
        done = n
        expected = _expected_lr(style, n)
        groups = sched.optimizer.param_groups
        assert groups[0]['lr'] == pytest.approx(expected, rel=1e-12, abs=0)
        assert groups[1]['lr'] == pytest.approx(0.5 * expected, rel=1e-12, abs=0)  # lr_mult


@pytest.mark.parametrize('wsd_style', ['linear', 'cosine', 'exponential'])
def test_wsd_schedule(wsd_style):
    sched = _scheduler('WSD', wsd_decay_steps=300, lr_wsd_decay_style=wsd_style)
    done = 0
    for n in STEPS + [700, 701, 850]:
        if n < done:
            continue
        sched.step(n - done)
        done = n
        expected = _expected_lr('WSD', n, wsd_steps=300, wsd_style=wsd_style)
        assert sched.optimizer.param_groups[0]['lr'] == pytest.approx(expected, rel=1e-12, abs=0)


def test_no_warmup_inverse_square_root_and_group_max_lr():
    sched = _scheduler('inverse-square-root', warmup=0)
    sched.step(400)
    assert sched.optimizer.param_groups[0]['lr'] == pytest.approx(
        MAX_LR / math.sqrt(400), rel=1e-12
    )
    # A group with its own max_lr/min_lr (decoupled lr) uses them.
    sched = _scheduler('linear')
    sched.optimizer.param_groups[1]['max_lr'] = 2e-3
    sched.optimizer.param_groups[1]['min_lr'] = 0.0
    sched.step(550)
    assert sched.optimizer.param_groups[1]['lr'] == pytest.approx(
        0.5 * (2e-3 * (1 - 450 / 900)), rel=1e-12
    )


@pytest.mark.parametrize('wd_style', ['linear', 'cosine'])
def test_weight_decay_increment(wd_style):
    sched = _scheduler(
        'linear', start_wd=0.01, end_wd=0.1, wd_incr_steps=800, wd_incr_style=wd_style
    )
    done = 0
    for n in [0, 200, 400, 800, 801, 2000]:
        sched.step(n - done)
        done = n
        if n > 800:
            expected = 0.1
        else:
            r = n / 800
            coeff = r if wd_style == 'linear' else 0.5 * (math.cos(math.pi * (1 - r)) + 1)
            expected = 0.01 + coeff * (0.1 - 0.01)
        assert sched.optimizer.param_groups[0]['weight_decay'] == pytest.approx(expected, rel=1e-12)
        assert sched.optimizer.param_groups[1]['weight_decay'] == 0.0  # wd_mult 0


def test_state_dict_round_trip_and_checkpoint_semantics():
    sched = _scheduler('cosine', start_wd=0.01, end_wd=0.1, wd_incr_style='linear')
    sched.step(333)
    sd = sched.state_dict()
    assert set(sd) == {
        'max_lr',
        'lr_warmup_steps',
        'num_steps',
        'lr_decay_style',
        'lr_decay_steps',
        'min_lr',
        'start_wd',
        'end_wd',
        'wd_incr_style',
        'wd_incr_steps',
    }
    # use_checkpoint (default): a fresh scheduler with other values takes the checkpoint's.
    other = _scheduler('linear', max_lr=5e-3, start_wd=0.0, end_wd=0.0)
    other.load_state_dict(sd)
    assert other.state_dict() == sd
    assert other.optimizer.param_groups[0]['lr'] == sched.optimizer.param_groups[0]['lr']
    assert other.optimizer.param_groups[0]['weight_decay'] == pytest.approx(
        sched.optimizer.param_groups[0]['weight_decay']
    )
    # override: keeps its own values, but takes num_steps.
    mine = _scheduler(
        'linear', override_opt_param_scheduler=True, use_checkpoint_opt_param_scheduler=False
    )
    mine.load_state_dict(sd)
    assert mine.lr_decay_style == 'linear' and mine.num_steps == 333
    assert mine.optimizer.param_groups[0]['lr'] == pytest.approx(
        _expected_lr('linear', 333), rel=1e-12
    )
    # Neither: values must agree.
    strict = _scheduler('linear', use_checkpoint_opt_param_scheduler=False)
    with pytest.raises(ValueError, match='learning rate decay style'):
        strict.load_state_dict(sd)
    # Old key names are accepted.
    old = dict(sd)
    old['start_lr'] = old.pop('max_lr')
    old['num_iters'] = old.pop('num_steps')
    again = _scheduler('cosine', start_wd=0.01, end_wd=0.1, wd_incr_style='linear')
    again.load_state_dict(old)
    assert again.num_steps == 333


def test_invalid_arguments_raise_value_error():
    with pytest.raises(ValueError, match='warmup'):
        _scheduler('linear', warmup=D)
    with pytest.raises(ValueError, match='min_lr'):
        _scheduler('linear', min_lr=2e-3)
    with pytest.raises(ValueError, match='lr_decay_style'):
        _scheduler('exp')
    with pytest.raises(ValueError, match='wsd_decay_steps'):
        _scheduler('WSD', lr_wsd_decay_style='linear')
    with pytest.raises(ValueError, match='both override'):
        _scheduler('linear', override_opt_param_scheduler=True)
