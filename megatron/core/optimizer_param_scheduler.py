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
        self.optimizer = optimizer

        self.init_lr = init_lr
        self.max_lr = float(max_lr)
        self.min_lr = min_lr
        if not self.min_lr >= 0.0:
            raise ValueError(f'min_lr (--min-lr) must be >= 0, got {self.min_lr}')
        if not self.max_lr >= self.min_lr:
            raise ValueError(f'lr (--lr) {self.max_lr} must be >= min_lr (--min-lr) {self.min_lr}')
        if not self.init_lr <= self.max_lr:
            raise ValueError(
                f'lr_warmup_init (--lr-warmup-init) {self.init_lr} must be <= lr (--lr) '
                f'{self.max_lr}'
            )

        self.lr_warmup_steps = lr_warmup_steps
        self.num_steps = 0
        self.lr_decay_steps = lr_decay_steps
        self.wsd_decay_steps = wsd_decay_steps
        self.lr_wsd_decay_style = lr_wsd_decay_style
        if not self.lr_decay_steps > 0:
            raise ValueError(
                'lr decay steps (--lr-decay-iters/--lr-decay-samples) must be > 0, got '
                f'{lr_decay_steps}'
            )
        if not self.lr_warmup_steps < self.lr_decay_steps:
            raise ValueError(
                f'lr warmup steps ({self.lr_warmup_steps}) must be < lr decay steps '
                f'({self.lr_decay_steps}) (--lr-warmup-iters/--lr-warmup-fraction vs '
                '--lr-decay-iters)'
            )

        self.lr_decay_style = lr_decay_style
        if lr_decay_style not in _LR_DECAY_STYLES:
            raise ValueError(
                f'lr_decay_style (--lr-decay-style) must be one of {_LR_DECAY_STYLES}, got '
                f'{lr_decay_style!r}'
            )
        if lr_decay_style == 'WSD':
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

        self.start_wd = start_wd
        self.end_wd = end_wd
        if not self.start_wd >= 0.0:
            raise ValueError(f'start_wd (--start-weight-decay) must be >= 0, got {start_wd}')
        if not self.end_wd >= self.start_wd:
            raise ValueError(f'end_wd (--end-weight-decay) {end_wd} must be >= start_wd {start_wd}')
        self.wd_incr_steps = wd_incr_steps
        self.wd_incr_style = wd_incr_style
        if wd_incr_style not in _WD_INCR_STYLES:
            raise ValueError(
                f'wd_incr_style (--weight-decay-incr-style) must be one of {_WD_INCR_STYLES}, got '
                f'{wd_incr_style!r}'
            )
        if wd_incr_style == 'constant' and start_wd != end_wd:
            raise ValueError(
                f'constant weight decay needs start_wd == end_wd, got {start_wd} and {end_wd}'
            )

        self.override_opt_param_scheduler = override_opt_param_scheduler
        self.use_checkpoint_opt_param_scheduler = use_checkpoint_opt_param_scheduler
        if self.override_opt_param_scheduler and self.use_checkpoint_opt_param_scheduler:
            raise ValueError(
                'both override-opt_param-scheduler and use-checkpoint-opt_param-scheduler are set '
                '(--override-opt_param-scheduler, --use-checkpoint-opt_param-scheduler)'
            )

        # Set the learning rate and weight decay for step 0.
        self.step(0)
        logger.info('> learning rate decay style: %s', self.lr_decay_style)

    def get_wd(self) -> float:
        """Weight decay at the current step."""
        if self.num_steps > self.wd_incr_steps:
            return self.end_wd
        if self.wd_incr_style == 'constant':
            assert self.start_wd == self.end_wd
            return self.end_wd

        incr_ratio = float(self.num_steps) / float(self.wd_incr_steps)
        assert 0.0 <= incr_ratio <= 1.0
        delta_wd = self.end_wd - self.start_wd
        if self.wd_incr_style == 'linear':
            coeff = incr_ratio
        elif self.wd_incr_style == 'cosine':
            coeff = 0.5 * (math.cos(math.pi * (1 - incr_ratio)) + 1.0)
        else:
            raise ValueError(f'{self.wd_incr_style} weight decay increment style is not supported.')
        return self.start_wd + coeff * delta_wd

    def get_lr(self, param_group: dict) -> float:
        """Learning rate (before lr_mult) at the current step for `param_group`."""
        max_lr = param_group.get('max_lr', self.max_lr)
        min_lr = param_group.get('min_lr', self.min_lr)

        # Linear warmup.
        if self.lr_warmup_steps > 0 and self.num_steps <= self.lr_warmup_steps:
            return self.init_lr + (
                (max_lr - self.init_lr) * float(self.num_steps) / float(self.lr_warmup_steps)
            )

        if self.lr_decay_style == 'constant':
            return max_lr

        if self.num_steps > self.lr_decay_steps:
            return min_lr

        if self.lr_decay_style == 'inverse-square-root':
            warmup_steps = max(self.lr_warmup_steps, 1)
            num_steps = max(self.num_steps, 1)
            lr = max_lr * warmup_steps**0.5 / (num_steps**0.5)
            return max(min_lr, lr)

        num_steps_ = self.num_steps - self.lr_warmup_steps
        decay_steps_ = self.lr_decay_steps - self.lr_warmup_steps
        decay_ratio = float(num_steps_) / float(decay_steps_)
        assert 0.0 <= decay_ratio <= 1.0
        delta_lr = max_lr - min_lr

        if self.lr_decay_style == 'linear':
            coeff = 1.0 - decay_ratio
        elif self.lr_decay_style == 'cosine':
            coeff = 0.5 * (math.cos(math.pi * decay_ratio) + 1.0)
        elif self.lr_decay_style == 'WSD':
            wsd_anneal_start = self.lr_decay_steps - self.wsd_decay_steps
            if self.num_steps <= wsd_anneal_start:
                coeff = 1.0
            else:
                wsd_decay_ratio = float(self.num_steps - wsd_anneal_start) / float(
                    self.wsd_decay_steps
                )
                if self.lr_wsd_decay_style == 'linear':
                    coeff = 1.0 - wsd_decay_ratio
                elif self.lr_wsd_decay_style == 'cosine':
                    coeff = 0.5 * (math.cos(math.pi * wsd_decay_ratio) + 1.0)
                elif self.lr_wsd_decay_style == 'exponential':
                    coeff = (2.0 * math.pow(0.5, wsd_decay_ratio)) - 1.0
                else:
                    raise ValueError(f'{self.lr_wsd_decay_style} WSD decay style is not supported.')
        else:
            raise ValueError(f'{self.lr_decay_style} decay style is not supported.')
        return min_lr + coeff * delta_lr

    def step(self, increment: int) -> None:
        """Advance by `increment` samples and set every group's lr and weight_decay."""
        self.num_steps += increment
        new_wd = self.get_wd()
        for param_group in self.optimizer.param_groups:
            new_lr = self.get_lr(param_group)
            param_group['lr'] = new_lr * param_group.get('lr_mult', 1.0)
            param_group['weight_decay'] = new_wd * param_group.get('wd_mult', 1.0)

    def state_dict(self) -> dict:
        """Megatron's checkpoint keys for the scheduler."""
        return {
            'max_lr': self.max_lr,
            'lr_warmup_steps': self.lr_warmup_steps,
            'num_steps': self.num_steps,
            'lr_decay_style': self.lr_decay_style,
            'lr_decay_steps': self.lr_decay_steps,
            'min_lr': self.min_lr,
            'start_wd': self.start_wd,
            'end_wd': self.end_wd,
            'wd_incr_style': self.wd_incr_style,
            'wd_incr_steps': self.wd_incr_steps,
        }

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

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore from `state_dict()` (old key names accepted) and re-apply lr / wd."""
        if 'start_lr' in state_dict:
            max_lr_ = state_dict['start_lr']
        else:
            max_lr_ = state_dict['max_lr']
        self.max_lr = self._check_and_set(self.max_lr, max_lr_, 'learning rate')

        self.min_lr = self._check_and_set(
            self.min_lr, state_dict['min_lr'], 'minimum learning rate'
        )

        if 'warmup_iter' in state_dict:
            lr_warmup_steps_ = state_dict['warmup_iter']
        elif 'warmup_steps' in state_dict:
            lr_warmup_steps_ = state_dict['warmup_steps']
        else:
            lr_warmup_steps_ = state_dict['lr_warmup_steps']
        self.lr_warmup_steps = self._check_and_set(
            self.lr_warmup_steps, lr_warmup_steps_, 'warmup iterations'
        )

        if 'end_iter' in state_dict:
            lr_decay_steps_ = state_dict['end_iter']
        elif 'decay_steps' in state_dict:
            lr_decay_steps_ = state_dict['decay_steps']
        else:
            lr_decay_steps_ = state_dict['lr_decay_steps']
        self.lr_decay_steps = self._check_and_set(
            self.lr_decay_steps, lr_decay_steps_, 'total number of iterations'
        )

        if 'decay_style' in state_dict:
            lr_decay_style_ = state_dict['decay_style']
        else:
            lr_decay_style_ = state_dict['lr_decay_style']
        self.lr_decay_style = self._check_and_set(
            self.lr_decay_style, lr_decay_style_, 'learning rate decay style'
        )

        if 'num_iters' in state_dict:
            num_steps = state_dict['num_iters']
        else:
            num_steps = state_dict['num_steps']
        self.step(increment=num_steps)

        if 'start_wd' in state_dict:
            self.start_wd = self._check_and_set(
                self.start_wd, state_dict['start_wd'], 'start weight decay'
            )
            self.end_wd = self._check_and_set(self.end_wd, state_dict['end_wd'], 'end weight decay')
            self.wd_incr_steps = self._check_and_set(
                self.wd_incr_steps,
                state_dict['wd_incr_steps'],
                'total number of weight decay iterations',
            )
            self.wd_incr_style = self._check_and_set(
                self.wd_incr_style, state_dict['wd_incr_style'], 'weight decay incr style'
            )
            # Re-apply so param groups see the (possibly checkpointed) weight-decay settings.
            self.step(0)
