"""Loss scalers for fp16 training: a constant scale, or Megatron's dynamic scale with hysteresis."""

from abc import ABC, abstractmethod
from typing import Dict

import torch

from ..utils import get_current_device


class MegatronGradScaler(ABC):
    """Base class: holds the current loss scale as a 1-element fp32 tensor on the device."""

    def __init__(self, initial_scale: float):
        if initial_scale <= 0.0:
            raise ValueError(f"initial loss scale must be positive, got {initial_scale}")
        self._scale = torch.tensor([initial_scale], dtype=torch.float, device=get_current_device())

    @property
    def scale(self) -> torch.Tensor:
        """The current loss scale (1-element tensor)."""
        return self._scale

    @property
    def inv_scale(self) -> torch.Tensor:
        """1 / scale, as a float64-exact reciprocal cast to fp32."""
        return self._scale.double().reciprocal().float()

    @abstractmethod
    def update(self, found_inf: bool):
        """Adjust the scale after an iteration (`found_inf`: the grads had an inf/nan)."""

    @abstractmethod
    def state_dict(self) -> Dict:
        """State for checkpointing."""

    @abstractmethod
    def load_state_dict(self, state_dict: Dict):
        """Restore from `state_dict()`."""


class ConstantGradScaler(MegatronGradScaler):
    """A fixed loss scale (`--loss-scale`)."""

    def update(self, found_inf: bool):
        pass

    def state_dict(self) -> Dict:
        return dict()

    def load_state_dict(self, state_dict: Dict):
        pass


class DynamicGradScaler(MegatronGradScaler):
    """Dynamic loss scale with growth interval and hysteresis (Megatron's semantics).

    On an iteration with inf/nan grads the growth tracker resets and the hysteresis tracker drops
    by one; once it reaches zero the scale is multiplied by `backoff_factor` (not below
    `min_scale`) — and keeps being backed off on every further overflow until a clean window
    resets the tracker. After `growth_interval` consecutive clean iterations the scale is
    multiplied by `growth_factor` and the hysteresis tracker is reset.

    Args:
        initial_scale: starting scale (`--initial-loss-scale`, default 2**32).
        min_scale: lower bound (`--min-loss-scale`, default 1.0).
        growth_factor: multiplier on growth (2.0).
        backoff_factor: multiplier on overflow (0.5).
        growth_interval: clean iterations before growing (`--loss-scale-window`, default 1000).
        hysteresis: overflows tolerated before backing off (`--hysteresis`, default 2).
    """

    def __init__(
        self,
        initial_scale: float,
        min_scale: float,
        growth_factor: float,
        backoff_factor: float,
        growth_interval: int,
        hysteresis: int,
    ):
        super().__init__(initial_scale)
        if not 0.0 < min_scale <= initial_scale:
            raise ValueError(
                f"min loss scale must be in (0, initial scale {initial_scale}], got {min_scale}"
            )
        if growth_factor <= 1.0:
            raise ValueError(f"loss scale growth factor must be > 1, got {growth_factor}")
        if not 0.0 < backoff_factor < 1.0:
            raise ValueError(f"loss scale backoff factor must be in (0, 1), got {backoff_factor}")
        if growth_interval <= 0:
            raise ValueError(
                f"loss scale window (growth interval) must be positive, got {growth_interval}"
            )
        if hysteresis <= 0:
            raise ValueError(f"hysteresis must be positive, got {hysteresis}")
        device = get_current_device()
        self.min_scale = torch.tensor([min_scale], dtype=torch.float, device=device)
        self.growth_factor = torch.tensor([growth_factor], dtype=torch.float, device=device)
        self.backoff_factor = torch.tensor([backoff_factor], dtype=torch.float, device=device)
        self.growth_interval = growth_interval
        self.hysteresis = hysteresis
        self._growth_tracker = 0
        self._hysteresis_tracker = self.hysteresis

    def update(self, found_inf: bool):
        if not found_inf:
            # growth_interval clean steps in a row: grow, and refill the hysteresis budget.
            self._growth_tracker += 1
            if self._growth_tracker < self.growth_interval:
                return
            self._growth_tracker, self._hysteresis_tracker = 0, self.hysteresis
            self._scale = self._scale * self.growth_factor
            return
        # An overflow restarts the clean-step count; the scale backs off only once `hysteresis`
        # overflows have used up the budget, never below min_scale.
        self._growth_tracker = 0
        self._hysteresis_tracker -= 1
        if self._hysteresis_tracker <= 0:
            self._scale = torch.max(self._scale * self.backoff_factor, self.min_scale)

    def state_dict(self) -> Dict:
        return {
            'scale': self._scale,
            'growth_tracker': self._growth_tracker,
            'hysteresis_tracker': self._hysteresis_tracker,
        }

    def load_state_dict(self, state_dict: Dict):
        self._scale = state_dict['scale'].to(get_current_device())
        self._growth_tracker = state_dict['growth_tracker']
        self._hysteresis_tracker = state_dict['hysteresis_tracker']
