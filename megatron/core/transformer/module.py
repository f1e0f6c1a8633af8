"""Base class of megatron-core modules and the fp16/bf16 wrapper."""

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
    """Apply `conversion` to every leaf of nested tuples / lists."""
    if not isinstance(val, (tuple, list)):
        return conversion(val)
    rtn = [conversion_helper(v, conversion) for v in val]
    if isinstance(val, tuple):
        rtn = tuple(rtn)
    return rtn


def fp32_to_float16(val, float16_convertor):
    """Convert fp32 tensors (only those) inside `val` with `float16_convertor`."""

    def half_conversion(val):
        val_typecheck = val
        if isinstance(val_typecheck, (torch.nn.parameter.Parameter, Variable)):
            val_typecheck = val.data
        if isinstance(val_typecheck, torch.Tensor) and val_typecheck.dtype == torch.float32:
            val = float16_convertor(val)
        return val

    return conversion_helper(val, half_conversion)


def float16_to_fp32(val):
    """Convert fp16 / bf16 tensors (only those) inside `val` to fp32."""

    def float_conversion(val):
        val_typecheck = val
        if isinstance(val_typecheck, (torch.nn.parameter.Parameter, Variable)):
            val_typecheck = val.data
        if isinstance(val_typecheck, torch.Tensor) and val_typecheck.dtype in (
            torch.float16,
            torch.bfloat16,
        ):
            val = val.float()
        return val

    return conversion_helper(val, float_conversion)


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

        if self.fp16:
            self.add_module('module', module.half())

            def float16_convertor(val):
                return val.half()

        elif self.bf16:
            self.add_module('module', module.bfloat16())

            def float16_convertor(val):
                return val.bfloat16()

        else:
            raise ValueError(
                "Float16Module needs config.fp16 or config.bf16 to be True (both are False)"
            )

        self.float16_convertor = float16_convertor

    def set_input_tensor(self, input_tensor):
        """Forward the pipeline input tensor to the wrapped module."""
        return self.module.set_input_tensor(input_tensor)

    def forward(self, *inputs, **kwargs):
        if parallel_state.is_pipeline_first_stage():
            inputs = fp32_to_float16(inputs, self.float16_convertor)
        outputs = self.module(*inputs, **kwargs)
        if parallel_state.is_pipeline_last_stage():
            outputs = float16_to_fp32(outputs)
        return outputs

    def state_dict(self, destination=None, prefix='', keep_vars=False):
        return self.module.state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)

    def state_dict_for_save_checkpoint(self, prefix='', keep_vars=False):
        """Delegates to the wrapped module."""
        return self.module.state_dict_for_save_checkpoint(prefix=prefix, keep_vars=keep_vars)

    def load_state_dict(self, state_dict, strict=True):
        return self.module.load_state_dict(state_dict, strict=strict)

    def sharded_state_dict(self, prefix='', sharded_offsets=(), metadata=None):
        """Delegates to the wrapped module."""
        return self.module.sharded_state_dict(prefix, sharded_offsets, metadata)
