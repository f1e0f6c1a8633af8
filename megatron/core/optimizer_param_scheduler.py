"""Learning-rate and weight-decay schedule (Megatron's OptimizerParamScheduler).

Steps are counted in samples (the training loop calls `step(increment=global_batch_size)` after
every successful optimizer step). With n = num_steps, W = lr_warmup_steps, D = lr_decay_steps:

- warmup (W > 0, n <= W): lr = init_lr + (max_lr - init_lr) * n / W;
- 'constant': max_lr; n > D: min_lr;
- 'inverse-square-root': max(min_lr, max_lr * sqrt(max(W, 1)) / sqrt(max(n, 1)));
- otherwise r = (n - W) / (D - W) and lr = min_lr + coeff * (max_lr - min_lr) with
  'linear' coeff = 1 - r, 'cosine' coeff = (cos(pi r) + 1) / 2, and 'WSD' (warmup-stable-decay)
  coeff = 1 until the last `wsd_decay_steps` of D, then linear / cosine / exponential
  (2 * 0.5^q - 1) in q, the fraction of those steps done.

Weight decay goes from start_wd to end_wd over wd_incr_steps ('constant', 'linear', 'cosine').
Each param group gets lr * group['lr_mult'] and wd * group['wd_mult']; a group may carry its own
'max_lr' / 'min_lr'.
"""

import logging
import math
from typing import Optional

logger = logging.getLogger(__name__)

_LR_DECAY_STYLES = ('constant', 'linear', 'cosine', 'inverse-square-root', 'WSD')
_WSD_DECAY_STYLES = ('linear', 'cosine', 'exponential')
_WD_INCR_STYLES = ('constant', 'linear', 'cosine')


class OptimizerParamScheduler:
    """Anneals the learning rate and weight decay of an optimizer's param groups.

    Args:
        optimizer: a MegatronOptimizer (or torch optimizer) whose `param_groups` are updated.
        init_lr: lr at step 0 of warmup (`--lr-warmup-init`).
        max_lr: peak lr (`--lr`).
        min_lr: final lr (`--min-lr`).
        lr_warmup_steps: warmup length in samples.
        lr_decay_steps: decay length in samples (warmup included).
        lr_decay_style: 'constant', 'linear', 'cosine', 'inverse-square-root' or 'WSD'.
        start_wd: weight decay at step 0 (`--start-weight-decay`).
        end_wd: weight decay at the end (`--end-weight-decay`).
        wd_incr_steps: weight-decay increment length in samples.
        wd_incr_style: 'constant', 'linear' or 'cosine'.
        use_checkpoint_opt_param_scheduler: on load, take values from the checkpoint.
        override_opt_param_scheduler: on load, keep this object's values (ignore the checkpoint).
        wsd_decay_steps: length of the WSD decay phase in samples.
        lr_wsd_decay_style: 'linear', 'cosine' or 'exponential' for the WSD decay phase.
    """

    def __init__(
        self,
        optimizer,
        init_lr: float,
        max_lr: float,
        min_lr: float,
        lr_warmup_steps: int,
        lr_decay_steps: int,
        lr_decay_style: str,
        start_wd: float,
        end_wd: float,
        wd_incr_steps: int,
        wd_incr_style: str,
        use_checkpoint_opt_param_scheduler: Optional[bool] = True,
        override_opt_param_scheduler: Optional[bool] = False,
        wsd_decay_steps: Optional[int] = None,
        lr_wsd_decay_style: Optional[str] = None,
    ) -> None:
        # Every check runs before any attribute is set, so a bad flag fails with nothing built.
        _check_lr_range(init_lr, float(max_lr), min_lr)
        _check_decay(lr_warmup_steps, lr_decay_steps, lr_decay_style)
        if lr_decay_style == 'WSD':
            _check_wsd(wsd_decay_steps, lr_decay_steps, lr_wsd_decay_style)
        _check_wd(start_wd, end_wd, wd_incr_style)
        if override_opt_param_scheduler and use_checkpoint_opt_param_scheduler:
            raise ValueError(
                'both override-opt_param-scheduler and use-checkpoint-opt_param-scheduler are set '
                '(--override-opt_param-scheduler, --use-checkpoint-opt_param-scheduler)'
            )

        self.optimizer = optimizer
        self.num_steps = 0
        self.init_lr, self.max_lr, self.min_lr = init_lr, float(max_lr), min_lr
        self.lr_warmup_steps, self.lr_decay_steps = lr_warmup_steps, lr_decay_steps
        self.lr_decay_style = lr_decay_style
        self.wsd_decay_steps, self.lr_wsd_decay_style = wsd_decay_steps, lr_wsd_decay_style
        self.start_wd, self.end_wd = start_wd, end_wd
        self.wd_incr_steps, self.wd_incr_style = wd_incr_steps, wd_incr_style
        self.override_opt_param_scheduler = override_opt_param_scheduler
        self.use_checkpoint_opt_param_scheduler = use_checkpoint_opt_param_scheduler

        # Param groups carry step-0 values from construction on, not only after the first step.
        self.step(0)
        logger.info('> learning rate decay style: %s', self.lr_decay_style)

    def get_wd(self) -> float:
        """Weight decay at the current step."""
        if self.num_steps > self.wd_incr_steps:
            return self.end_wd
        if self.wd_incr_style == 'constant':
            # A checkpoint may have replaced start/end since the constructor's check.
            assert self.start_wd == self.end_wd
            return self.end_wd
        progress = float(self.num_steps) / float(self.wd_incr_steps)
        assert 0.0 <= progress <= 1.0
        shape = _WD_RAMPS.get(self.wd_incr_style)
        if shape is None:
            raise ValueError(f'{self.wd_incr_style} weight decay increment style is not supported.')
        return self.start_wd + shape(progress) * (self.end_wd - self.start_wd)

    def get_lr(self, param_group: dict) -> float:
        """Learning rate (before lr_mult) at the current step for `param_group`."""
        top = param_group.get('max_lr', self.max_lr)
        bottom = param_group.get('min_lr', self.min_lr)
        n = self.num_steps
        in_warmup = 0 < self.lr_warmup_steps and n <= self.lr_warmup_steps
        if in_warmup:
            ramp = (top - self.init_lr) * float(n) / float(self.lr_warmup_steps)
            return self.init_lr + ramp
        if self.lr_decay_style == 'constant':
            return top
        if n > self.lr_decay_steps:
            return bottom
        if self.lr_decay_style == 'inverse-square-root':
            # Same value as the warmup end at n == W, then falling as 1/sqrt(n).
            scaled = top * max(self.lr_warmup_steps, 1) ** 0.5 / (max(n, 1) ** 0.5)
            return max(bottom, scaled)
        return bottom + self._decay_coeff() * (top - bottom)

    def _decay_coeff(self) -> float:
        """Fraction of (max_lr - min_lr) left at the current step, past warmup."""
        done = self.num_steps - self.lr_warmup_steps
        span = self.lr_decay_steps - self.lr_warmup_steps
        progress = float(done) / float(span)
        assert 0.0 <= progress <= 1.0
        if self.lr_decay_style == 'WSD':
            return self._wsd_coeff()
        shape = _LR_DECAYS.get(self.lr_decay_style)
        if shape is None:
            raise ValueError(f'{self.lr_decay_style} decay style is not supported.')
        return shape(progress)

    def _wsd_coeff(self) -> float:
        """WSD: hold max_lr, then anneal over the final `wsd_decay_steps` of the decay span."""
        stable_until = self.lr_decay_steps - self.wsd_decay_steps
        if self.num_steps <= stable_until:
            return 1.0
        shape = _WSD_ANNEALS.get(self.lr_wsd_decay_style)
        if shape is None:
            raise ValueError(f'{self.lr_wsd_decay_style} WSD decay style is not supported.')
        return shape(float(self.num_steps - stable_until) / float(self.wsd_decay_steps))

    def step(self, increment: int) -> None:
        """Advance by `increment` samples and set every group's lr and weight_decay."""
        self.num_steps = self.num_steps + increment
        wd = self.get_wd()
        for group in self.optimizer.param_groups:
            group['lr'] = self.get_lr(group) * group.get('lr_mult', 1.0)
            group['weight_decay'] = wd * group.get('wd_mult', 1.0)

    def state_dict(self) -> dict:
        """Megatron's checkpoint keys for the scheduler (each key is the attribute's name)."""
        return {key: getattr(self, key) for key in _STATE_KEYS}

    def _check_and_set(self, cls_value, sd_value, name: str):
        """The value to use on load: this object's (override) or the checkpoint's.

        Without either override or use-checkpoint, the two must agree.
        """
        if self.override_opt_param_scheduler:
            logger.info(' > overriding %s value to %s', name, cls_value)
            return cls_value
        if not self.use_checkpoint_opt_param_scheduler and cls_value != sd_value:
            raise ValueError(
                f'OptimizerParamScheduler: class input value {cls_value} and checkpoint value '
                f'{sd_value} for {name} do not match (use --override-opt_param-scheduler or '
                f'--use-checkpoint-opt_param-scheduler)'
            )
        logger.info(' > using checkpoint value %s for %s', sd_value, name)
        return sd_value

    def _reconcile(self, attr: str, stored, label: str) -> None:
        setattr(self, attr, self._check_and_set(getattr(self, attr), stored, label))

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore from `state_dict()` (old key names accepted) and re-apply lr / wd."""
        for attr, label in _LR_RESTORED:
            self._reconcile(attr, _stored(state_dict, attr), label)
        self.step(increment=_stored(state_dict, 'num_steps'))
        # Checkpoints older than the weight-decay schedule lack these keys: keep ours then.
        if 'start_wd' not in state_dict:
            return
        for attr, label in _WD_RESTORED:
            self._reconcile(attr, state_dict[attr], label)
        # Re-apply so param groups see the (possibly checkpointed) weight-decay settings.
        self.step(0)


def _check_lr_range(init_lr, max_lr, min_lr) -> None:
    if not min_lr >= 0.0:
        raise ValueError(f'min_lr (--min-lr) must be >= 0, got {min_lr}')
    if not max_lr >= min_lr:
        raise ValueError(f'lr (--lr) {max_lr} must be >= min_lr (--min-lr) {min_lr}')
    if not init_lr <= max_lr:
        raise ValueError(
            f'lr_warmup_init (--lr-warmup-init) {init_lr} must be <= lr (--lr) {max_lr}'
        )


def _check_decay(lr_warmup_steps, lr_decay_steps, lr_decay_style) -> None:
    if not lr_decay_steps > 0:
        raise ValueError(
            'lr decay steps (--lr-decay-iters/--lr-decay-samples) must be > 0, got '
            f'{lr_decay_steps}'
        )
    if not lr_warmup_steps < lr_decay_steps:
        raise ValueError(
            f'lr warmup steps ({lr_warmup_steps}) must be < lr decay steps '
            f'({lr_decay_steps}) (--lr-warmup-iters/--lr-warmup-fraction vs '
            '--lr-decay-iters)'
        )
    if lr_decay_style not in _LR_DECAY_STYLES:
        raise ValueError(
            f'lr_decay_style (--lr-decay-style) must be one of {_LR_DECAY_STYLES}, got '
            f'{lr_decay_style!r}'
        )


def _check_wsd(wsd_decay_steps, lr_decay_steps, lr_wsd_decay_style) -> None:
    if wsd_decay_steps is None or not 0 < wsd_decay_steps <= lr_decay_steps:
        raise ValueError(
            'WSD needs 0 < wsd_decay_steps (--lr-wsd-decay-iters/samples) <= lr decay '
            f'steps ({lr_decay_steps}), got {wsd_decay_steps}'
        )
    if lr_wsd_decay_style not in _WSD_DECAY_STYLES:
        raise ValueError(
            'lr_wsd_decay_style (--lr-wsd-decay-style) must be one of '
            f'{_WSD_DECAY_STYLES}, got {lr_wsd_decay_style!r}'
        )


def _check_wd(start_wd, end_wd, wd_incr_style) -> None:
    if not start_wd >= 0.0:
        raise ValueError(f'start_wd (--start-weight-decay) must be >= 0, got {start_wd}')
    if not end_wd >= start_wd:
        raise ValueError(f'end_wd (--end-weight-decay) {end_wd} must be >= start_wd {start_wd}')
    if wd_incr_style not in _WD_INCR_STYLES:
        raise ValueError(
            f'wd_incr_style (--weight-decay-incr-style) must be one of {_WD_INCR_STYLES}, got '
            f'{wd_incr_style!r}'
        )
    if wd_incr_style == 'constant' and start_wd != end_wd:
        raise ValueError(
            f'constant weight decay needs start_wd == end_wd, got {start_wd} and {end_wd}'
        )


def _half_cosine_down(x: float) -> float:
    """1 at x = 0 falling to 0 at x = 1 along half a cosine period."""
    return 0.5 * (math.cos(math.pi * x) + 1.0)


# Shape of the weight-decay ramp, from 0 (start_wd) to 1 (end_wd), in the ramp's progress.
_WD_RAMPS = {
    'linear': lambda x: x,
    'cosine': lambda x: 0.5 * (math.cos(math.pi * (1 - x)) + 1.0),
}
# Shape of the lr decay, from 1 (max_lr) to 0 (min_lr), in the decay's progress.
_LR_DECAYS = {'linear': lambda x: 1.0 - x, 'cosine': _half_cosine_down}
_WSD_ANNEALS = {
    'linear': lambda x: 1.0 - x,
    'cosine': _half_cosine_down,
    'exponential': lambda x: (2.0 * math.pow(0.5, x)) - 1.0,
}

# Keys written by state_dict(), in Megatron's order.
_STATE_KEYS = (
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
)

# Names older Megatron checkpoints used for a key, tried before the current one.
_LEGACY_KEYS = {
    'max_lr': ('start_lr',),
    'lr_warmup_steps': ('warmup_iter', 'warmup_steps'),
    'lr_decay_steps': ('end_iter', 'decay_steps'),
    'lr_decay_style': ('decay_style',),
    'num_steps': ('num_iters',),
}

# (attribute, label in the log / mismatch error), restored in this order on load.
_LR_RESTORED = (
    ('max_lr', 'learning rate'),
    ('min_lr', 'minimum learning rate'),
    ('lr_warmup_steps', 'warmup iterations'),
    ('lr_decay_steps', 'total number of iterations'),
    ('lr_decay_style', 'learning rate decay style'),
)
_WD_RESTORED = (
    ('start_wd', 'start weight decay'),
    ('end_wd', 'end weight decay'),
    ('wd_incr_steps', 'total number of weight decay iterations'),
    ('wd_incr_style', 'weight decay incr style'),
)


def _stored(state_dict: dict, key: str):
    """`state_dict[key]`, or the value under the first legacy name the checkpoint has."""
    for old in _LEGACY_KEYS.get(key, ()):
        if old in state_dict:
            return state_dict[old]
    return state_dict[key]
