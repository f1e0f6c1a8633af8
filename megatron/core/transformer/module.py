"""Base class of megatron-core modules and the fp16/bf16 wrapper."""

import operator

import torch
from torch.autograd import Variable

from megatron.core import parallel_state
from megatron.core.transformer.transformer_config import TransformerConfig

_FLOAT_TYPES = (torch.FloatTensor,)
_HALF_TYPES = (torch.HalfTensor,)
_BF16_TYPES = (torch.BFloat16Tensor,)


def param_is_not_shared(param: torch.nn.Parameter) -> bool:
    """False for a parameter marked `shared` (e.g. the last stage's copy of tied embeddings)."""
    return not getattr(param, "shared", False)


class MegatronModule(torch.nn.Module):
    """Base class of megatron-core modules: holds the config and the checkpoint-save hook.

    Args:
        config (TransformerConfig): the model config; modules read it and never modify it.
    """

    def __init__(self, config: TransformerConfig):
        super().__init__()
        self.config = config

    def state_dict_for_save_checkpoint(self, prefix: str = '', keep_vars: bool = False):
        """The state dict written to checkpoints (the plain state dict for mcore modules)."""
        return self.state_dict(prefix=prefix, keep_vars=keep_vars)

    def sharded_state_dict(self, prefix: str = '', sharded_offsets: tuple = (), metadata=None):
        """Distributed-checkpoint view of this module (see megatron/core/dist_checkpointing).

        Default: own parameters and buffers replicated over TP, `_extra_state` as objects, then
        every child's `sharded_state_dict` (plain torch children: replicated). Dict keys are the
        local state-dict names; the ShardedTensor keys are global (layout independent).

        Args:
            prefix: prepended to every key.
            sharded_offsets: (axis, offset, size) triples prepended to every tensor (layer axis,
                later an expert axis).
            metadata: options for subclasses (unused here).
        """
        from megatron.core.dist_checkpointing.utils import module_sharded_state_dict

        return module_sharded_state_dict(self, prefix, sharded_offsets, metadata)

    def set_is_first_microbatch(self):
        """Tell submodules that cache weights (fp8 in Transformer Engine) a new batch begins."""
        for m in self.modules():
            if hasattr(m, "is_first_microbatch"):
                m.is_first_microbatch = True


def conversion_helper(val, conversion):
    """Apply `conversion` to every leaf of nested tuples / lists (tuples come back as tuples)."""
    if not isinstance(val, (tuple, list)):
        return conversion(val)
    converted = [conversion_helper(item, conversion) for item in val]
    return tuple(converted) if isinstance(val, tuple) else converted


def _tensor_dtype(val):
    """The dtype of a tensor's data, or None when `val` is not a tensor."""
    data = val.data if isinstance(val, (torch.nn.parameter.Parameter, Variable)) else val
    return data.dtype if isinstance(data, torch.Tensor) else None


def fp32_to_float16(val, float16_convertor):
    """Convert fp32 tensors (only those) inside `val` with `float16_convertor`."""

    def down(leaf):
        return float16_convertor(leaf) if _tensor_dtype(leaf) == torch.float32 else leaf

    return conversion_helper(val, down)


def float16_to_fp32(val):
    """Convert fp16 / bf16 tensors (only those) inside `val` to fp32."""

    def up(leaf):
        return leaf.float() if _tensor_dtype(leaf) in (torch.float16, torch.bfloat16) else leaf

    return conversion_helper(val, up)


# (config flag, tensor / module method casting to that precision), in order of precedence.
_HALF_PRECISIONS = (('fp16', 'half'), ('bf16', 'bfloat16'))


class Float16Module(MegatronModule):
    """Run a module in fp16 or bf16: casts its parameters, its fp32 inputs on the first pipeline
    stage, and its outputs back to fp32 on the last stage.

    Args:
        config (TransformerConfig): config with `fp16` or `bf16` set.
        module (torch.nn.Module): the model to wrap (cast in place).
    """

    def __init__(self, config: TransformerConfig, module: torch.nn.Module):
        super().__init__(config)
        self.fp16 = config.fp16
        self.bf16 = config.bf16
        cast = next((method for flag, method in _HALF_PRECISIONS if getattr(self, flag)), None)
        if cast is None:
            raise ValueError(
                "Float16Module needs config.fp16 or config.bf16 to be True (both are False)"
            )
        # The parameters are cast in place; inputs are cast per call with the same method.
        self.add_module('module', getattr(module, cast)())
        self.float16_convertor = operator.methodcaller(cast)

    def set_input_tensor(self, input_tensor):
        """Forward the pipeline input tensor to the wrapped module."""
        return self.module.set_input_tensor(input_tensor)

    def forward(self, *inputs, **kwargs):
        """Run the wrapped module: fp32 inputs are cast down on the first pipeline stage (later
        stages receive half-precision activations), outputs cast up on the last one."""
        if parallel_state.is_pipeline_first_stage():
            inputs = fp32_to_float16(inputs, self.float16_convertor)
        result = self.module(*inputs, **kwargs)
        return float16_to_fp32(result) if parallel_state.is_pipeline_last_stage() else result

    # The wrapper adds no state of its own: checkpoints hold the wrapped module's keys.

    def state_dict(self, destination=None, prefix='', keep_vars=False):
        """Delegates to the wrapped module (no `module.` prefix)."""
        return self.module.state_dict(prefix=prefix, keep_vars=keep_vars, destination=destination)

    def state_dict_for_save_checkpoint(self, prefix='', keep_vars=False):
        """Delegates to the wrapped module."""
        return self.module.state_dict_for_save_checkpoint(prefix=prefix, keep_vars=keep_vars)

    def load_state_dict(self, state_dict, strict=True):
        """Delegates to the wrapped module."""
        return self.module.load_state_dict(state_dict, strict=strict)

    def sharded_state_dict(self, prefix='', sharded_offsets=(), metadata=None):
        """Delegates to the wrapped module."""
        return self.module.sharded_state_dict(prefix, sharded_offsets, metadata)
