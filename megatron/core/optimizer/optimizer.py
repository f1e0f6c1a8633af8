"""Megatron optimizer wrappers: fp32, mixed precision with fp32 main params, and chains of them.

A `MegatronOptimizer` wraps a `torch.optim` optimizer. Its `step()` moves the model gradients
(`param.main_grad` from DistributedDataParallel, else `param.grad`) to the parameters the inner
optimizer updates, unscales them and checks them for inf/nan (fp16), clips them by the global norm
across the model-parallel group, runs the inner step and copies updated values back to the model:

    update_successful, grad_norm, num_zeros_in_grad = optimizer.step()

A step whose gradients contain inf/nan is skipped: `(False, None, None)` is returned, the
parameters and the optimizer state are unchanged, and the loss scaler backs off.
"""

import logging
import math
from abc import ABC, abstractmethod
from contextlib import contextmanager
from typing import Callable, Dict, List, Optional, Tuple

import torch

from .. import parallel_state, tensor_parallel
from ..dist_checkpointing.safe_load import weights_only_load
from ..utils import get_current_device
from .clip_grads import (
    clip_grad_by_total_norm_fp32,
    count_zeros_fp32,
    get_grad_norm_fp32,
    param_is_not_shared,
)
from .grad_scaler import MegatronGradScaler
from .optimizer_config import OptimizerConfig

logger = logging.getLogger(__name__)

_FLOAT16_DTYPES = (torch.float16, torch.bfloat16)


def _zero_grad_group_helper(group: List[torch.Tensor], set_to_none: bool):
    """Zero (or drop) the `.grad` of every tensor in `group`."""
    for param in (p for p in group if p.grad is not None):
        if set_to_none:
            param.grad = None
            continue
        grad = param.grad
        # A grad produced by a graph is cut from it before being reused as a zero buffer.
        if grad.grad_fn is not None:
            grad.detach_()
        else:
            grad.requires_grad_(False)
        grad.zero_()


@contextmanager
def _timed(config: OptimizerConfig, name: str):
    """Time a section with config.timers (Megatron's Timers, level 1) when timers are given."""
    timers = config.timers
    if timers is None:
        yield
        return
    timers(name, log_level=1).start(barrier=config.barrier_with_L1_time)
    try:
        yield
    finally:
        timers(name).stop()


class MegatronOptimizer(ABC):
    """Base class of the Megatron optimizer wrappers.

    Args:
        optimizer: the inner torch optimizer (its param_groups carry Megatron's 'wd_mult',
            'lr_mult', ... keys used by the scheduler).
        config: OptimizerConfig.
        init_state_fn: creates empty optimizer state for every param (used before loading state).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        config: OptimizerConfig,
        init_state_fn: Callable = lambda x: None,
    ):
        self.optimizer = optimizer
        assert self.optimizer, "no optimizer is provided."
        self.config = config
        self.init_state_fn = init_state_fn

    def get_parameters(self) -> List[torch.nn.Parameter]:
        """Every parameter the inner optimizer updates (main params for mixed precision)."""
        return [param for group in self.optimizer.param_groups for param in group['params']]

    def get_main_grads_for_grad_norm(self) -> List[torch.Tensor]:
        """Gradients entering the global norm: no TP duplicates, no tied-embedding copies."""
        grads_for_norm = []
        for param in self.get_parameters():
            grad = param.grad
            if grad is None:
                continue
            if param_is_not_shared(
                param
            ) and tensor_parallel.param_is_not_tensor_parallel_duplicate(param):
                grads_for_norm.append(grad)
        return grads_for_norm

    #: Set on the optimizer of expert-parallel parameters (see get_megatron_optimizer).
    is_expert_optimizer = False

    def get_model_parallel_group(self) -> Optional[torch.distributed.ProcessGroup]:
        """Group the grad norm, zero count and inf check are reduced over: TP x PP, or
        TP x EP x PP for expert parameters (each expert lives on one expert-parallel rank)."""
        if self.is_expert_optimizer:
            return parallel_state.get_model_parallel_group(with_expert_parallel=True)
        return parallel_state.get_model_parallel_group()

    def get_grad_norm(self) -> float:
        """Global L2 norm of the (unscaled) main gradients."""
        return get_grad_norm_fp32(
            self.get_main_grads_for_grad_norm(),
            model_parallel_group=self.get_model_parallel_group(),
        )

    def clip_grad_norm(self, clip_grad: float) -> float:
        """Compute the global gradient norm and clip the main gradients to `clip_grad`."""
        params = self.get_parameters()
        grad_norm = self.get_grad_norm()
        clip_grad_by_total_norm_fp32(params, clip_grad, grad_norm)
        return grad_norm

    def count_zeros(self) -> float:
        """Number of zero entries in the main gradients over the model-parallel group."""
        return count_zeros_fp32(
            self.get_parameters(), model_parallel_group=self.get_model_parallel_group()
        )

    @abstractmethod
    def zero_grad(self, set_to_none: bool = True):
        """Drop (or zero) the gradients held by the optimizer's parameters."""

    @abstractmethod
    def get_loss_scale(self) -> torch.Tensor:
        """The current loss scale (1-element tensor; 1.0 without a loss scaler)."""

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """Multiply the loss by the loss scale (fp16)."""
        return self.get_loss_scale() * loss

    def finish_param_sync(self, model_index: int, *unused):
        """Hook for overlapped parameter all-gathers (nothing to do here)."""

    @abstractmethod
    def reload_model_params(self):
        """Refresh the main params from the model params (after the model weights were loaded)."""

    @abstractmethod
    def state_dict(self) -> Dict:
        """State for checkpointing."""

    @abstractmethod
    def load_state_dict(self, state_dict: Dict):
        """Restore from `state_dict()`."""

    def sharded_state_dict(self, model_sharded_state_dict, is_loading: bool = False, **kwargs):
        """Distributed-checkpoint view of the optimizer state, keyed by the model's parameter
        keys (megatron/core/dist_checkpointing/optimizer.py); with `is_loading` the state
        tensors are created first so they can be loaded in place."""
        from megatron.core.dist_checkpointing.optimizer import non_distributed_sharded_state_dict

        return non_distributed_sharded_state_dict(self, model_sharded_state_dict, is_loading)

    def load_sharded_state_dict(self, state_dict: Dict) -> None:
        """Finish a distributed-checkpoint load: the state tensors were filled in place; apply
        the hyperparameters, step and loss scaler (whichever optimizer kind saved them)."""
        from megatron.core.dist_checkpointing.optimizer import restore_after_sharded_load

        restore_after_sharded_load(self, state_dict)

    @abstractmethod
    def prepare_grads(self) -> bool:
        """Move model grads to main grads (unscaling); return True if any is inf/nan."""

    @abstractmethod
    def step_with_ready_grads(self) -> bool:
        """Run the inner step on prepared grads and update the model params."""

    @torch.no_grad()
    def step(self) -> Tuple[bool, Optional[float], Optional[float]]:
        """One optimizer step.

        Returns:
            (update_successful, grad_norm, num_zeros_in_grad): update_successful is False when the
            step was skipped because of inf/nan gradients (then grad_norm and num_zeros are None);
            grad_norm is None unless clip_grad > 0; num_zeros is None unless
            log_num_zeros_in_grad.
        """
        found_inf_flag = self.prepare_grads()
        if found_inf_flag:
            return False, None, None

        grad_norm = None
        if self.config.clip_grad > 0.0:
            with _timed(self.config, 'optimizer-clip-main-grad'):
                grad_norm = self.clip_grad_norm(self.config.clip_grad)

        num_zeros_in_grad = None
        if self.config.log_num_zeros_in_grad:
            with _timed(self.config, 'optimizer-count-zeros'):
                num_zeros_in_grad = self.count_zeros()

        update_successful = self.step_with_ready_grads()
        return update_successful, grad_norm, num_zeros_in_grad

    def _record_step(self):
        # A per-group step counter (as apex's FusedAdam keeps), so a sharded optimizer can restore
        # torch Adam's per-param 'step' even on ranks that own no element of a group.
        for group in self.optimizer.param_groups:
            group['step'] = group.get('step', 0) + 1

    # Promote state and param_groups so the scheduler and checkpointing can use them directly.
    # The inner optimizer's state and groups, read and assigned through the wrapper (the
    # scheduler sets learning rates on `param_groups`, checkpointing reads `state`).
    state = property(
        lambda self: self.optimizer.state,
        lambda self, value: setattr(self.optimizer, 'state', value),
    )
    param_groups = property(
        lambda self: self.optimizer.param_groups,
        lambda self, value: setattr(self.optimizer, 'param_groups', value),
    )


class MixedPrecisionOptimizer(MegatronOptimizer):
    """Shared logic of the fp16/bf16 optimizers: loss scaling, unscaling and the inf/nan check.

    Args:
        optimizer: the inner torch optimizer.
        config: OptimizerConfig.
        grad_scaler: the loss scaler (required for fp16; None for bf16 and fp32).
        init_state_fn: creates empty optimizer state.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        config: OptimizerConfig,
        grad_scaler: Optional[MegatronGradScaler],
        init_state_fn: Callable,
    ):
        super().__init__(optimizer, config, init_state_fn)
        self.grad_scaler = grad_scaler
        if self.grad_scaler is None:
            assert not self.config.fp16, 'fp16 expects a grad scaler.'
        device = get_current_device()
        if self.grad_scaler:
            self.found_inf = torch.tensor([0.0], dtype=torch.float, device=device)
        self._scale_one = torch.tensor([1.0], dtype=torch.float, device=device)

    def get_loss_scale(self) -> torch.Tensor:
        if self.grad_scaler is None:
            return self._scale_one
        return self.grad_scaler.scale

    def reload_model_params(self):
        self._copy_model_params_to_main_params()

    @abstractmethod
    def _collect_main_grad_data_for_unscaling(self) -> List[torch.Tensor]:
        """The main grads to unscale and check."""

    @abstractmethod
    def _copy_model_grads_to_main_grads(self):
        """Model grads (main_grad or .grad) -> fp32 main grads."""

    @abstractmethod
    def _copy_main_params_to_model_params(self):
        """Updated fp32 main params -> model params."""

    @abstractmethod
    def _copy_model_params_to_main_params(self):
        """Model params -> fp32 main params."""

    def _unscale_main_grads_and_check_for_nan(self) -> bool:
        main_grads = self._collect_main_grad_data_for_unscaling()
        self.found_inf.fill_(0.0)
        inv_scale = self.grad_scaler.inv_scale
        for grad in main_grads:
            # Check before unscaling: unscaling cannot create an inf, and nan stays nan.
            if not torch.isfinite(grad).all():
                self.found_inf.fill_(1.0)
            grad.mul_(inv_scale.to(grad.device))
        # Every model-parallel rank must skip the same steps.
        torch.distributed.all_reduce(
            self.found_inf, op=torch.distributed.ReduceOp.MAX, group=self.get_model_parallel_group()
        )
        return self.found_inf.item() > 0

    @torch.no_grad()
    def prepare_grads(self) -> bool:
        with _timed(self.config, 'optimizer-copy-to-main-grad'):
            self._copy_model_grads_to_main_grads()
        if self.grad_scaler:
            with _timed(self.config, 'optimizer-unscale-and-check-inf'):
                found_inf_flag = self._unscale_main_grads_and_check_for_nan()
            self.grad_scaler.update(found_inf_flag)
            return found_inf_flag
        return False

    @torch.no_grad()
    def step_with_ready_grads(self) -> bool:
        with _timed(self.config, 'optimizer-inner-step'):
            self.optimizer.step()
        self._record_step()
        with _timed(self.config, 'optimizer-copy-main-to-model-params'):
            self._copy_main_params_to_model_params()
        return True


class Float16OptimizerWithFloat16Params(MixedPrecisionOptimizer):
    """Optimizer for fp16/bf16 models that keeps fp32 main copies of the float16 params.

    The inner optimizer updates fp32 clones of the model's fp16/bf16 params (fp32 model params are
    updated directly); after each step the main values are cast back into the model params.

    Args:
        optimizer: the inner torch optimizer, built over the model params (replaced here by their
            fp32 main copies).
        config: OptimizerConfig.
        grad_scaler: loss scaler (fp16) or None (bf16).
        init_state_fn: creates empty optimizer state.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        config: OptimizerConfig,
        grad_scaler: Optional[MegatronGradScaler],
        init_state_fn: Callable,
    ):
        super().__init__(optimizer, config, grad_scaler, init_state_fn)
        # Per param group: the float16 model params, their fp32 main copies (which the inner
        # optimizer now updates in their place), and the params that were fp32 already.
        self.float16_groups, self.fp32_from_float16_groups, self.fp32_from_fp32_groups = [], [], []
        for group in self.optimizer.param_groups:
            halves, mains, fp32s = self._take_main_copies(group['params'])
            self.float16_groups.append(halves)
            self.fp32_from_float16_groups.append(mains)
            self.fp32_from_fp32_groups.append(fp32s)

    def _take_main_copies(self, params: list):
        """Put an fp32 main copy in place of every float16 param of `params` (moving any
        optimizer state to it); returns (float16 params, main copies, fp32 params)."""
        halves, mains, fp32s = [], [], []
        for index, param in enumerate(params):
            if not param.requires_grad:
                continue
            if param.dtype == torch.float32:
                fp32s.append(param)
                continue
            if param.dtype not in _FLOAT16_DTYPES:
                raise TypeError(
                    'Wrapped parameters must be one of torch.float32, torch.float16 or '
                    f'torch.bfloat16. Received {param.dtype}'
                )
            main = param.detach().clone().float()
            tensor_parallel.copy_tensor_model_parallel_attributes(main, param)
            # Marks other code reads off the parameter the optimizer updates: tied embeddings
            # (`shared`) and Muon's tags.
            for attr in ('shared', 'use_muon', 'muon_qkv_layout'):
                if hasattr(param, attr):
                    setattr(main, attr, getattr(param, attr))
            params[index] = main
            if param in self.optimizer.state:
                self.optimizer.state[main] = self.optimizer.state.pop(param)
            halves.append(param)
            mains.append(main)
        return halves, mains, fp32s

    def zero_grad(self, set_to_none: bool = True):
        """Drop model grads and main grads (DDP's main_grad buffer is zeroed by the model)."""
        every_group = (
            self.float16_groups + self.fp32_from_float16_groups + self.fp32_from_fp32_groups
        )
        for group in every_group:
            _zero_grad_group_helper(group, set_to_none)

    def _collect_main_grad_data_for_unscaling(self) -> List[torch.Tensor]:
        updated = self.fp32_from_float16_groups + self.fp32_from_fp32_groups
        return [p.grad.data for group in updated for p in group if p.grad is not None]

    def _get_model_and_main_params_data_float16(self):
        pairs = [
            (model.data, main.data)
            for halves, mains in zip(self.float16_groups, self.fp32_from_float16_groups)
            for model, main in zip(halves, mains)
        ]
        return [model for model, _ in pairs], [main for _, main in pairs]

    def _copy_model_grads_to_main_grads(self):
        for halves, mains in zip(self.float16_groups, self.fp32_from_float16_groups):
            for model, main in zip(halves, mains):
                # DDP's fp32 main_grad buffer when there is one, else autograd's grad.
                source = getattr(model, 'main_grad', None)
                if source is None:
                    source = model.grad
                if source is not None:
                    main.grad = source.float()
                model.grad = None  # the float16 grad is not needed any more: free it now
        for model_group in self.fp32_from_fp32_groups:
            for model_param in model_group:
                if hasattr(model_param, 'main_grad'):
                    model_param.grad = model_param.main_grad

    def _copy_main_params_to_model_params(self):
        model_data, main_data = self._get_model_and_main_params_data_float16()
        for model, main in zip(model_data, main_data):
            model.copy_(main)

    def _copy_model_params_to_main_params(self):
        model_data, main_data = self._get_model_and_main_params_data_float16()
        for model, main in zip(model_data, main_data):
            main.copy_(model)

    def state_dict(self) -> Dict:
        saved = {'optimizer': self.optimizer.state_dict()}
        if self.grad_scaler:
            saved['grad_scaler'] = self.grad_scaler.state_dict()
        saved['fp32_from_fp16_params'] = self.fp32_from_float16_groups
        return saved

    def load_state_dict(self, state_dict: Dict):
        optimizer_key = 'optimizer'
        if optimizer_key not in state_dict:
            optimizer_key = 'optimizer_state_dict'
            logger.info('***WARNING*** loading optimizer from an old checkpoint ...')
        self.optimizer.load_state_dict(state_dict[optimizer_key])

        if 'grad_scaler' not in state_dict and self.config.fp16:
            logger.info('***WARNING*** found an old checkpoint, will not load grad scaler ...')
        elif 'grad_scaler' in state_dict:
            if self.grad_scaler:
                self.grad_scaler.load_state_dict(state_dict['grad_scaler'])
            else:
                logger.info(
                    '***WARNING*** found the grad scaler in the checkpoint but it is None in the '
                    'class. Skipping loading grad scaler ...'
                )

        fp32_from_float16_params_key = 'fp32_from_fp16_params'
        if fp32_from_float16_params_key not in state_dict:
            fp32_from_float16_params_key = 'fp32_from_fp16'
        for current_group, saved_group in zip(
            self.fp32_from_float16_groups, state_dict[fp32_from_float16_params_key]
        ):
            if len(current_group) != len(saved_group):
                raise ValueError(
                    f'checkpoint has {len(saved_group)} fp32 main params in a group, the model '
                    f'has {len(current_group)}'
                )
            for current_param, saved_param in zip(current_group, saved_group):
                current_param.data.copy_(saved_param.data)


class FP32Optimizer(MegatronOptimizer):
    """Optimizer for fp32 models: the inner optimizer updates the model params directly.

    Args:
        optimizer: the inner torch optimizer over the model params.
        config: OptimizerConfig.
        init_state_fn: creates empty optimizer state.
    """

    def __init__(
        self, optimizer: torch.optim.Optimizer, config: OptimizerConfig, init_state_fn: Callable
    ):
        super().__init__(optimizer, config, init_state_fn)
        self._scale = torch.tensor([1.0], dtype=torch.float, device=get_current_device())

    def zero_grad(self, set_to_none: bool = True):
        for group in self.optimizer.param_groups:
            _zero_grad_group_helper(group['params'], set_to_none)

    def get_loss_scale(self) -> torch.Tensor:
        return self._scale

    @torch.no_grad()
    def prepare_grads(self) -> bool:
        with _timed(self.config, 'optimizer-copy-to-main-grad'):
            for param_group in self.optimizer.param_groups:
                for param in param_group['params']:
                    if hasattr(param, 'main_grad'):
                        param.grad = param.main_grad
        return False

    @torch.no_grad()
    def step_with_ready_grads(self) -> bool:
        with _timed(self.config, 'optimizer-inner-step'):
            self.optimizer.step()
        self._record_step()
        return True

    def reload_model_params(self):
        pass

    def state_dict(self) -> Dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: Dict):
        self.optimizer.load_state_dict(state_dict)


class ChainedOptimizer(MegatronOptimizer):
    """Several optimizers (e.g. dense and expert params) stepped as one.

    The gradient norm is the global norm over all of them; clipping uses that global norm; the
    step is skipped for all if any has inf/nan gradients.

    Args:
        chained_optimizers: the MegatronOptimizers to chain.
    """

    def __init__(self, chained_optimizers: List[MegatronOptimizer]):
        if len(chained_optimizers) == 0:
            raise ValueError('ChainedOptimizer needs at least one optimizer')
        self.chained_optimizers = chained_optimizers
        self.config = chained_optimizers[0].config
        self.optimizer = None

    @property
    def param_groups(self) -> List[dict]:
        return [group for optimizer in self.chained_optimizers for group in optimizer.param_groups]

    @property
    def state(self):
        # Keys are distinct params, so one merged dict is unambiguous.
        merged = {}
        for optimizer in self.chained_optimizers:
            merged.update(optimizer.state)
        return merged

    def get_parameters(self) -> List[torch.nn.Parameter]:
        params = []
        for optimizer in self.chained_optimizers:
            params += optimizer.get_parameters()
        return params

    def zero_grad(self, set_to_none: bool = True):
        for optimizer in self.chained_optimizers:
            optimizer.zero_grad(set_to_none)

    def get_loss_scale(self) -> torch.Tensor:
        return self.chained_optimizers[0].get_loss_scale()

    def reload_model_params(self):
        for optimizer in self.chained_optimizers:
            optimizer.reload_model_params()

    def state_dict(self) -> List[Dict]:
        return [optimizer.state_dict() for optimizer in self.chained_optimizers]

    def load_state_dict(self, state_dict: List[Dict]):
        if len(self.chained_optimizers) != len(state_dict):
            raise ValueError(
                f'Expected {len(self.chained_optimizers)} optimizer state dicts, '
                f'got {len(state_dict)}'
            )
        for optimizer, sd in zip(self.chained_optimizers, state_dict):
            optimizer.load_state_dict(sd)

    def sharded_state_dict(self, model_sharded_state_dict, is_loading: bool = False, **kwargs):
        """Sub-optimizer k under dict key k, every checkpoint key prefixed `chained_{k}.`."""
        from megatron.core.dist_checkpointing.utils import add_prefix_for_sharding

        state_dict = {}
        for index, optimizer in enumerate(self.chained_optimizers):
            sub = optimizer.sharded_state_dict(model_sharded_state_dict, is_loading, **kwargs)
            add_prefix_for_sharding(sub, f'chained_{index}.')
            state_dict[index] = sub
        return state_dict

    def load_sharded_state_dict(self, state_dict) -> None:
        for index, optimizer in enumerate(self.chained_optimizers):
            optimizer.load_sharded_state_dict(state_dict[index])

    def prepare_grads(self) -> bool:
        found_inf_flag = False
        for optimizer in self.chained_optimizers:
            # Every optimizer must prepare (and update its scaler), so no short-circuit.
            found_inf_flag = optimizer.prepare_grads() or found_inf_flag
        return found_inf_flag

    def step_with_ready_grads(self) -> bool:
        success = True
        for optimizer in self.chained_optimizers:
            success = optimizer.step_with_ready_grads() and success
        return success

    def get_grad_norm(self) -> float:
        norms = [optimizer.get_grad_norm() for optimizer in self.chained_optimizers]
        return math.sqrt(sum(n**2 for n in norms))

    def clip_grad_norm(self, clip_grad: float) -> float:
        grad_norm = self.get_grad_norm()
        for optimizer in self.chained_optimizers:
            clip_grad_by_total_norm_fp32(optimizer.get_parameters(), clip_grad, grad_norm)
        return grad_norm

    def count_zeros(self) -> float:
        return sum(optimizer.count_zeros() for optimizer in self.chained_optimizers)

    def save_parameter_state(self, filename: str):
        """Save the sharded parameter state of every distributed optimizer in the chain."""
        states = []
        save = False
        for optimizer in self.chained_optimizers:
            if hasattr(optimizer, 'get_parameter_state_dp_zero'):
                state = optimizer.get_parameter_state_dp_zero()
                save = save or state is not None
                states.append(state)
            else:
                states.append(None)
        if save:
            torch.save(states, filename)

    def get_parameter_state_shard(self) -> Dict:
        """This rank's parameter-state shard of every distributed optimizer (None for others)."""
        return {
            'chained': [
                optimizer.get_parameter_state_shard()
                if hasattr(optimizer, 'get_parameter_state_shard')
                else None
                for optimizer in self.chained_optimizers
            ]
        }

    def load_parameter_state_from_shards(
        self, shards: List[Dict], per_optimizer_shards: Optional[List[List[Dict]]] = None
    ):
        """Load every saved rank's `get_parameter_state_shard` into each distributed optimizer.

        `per_optimizer_shards` gives each optimizer its own list of saved shards (with expert
        parallelism the expert optimizer's data-parallel group is a subset of the dense one's).
        """
        for index, optimizer in enumerate(self.chained_optimizers):
            if hasattr(optimizer, 'load_parameter_state_from_shards'):
                own = shards if per_optimizer_shards is None else per_optimizer_shards[index]
                optimizer.load_parameter_state_from_shards([s['chained'][index] for s in own])

    def load_parameter_state(self, filename: str):
        """Load what `save_parameter_state` wrote into every distributed optimizer."""
        states = None
        for index, optimizer in enumerate(self.chained_optimizers):
            if not hasattr(optimizer, 'load_parameter_state_from_dp_zero'):
                continue
            if states is None and optimizer.is_dp_zero():
                states = weights_only_load(filename, what=filename, mmap=True)
            optimizer.load_parameter_state_from_dp_zero(
                states[index] if states is not None else None
            )
