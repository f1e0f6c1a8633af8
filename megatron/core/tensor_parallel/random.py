"""Model-parallel RNG states and activation checkpointing that replays them.

Tensor parallel ranks need two kinds of randomness: the same stream on every tp rank for
activations that are replicated (dropout after a row-parallel layer), and a different stream per
tp rank for activations and weights that are split (dropout inside attention, per-partition
init). The default generator serves the first kind; `CudaRNGStatesTracker` keeps named extra
states for the second, and `fork(name)` swaps one in temporarily.

The "cuda" in the names is Megatron's: the tracker drives the default generator of the current
device, i.e. the CUDA generator on a GPU and the CPU generator when there is no GPU.
"""

import contextlib
from typing import Dict, Optional

import torch
from torch.utils.checkpoint import detach_variable

from megatron.core import parallel_state
from megatron.core.tensor_parallel.utils import (
    gather_split_1d_tensor,
    split_tensor_into_1d_equal_chunks,
)
from megatron.core.utils import safely_set_viewless_tensor_data, uses_cuda

# Default name for the model parallel rng tracker.
_MODEL_PARALLEL_RNG_TRACKER_NAME = 'model-parallel-rng'
_EXPERT_PARALLEL_RNG_TRACKER_NAME = 'expert-parallel-rng'
_DATA_PARALLEL_RNG_TRACKER_NAME = 'data-parallel-rng'


def _device_rng_is_cuda() -> bool:
    return uses_cuda()


def _get_cuda_rng_state() -> torch.Tensor:
    """State of the current device's default generator (CUDA if available, else CPU)."""
    if _device_rng_is_cuda():
        return torch.cuda.get_rng_state()
    return torch.get_rng_state()


def _set_cuda_rng_state(new_state: torch.Tensor, device: int = -1) -> None:
    """Set the current device's default generator state (CUDA if available, else CPU).

    Args:
        new_state: a state returned by `_get_cuda_rng_state()` / `torch.cuda.get_rng_state()`.
        device: CUDA device index; -1 means the current device. Ignored on CPU.
    """
    if not _device_rng_is_cuda():
        torch.set_rng_state(new_state)
        return
    if isinstance(device, int):
        idx = torch.cuda.current_device() if device == -1 else device
    else:
        idx = torch.device(device).index  # a device or its name, e.g. 'cuda:1'
        idx = torch.cuda.current_device() if idx is None else idx
    default_generator = torch.cuda.default_generators[idx]
    default_generator.set_state(new_state)


def _device_manual_seed(seed: int) -> None:
    if _device_rng_is_cuda():
        torch.cuda.manual_seed(seed)
    else:
        torch.manual_seed(seed)


def get_expert_parallel_rng_tracker_name() -> str:
    """Tracker name of the expert parallel RNG state."""
    return _EXPERT_PARALLEL_RNG_TRACKER_NAME


def get_data_parallel_rng_tracker_name() -> str:
    """Tracker name of the data parallel RNG state."""
    return _DATA_PARALLEL_RNG_TRACKER_NAME


def _copy_state(state):
    return state.clone() if isinstance(state, torch.Tensor) else state


class CudaRNGStatesTracker:
    """Named RNG states that can be swapped into the device's default generator.

    `add(name, seed)` creates a state, `fork(name)` runs a block with it and stores the advanced
    state back, so successive forks continue one stream per name. Works with the CPU generator
    when there is no GPU.
    """

    def __init__(self):
        self.reset()

    def is_initialized(self) -> bool:
        """Whether any state has been added since the last reset."""
        return self._is_initialized

    def reset(self) -> None:
        """Forget every state and seed."""
        self._is_initialized = False
        self.states_: Dict[str, torch.Tensor] = {}
        self.seeds_ = set()

    def get_states(self) -> Dict[str, torch.Tensor]:
        """A copy of the name -> state dict (for checkpoints); tensor states are cloned."""
        return {name: _copy_state(state) for name, state in self.states_.items()}

    def set_states(self, states: Dict[str, torch.Tensor]) -> None:
        """Replace the states (from get_states()); seeds are not restored.

        Any value is kept as given (Megatron stores whatever it is handed, e.g. a number in its
        unit tests); tensors are cloned so the caller's copy cannot be advanced by a fork.
        """
        self._is_initialized = True
        self.states_ = {name: _copy_state(state) for name, state in states.items()}

    def add(self, name: str, seed: int) -> None:
        """Create the state `name` from `seed`, leaving the default generator untouched.

        Raises:
            ValueError: the seed or the name is already used.
        """
        self._is_initialized = True
        if seed in self.seeds_:
            raise ValueError(f'RNG seed {seed} already exists in the tracker')
        if name in self.states_:
            raise ValueError(f'RNG state {name!r} already exists in the tracker')
        self.seeds_.add(seed)
        orig_rng_state = _get_cuda_rng_state()
        _device_manual_seed(seed)
        self.states_[name] = _get_cuda_rng_state()
        _set_cuda_rng_state(orig_rng_state)

    @contextlib.contextmanager
    def fork(self, name: str = _MODEL_PARALLEL_RNG_TRACKER_NAME):
        """Run the block with the state `name` in the default generator, then swap back.

        Raises:
            KeyError: `name` was never added (call model_parallel_cuda_manual_seed()).
        """
        if name not in self.states_:
            raise KeyError(
                f'RNG state {name!r} is not in the tracker; call '
                'megatron.core.tensor_parallel.model_parallel_cuda_manual_seed(seed) first'
            )
        orig_rng_state = _get_cuda_rng_state()
        _set_cuda_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = _get_cuda_rng_state()
            _set_cuda_rng_state(orig_rng_state)


_CUDA_RNG_STATE_TRACKER: Optional[CudaRNGStatesTracker] = None
_CUDA_RNG_STATE_TRACKER_INITIALIZED = False


def initialize_rng_tracker(use_te_rng_tracker: bool = False) -> None:
    """Create the global tracker once (Transformer Engine's tracker is not available here)."""
    global _CUDA_RNG_STATE_TRACKER, _CUDA_RNG_STATE_TRACKER_INITIALIZED
    if _CUDA_RNG_STATE_TRACKER_INITIALIZED:
        return
    if use_te_rng_tracker:
        raise ValueError(
            'use_te_rng_tracker=True needs Transformer Engine, which is not supported here'
        )
    _CUDA_RNG_STATE_TRACKER = CudaRNGStatesTracker()
    _CUDA_RNG_STATE_TRACKER_INITIALIZED = True


def get_cuda_rng_tracker(use_te_rng_tracker: bool = False) -> CudaRNGStatesTracker:
    """The global RNG states tracker."""
    initialize_rng_tracker(use_te_rng_tracker)
    return _CUDA_RNG_STATE_TRACKER


def model_parallel_cuda_manual_seed(seed: int) -> None:
    """Seed the default generator and the tracker's model parallel streams.

    - default generator: `seed` (the same on every tp rank: replicated activations);
    - 'model-parallel-rng': seed + 2718 + tp_rank (different per tp rank: split activations,
      per-partition weight init);
    - 'expert-parallel-rng': seed + 1024 + 100 * ep_rank + tp_rank;
    - 'data-parallel-rng': seed.

    Call after initialize_model_parallel(). On GPU only the CUDA generator is seeded (as in
    Megatron); on CPU the CPU generator plays its role.
    """
    offset = seed + 2718
    tensor_model_parallel_seed = offset + parallel_state.get_tensor_model_parallel_rank()
    data_parallel_seed = seed

    initialize_rng_tracker()
    _CUDA_RNG_STATE_TRACKER.reset()
    _device_manual_seed(data_parallel_seed)
    _CUDA_RNG_STATE_TRACKER.add(_DATA_PARALLEL_RNG_TRACKER_NAME, data_parallel_seed)
    _CUDA_RNG_STATE_TRACKER.add(_MODEL_PARALLEL_RNG_TRACKER_NAME, tensor_model_parallel_seed)
    expert_parallel_seed = (
        seed
        + 1024
        + 100 * parallel_state.get_expert_model_parallel_rank()
        + parallel_state.get_tensor_model_parallel_rank()
    )
    _CUDA_RNG_STATE_TRACKER.add(_EXPERT_PARALLEL_RNG_TRACKER_NAME, expert_parallel_seed)


class CheckpointFunction(torch.autograd.Function):
    """Activation checkpointing that replays the RNG streams during recomputation.

    Forward runs `run_function` without storing activations and remembers the CPU, device and
    tracker RNG states; backward restores them, recomputes the forward with grad enabled (so
    dropout masks are identical), back-propagates and puts the current RNG states back.
    With `distribute_saved_activations`, the saved first input is split into tp-size 1-D chunks
    (each rank keeps one) and all-gathered again before recomputation.
    """

    @staticmethod
    def forward(ctx, run_function, distribute_saved_activations, *args):
        ctx.run_function = run_function
        ctx.distribute_saved_activations = distribute_saved_activations
        # Every RNG the recomputation must replay: CPU, device and the tracker's streams.
        ctx.fwd_cpu_rng_state, ctx.fwd_cuda_rng_state, ctx.fwd_cuda_rng_state_tracker = (
            torch.get_rng_state(),
            _get_cuda_rng_state(),
            get_cuda_rng_tracker().get_states(),
        )
        with torch.no_grad():  # no activations kept: backward recomputes them
            outputs = run_function(*args)

        # Divide the saved first input among the tp ranks: it is gathered back in backward.
        if distribute_saved_activations:
            ctx.input_0_shape = args[0].data.shape
            safely_set_viewless_tensor_data(
                args[0], split_tensor_into_1d_equal_chunks(args[0].data, new_buffer=True)
            )

        ctx.save_for_backward(*args)
        return outputs

    @staticmethod
    def backward(ctx, *args):
        if not torch.autograd._is_checkpoint_valid():
            raise RuntimeError(
                'Checkpointing is not compatible with .grad(), please use .backward() if possible'
            )
        inputs = ctx.saved_tensors
        if ctx.distribute_saved_activations:
            safely_set_viewless_tensor_data(
                inputs[0], gather_split_1d_tensor(inputs[0].data).view(ctx.input_0_shape)
            )

        # The RNG states now (to be put back) and the forward's (replayed for recomputation).
        bwd_cpu_rng_state = torch.get_rng_state()
        bwd_cuda_rng_state = _get_cuda_rng_state()
        bwd_cuda_rng_state_tracker = get_cuda_rng_tracker().get_states()

        torch.set_rng_state(ctx.fwd_cpu_rng_state)
        _set_cuda_rng_state(ctx.fwd_cuda_rng_state)
        get_cuda_rng_tracker().set_states(ctx.fwd_cuda_rng_state_tracker)

        detached_inputs = detach_variable(inputs)
        try:
            with torch.enable_grad():
                outputs = ctx.run_function(*detached_inputs)
        finally:
            torch.set_rng_state(bwd_cpu_rng_state)
            _set_cuda_rng_state(bwd_cuda_rng_state)
            get_cuda_rng_tracker().set_states(bwd_cuda_rng_state_tracker)

        if isinstance(outputs, torch.Tensor):
            outputs = (outputs,)

        # Only outputs that take part in the graph get a gradient.
        outputs_with_grad, args_with_grad = [], []
        for out, grad in zip(outputs, args):
            if isinstance(out, torch.Tensor) and out.requires_grad:
                outputs_with_grad.append(out)
                args_with_grad.append(grad)
        if not outputs_with_grad:
            raise RuntimeError('none of the checkpointed outputs requires grad')
        torch.autograd.backward(outputs_with_grad, args_with_grad)
        grads = tuple(inp.grad if isinstance(inp, torch.Tensor) else inp for inp in detached_inputs)
        return (None, None) + grads


def checkpoint(function, distribute_saved_activations: bool, *args):
    """Run `function(*args)` without keeping its activations; recompute them in backward.

    RNG states are replayed, so dropout inside `function` draws the same masks in the
    recomputation and the gradients equal those of the plain call.

    Args:
        function: the block to checkpoint; takes and returns tensors.
        distribute_saved_activations: split the saved first input across the tp ranks.
        *args: the block's inputs.
    """
    return CheckpointFunction.apply(function, distribute_saved_activations, *args)
