"""Distributed optimizer: fp32 main params and optimizer state sharded over data parallelism.

Layout. `DistributedDataParallel` (with `use_distributed_optimizer`) keeps each gradient buffer
as buckets whose sizes divide by the data-parallel size DP. Data-parallel rank r owns the r-th
contiguous 1/DP of every bucket. For every parameter overlapping its shards the rank keeps

- the fp32 main copy of just the overlapping slice (for fp32 params: a view of the model param),
- the optimizer state (Adam's exp_avg / exp_avg_sq) of that slice,

so optimizer memory per rank is divided by DP. One step:

1. gradients are reduce-scattered over DP (by DDP's buckets): rank r receives the averaged
   gradients of its shard, in the shard's slice of `param.main_grad`;
2. those slices become the fp32 `.grad` of the shard main params, are unscaled / checked for
   inf (fp16), and the global norm (over all ranks) is clipped;
3. the inner optimizer updates the shard main params; they are copied into DDP's parameter
   buffer (cast to the model dtype);
4. each bucket's parameter buffer is all-gathered over DP so every rank has the full update
   (with `overlap_param_gather` asynchronously: DDP's forward pre-hooks wait for each bucket just
   before a module uses its parameters, and the next step / checkpoint calls wait for all).

Checkpointing. `state_dict()` holds only the param-group hyperparameters and the loss scaler.
The sharded tensors (main params and optimizer state) are saved either per rank
(`get_parameter_state_shard`: each DP rank its own shards, no collective; loading copies the
overlapping saved ranges into each rank's new shard) or, in Megatron's legacy single-file
layout, by `save_parameter_state`: data parallel rank 0 gathers every bucket (without end
padding) and writes one file; loading scatters it back. Because only bucket-end padding depends
on DP, either can be loaded at a different DP size as long as the bucket layout (model, bucket
size) is the same.
"""

import itertools
import logging
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Union

import torch

from .. import tensor_parallel
from ..dist_checkpointing.optimizer import optimizer_state_keys as _state_keys
from ..dist_checkpointing.safe_load import weights_only_load
from ..distributed.param_and_grad_buffer import ParamAndGradBuffer
from .grad_scaler import MegatronGradScaler
from .optimizer import _FLOAT16_DTYPES, MixedPrecisionOptimizer, _timed, _zero_grad_group_helper
from .optimizer_config import OptimizerConfig

logger = logging.getLogger(__name__)

#: Format tag written into parameter-state files.
PARAMETER_STATE_FORMAT = 'megatron-distrib-optim-parameter-state-v1'
#: Format tag of one data-parallel rank's own parameter-state shard.
PARAMETER_STATE_SHARD_FORMAT = 'megatron-distrib-optim-parameter-state-shard-v1'


@dataclass(frozen=True)
class Range:
    """A half-open index range [start, end)."""

    start: int
    end: int

    @property
    def size(self) -> int:
        return self.end - self.start

    def normalize(self, start: int = 0) -> 'Range':
        """The same size, shifted to begin at `start`."""
        return Range(start, start + self.size)


class DistributedOptimizer(MixedPrecisionOptimizer):
    """Optimizer whose fp32 main params and state are sharded across the data-parallel group.

    Args:
        optimizer: the inner torch optimizer built over the model params (its param groups are
            replaced by this rank's shard main params).
        config: OptimizerConfig.
        grad_scaler: loss scaler (fp16) or None.
        init_state_fn: creates zero optimizer state for every param of the inner optimizer.
        per_model_buffers: the DDP `ParamAndGradBuffer`s of every model chunk, as a dict
            {model index: [buffers]} or a list of lists.
        data_parallel_group: the group the buffers are sharded over.
        data_parallel_group_gloo: gloo copy of it (CPU collectives for checkpointing).
        data_parallel_group_idx: global rank of this rank (identifies the group, unused here).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        config: OptimizerConfig,
        grad_scaler: Optional[MegatronGradScaler],
        init_state_fn: Optional[Callable],
        per_model_buffers: Union[
            Dict[int, List[ParamAndGradBuffer]], List[List[ParamAndGradBuffer]]
        ],
        data_parallel_group: torch.distributed.ProcessGroup,
        data_parallel_group_gloo: Optional[torch.distributed.ProcessGroup] = None,
        data_parallel_group_idx: Optional[int] = None,
    ):
        super().__init__(optimizer, config, grad_scaler, init_state_fn)
        if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)):
            raise TypeError(
                f'DistributedOptimizer supports Adam/AdamW and SGD, got {type(optimizer).__name__}'
            )
        if isinstance(per_model_buffers, dict):
            per_model_buffers = [per_model_buffers[k] for k in sorted(per_model_buffers)]
        self.buffers: List[ParamAndGradBuffer] = list(itertools.chain(*per_model_buffers))
        if not self.buffers:
            raise ValueError(
                'DistributedOptimizer needs the DDP grad buffers: wrap the model in '
                'DistributedDataParallel with use_distributed_optimizer=True'
            )
        for buffer in self.buffers:
            if buffer.param_data is None:
                raise ValueError(
                    'DistributedOptimizer needs DistributedDataParallelConfig('
                    'use_distributed_optimizer=True) (the DDP parameter buffer is missing)'
                )
        self.data_parallel_group = data_parallel_group
        self.data_parallel_group_gloo = data_parallel_group_gloo
        self.data_parallel_group_idx = data_parallel_group_idx
        self.data_parallel_world_size = torch.distributed.get_world_size(group=data_parallel_group)
        self.data_parallel_rank = torch.distributed.get_rank(group=data_parallel_group)

        # param -> {'gbuf_world': Range in the buffer, 'gbuf_local': Range in this rank's bucket
        # shard, 'param': Range inside the flattened param}; param -> (buffer index, bucket index).
        self.param_range_map: Dict[torch.nn.Parameter, Dict[str, Range]] = {}
        self.model_param_gbuf_map: Dict[torch.nn.Parameter, tuple] = {}
        # Per buffer, per bucket: this rank's shard Range in the buffer.
        self.bucket_shard_ranges: List[List[Range]] = []
        for gbuf_index, buffer in enumerate(self.buffers):
            shard_ranges = []
            for bucket_index, bucket in enumerate(buffer.buckets):
                numel = bucket.grad_data.numel()
                assert numel % self.data_parallel_world_size == 0
                shard_size = numel // self.data_parallel_world_size
                shard = Range(
                    bucket.offset + self.data_parallel_rank * shard_size,
                    bucket.offset + (self.data_parallel_rank + 1) * shard_size,
                )
                shard_ranges.append(shard)
                for param in bucket.params_list:
                    param_start, param_end, _ = buffer.param_index_map[param]
                    start = max(param_start, shard.start)
                    end = min(param_end, shard.end)
                    if end <= start:
                        continue
                    world = Range(start, end)
                    self.param_range_map[param] = {
                        'gbuf_world': world,
                        'gbuf_local': Range(start - shard.start, end - shard.start),
                        'param': Range(start - param_start, end - param_start),
                    }
                    self.model_param_gbuf_map[param] = (gbuf_index, bucket_index)
            self.bucket_shard_ranges.append(shard_ranges)

        all_buffer_params = set()
        for buffer in self.buffers:
            all_buffer_params.update(buffer.param_index_map.keys())

        # Replace each optimizer group's params by this rank's shards.
        self.model_float16_groups = []
        self.model_fp32_groups = []
        self.shard_float16_groups = []
        self.shard_fp32_groups = []
        self.shard_fp32_from_float16_groups = []
        for param_group in self.optimizer.param_groups:
            model_float16, model_fp32 = [], []
            shard_float16, shard_fp32, shard_fp32_from_float16 = [], [], []
            for model_param in param_group['params']:
                if model_param not in all_buffer_params:
                    raise ValueError(
                        'DistributedOptimizer: an optimizer parameter is not in any DDP grad '
                        'buffer (build the optimizer from the DDP-wrapped model chunks)'
                    )
                if model_param not in self.param_range_map:
                    continue  # another data-parallel rank owns all of it
                param_range = self.param_range_map[model_param]['param']
                flat = model_param.detach().view(-1)
                if model_param.dtype in _FLOAT16_DTYPES:
                    shard_model_param = flat[param_range.start : param_range.end]
                    shard_main_param = shard_model_param.clone().float()
                    for tensor in (shard_model_param, shard_main_param):
                        tensor_parallel.copy_tensor_model_parallel_attributes(tensor, model_param)
                        if hasattr(model_param, 'shared'):
                            tensor.shared = model_param.shared
                    model_float16.append(model_param)
                    shard_float16.append(shard_model_param)
                    shard_fp32_from_float16.append(shard_main_param)
                elif model_param.dtype == torch.float32:
                    # A view: the optimizer updates the model's parameter buffer in place.
                    shard_model_param = flat[param_range.start : param_range.end]
                    tensor_parallel.copy_tensor_model_parallel_attributes(
                        shard_model_param, model_param
                    )
                    if hasattr(model_param, 'shared'):
                        shard_model_param.shared = model_param.shared
                    model_fp32.append(model_param)
                    shard_fp32.append(shard_model_param)
                else:
                    raise TypeError(
                        'Wrapped parameters must be one of torch.float32, torch.float16 or '
                        f'torch.bfloat16. Received {model_param.dtype}'
                    )
            self.model_float16_groups.append(model_float16)
            self.model_fp32_groups.append(model_fp32)
            self.shard_float16_groups.append(shard_float16)
            self.shard_fp32_groups.append(shard_fp32)
            self.shard_fp32_from_float16_groups.append(shard_fp32_from_float16)
            param_group['params'] = [*shard_fp32, *shard_fp32_from_float16]
        if config.optimizer_cpu_offload:
            from .cpu_offload import offload_main_params

            offload_main_params(self, config.optimizer_offload_fraction)
        self.optimizer.state.clear()

    # ------------------------------------------------------------------ groups and grads

    def get_model_parallel_group(self):
        """None (the world): shards of one DP group are distinct, so norms sum over everything."""
        return None

    def zero_grad(self, set_to_none: bool = True):
        for groups in (
            self.model_float16_groups,
            self.model_fp32_groups,
            self.shard_float16_groups,
            self.shard_fp32_groups,
            self.shard_fp32_from_float16_groups,
        ):
            for group in groups:
                _zero_grad_group_helper(group, set_to_none)

    def _collect_main_grad_data_for_unscaling(self) -> List[torch.Tensor]:
        return [
            param.grad.data
            for group in self.optimizer.param_groups
            for param in group['params']
            if param.grad is not None
        ]

    def _copy_model_grads_to_main_grads(self):
        """This rank's reduced slice of each `main_grad` -> fp32 `.grad` of the shard params."""

        def copy_group_grads(model_groups, shard_main_groups):
            for model_group, shard_main_group in zip(model_groups, shard_main_groups):
                for model_param, shard_main_param in zip(model_group, shard_main_group):
                    param_range = self.param_range_map[model_param]['param']
                    model_grad = model_param.main_grad
                    shard_model_grad = model_grad.view(-1)[param_range.start : param_range.end]
                    # To the host for a main param that optimizer_cpu_offload keeps there.
                    shard_main_param.grad = shard_model_grad.to(
                        device=shard_main_param.device, dtype=torch.float32
                    )

        copy_group_grads(self.model_float16_groups, self.shard_fp32_from_float16_groups)
        copy_group_grads(self.model_fp32_groups, self.shard_fp32_groups)

    def _copy_main_params_to_model_params(self):
        """Updated shard main params -> this rank's shard of DDP's parameter buffer."""
        for model_group, shard_main_group in zip(
            self.model_float16_groups, self.shard_fp32_from_float16_groups
        ):
            for model_param, shard_main_param in zip(model_group, shard_main_group):
                world_range = self.param_range_map[model_param]['gbuf_world']
                gbuf_index, _ = self.model_param_gbuf_map[model_param]
                param_buffer = self.buffers[gbuf_index].param_data
                param_buffer[world_range.start : world_range.end].copy_(shard_main_param)
        # fp32 shards are views of the parameter buffer: already updated in place.

    def _copy_model_params_to_main_params(self):
        """Model params -> shard main params (after loading model weights)."""
        self._finish_param_syncs()
        for model_group, shard_main_group in zip(
            self.model_float16_groups, self.shard_fp32_from_float16_groups
        ):
            for model_param, shard_main_param in zip(model_group, shard_main_group):
                param_range = self.param_range_map[model_param]['param']
                shard_main_param.data.copy_(
                    model_param.detach().view(-1)[param_range.start : param_range.end]
                )

    def _gather_model_params(self, async_op: bool = False):
        """All-gather every bucket's parameter shards over the data-parallel group.

        With `async_op` (overlap_param_gather) the gathers run in the background; DDP's forward
        pre-hooks wait for each bucket just before its parameters are used.
        """
        for buffer in self.buffers:
            buffer.start_param_sync(async_op=async_op)

    def _finish_param_syncs(self):
        """Wait for outstanding (overlapped) parameter all-gathers."""
        for buffer in self.buffers:
            buffer.finish_param_sync()

    def finish_param_sync(self, model_index: int = None, *unused):
        """Wait for the overlapped parameter all-gathers (Megatron's param_sync_func hook)."""
        self._finish_param_syncs()

    @torch.no_grad()
    def prepare_grads(self) -> bool:
        # The parameter buffer must be complete before this step writes into it again.
        self._finish_param_syncs()
        return super().prepare_grads()

    @torch.no_grad()
    def step_with_ready_grads(self) -> bool:
        update_successful = super().step_with_ready_grads()
        with _timed(self.config, 'params-all-gather'):
            self._gather_model_params(async_op=self.config.overlap_param_gather)
        return update_successful

    # ------------------------------------------------------------------ checkpointing

    def _shard_main_params_with_model_params(self):
        """(model param, shard main param) pairs of this rank."""
        pairs = []
        for model_groups, shard_groups in (
            (self.model_fp32_groups, self.shard_fp32_groups),
            (self.model_float16_groups, self.shard_fp32_from_float16_groups),
        ):
            for model_group, shard_group in zip(model_groups, shard_groups):
                pairs.extend(zip(model_group, shard_group))
        return pairs

    def _ensure_state(self):
        """Create zero optimizer state for every shard param that has none yet."""
        if self.init_state_fn is not None:
            self.init_state_fn(self.optimizer)
        for group in self.optimizer.param_groups:
            if 'step' in group:
                for param in group['params']:
                    if 'step' in self.optimizer.state.get(param, {}):
                        self.optimizer.state[param]['step'] = torch.tensor(
                            float(group['step']), dtype=torch.float32
                        )

    def state_dict(self) -> Dict:
        """Param-group hyperparameters and the loss scaler; tensors go to save_parameter_state."""
        inner_state_dict = self.optimizer.state_dict()
        state_dict = {'optimizer': {k: v for k, v in inner_state_dict.items() if k != 'state'}}
        for param_group in state_dict['optimizer']['param_groups']:
            del param_group['params']
        if self.grad_scaler:
            state_dict['grad_scaler'] = self.grad_scaler.state_dict()
        return state_dict

    def load_state_dict(self, state_dict: Dict):
        """Restore hyperparameters and the loss scaler; then call load_parameter_state."""
        saved_groups = state_dict['optimizer']['param_groups']
        if len(saved_groups) != len(self.optimizer.param_groups):
            raise ValueError(
                f'checkpoint has {len(saved_groups)} optimizer param groups, the model has '
                f'{len(self.optimizer.param_groups)}'
            )
        for group, saved in zip(self.optimizer.param_groups, saved_groups):
            group.update({k: v for k, v in saved.items() if k != 'params'})
        self._ensure_state()
        if 'grad_scaler' not in state_dict:
            if self.config.fp16:
                logger.info('***WARNING*** found an old checkpoint, will not load grad scaler ...')
        elif self.grad_scaler:
            self.grad_scaler.load_state_dict(state_dict['grad_scaler'])

    def sharded_state_dict(
        self,
        model_sharded_state_dict,
        is_loading: bool = False,
        sharding_type: str = 'fully_sharded_model_space',
        **kwargs,
    ):
        """Distributed-checkpoint view: `fully_sharded_model_space` (each DP rank its own
        ranges, keyed and shaped like the model parameters) or `dp_zero_gather_scatter` (gathered
        on DP rank 0); see megatron/core/dist_checkpointing/optimizer.py."""
        from megatron.core.dist_checkpointing.optimizer import distributed_sharded_state_dict

        return distributed_sharded_state_dict(
            self, model_sharded_state_dict, is_loading, sharding_type
        )

    def load_sharded_state_dict(self, state_dict: Dict) -> None:
        """Finish a distributed-checkpoint load (the model-space state was filled in place;
        a dp_zero state is scattered here, collectively)."""
        from megatron.core.dist_checkpointing.optimizer import restore_after_sharded_load

        restore_after_sharded_load(self, state_dict)
        self._ensure_state()
        if state_dict.get('param_state_sharding_type') == 'dp_zero_gather_scatter':
            self.load_parameter_state_from_dp_zero(state_dict.get('param_state'))

    def _gloo_group(self):
        if self.data_parallel_group_gloo is not None:
            return self.data_parallel_group_gloo
        if torch.distributed.get_backend(self.data_parallel_group) == 'gloo':
            return self.data_parallel_group
        raise ValueError('DistributedOptimizer checkpointing needs data_parallel_group_gloo')

    def is_dp_zero(self) -> bool:
        """True on the data-parallel rank that writes / reads parameter-state files."""
        return self.data_parallel_rank == 0

    def _layout(self) -> List[Dict]:
        return [
            {
                'param_dtype': str(buffer.param_dtype),
                'grad_dtype': str(buffer.grad_dtype),
                'per_bucket_numel_unpadded': [b.numel_unpadded for b in buffer.buckets],
            }
            for buffer in self.buffers
        ]

    def _local_bucket_state(self, gbuf_index, bucket_index, keys, main_of) -> Dict:
        """This rank's shard of one bucket as flat fp32 tensors per key ('param' + state keys)."""
        bucket = self.buffers[gbuf_index].buckets[bucket_index]
        shard_size = self.bucket_shard_ranges[gbuf_index][bucket_index].size
        local = {key: torch.zeros(shard_size, dtype=torch.float32) for key in keys}
        for model_param in bucket.params_list:
            if model_param not in main_of:
                continue
            main_param = main_of[model_param]
            local_range = self.param_range_map[model_param]['gbuf_local']
            tensors = {'param': main_param}
            tensors.update(self.optimizer.state.get(main_param, {}))
            for key in keys:
                value = tensors.get(key)
                if value is not None:
                    local[key][local_range.start : local_range.end] = value.detach().float().cpu()
        return local

    def _set_local_bucket_state(self, gbuf_index, bucket_index, key, local, main_of) -> bool:
        """Copy one key of this rank's flat bucket shard `local` into main params / state.

        Returns whether, for key 'param', every model param of the bucket already held the
        loaded main values (cast to its dtype) on this rank's shard: true when the model weights
        were loaded from the same checkpoint. Always true for the other keys.
        """
        bucket = self.buffers[gbuf_index].buckets[bucket_index]
        model_agrees = True
        for model_param in bucket.params_list:
            if model_param not in main_of:
                continue
            main_param = main_of[model_param]
            local_range = self.param_range_map[model_param]['gbuf_local']
            values = local[local_range.start : local_range.end]
            if key == 'param':
                # Compared before the copy: fp32 main shards are views of the model params.
                param_range = self.param_range_map[model_param]['param']
                model_shard = model_param.detach().view(-1)[param_range.start : param_range.end]
                model_agrees = model_agrees and torch.equal(
                    model_shard, values.to(device=model_shard.device, dtype=model_shard.dtype)
                )
                target = main_param
            else:
                param_state = self.optimizer.state[main_param]
                if param_state.get(key) is None:
                    param_state[key] = torch.zeros_like(main_param)
                target = param_state[key]
            target.data.copy_(values.to(device=target.device, dtype=target.dtype))
        return model_agrees

    def _sync_model_params_after_load(self, model_agrees: bool):
        """Make every rank's model params follow the loaded main params.

        When every rank found its shard of the model params already equal to the loaded main
        params (the model weights came from the same checkpoint, which is saved after the
        parameter all-gather), the model params are right everywhere and the all-gather of the
        whole parameter buffer, the costliest part of a load, is skipped. One scalar all-reduce
        over the data-parallel group decides, so that all ranks take the same branch.
        """
        agree = torch.tensor([1 if model_agrees else 0], dtype=torch.int32)
        torch.distributed.all_reduce(
            agree, op=torch.distributed.ReduceOp.MIN, group=self._gloo_group()
        )
        if int(agree.item()) == 1:
            return
        self._copy_main_params_to_model_params()
        self._gather_model_params()

    def get_parameter_state_shard(self) -> Dict:
        """This data-parallel rank's own fp32 main params and optimizer state (no collective).

        Returns {'format', 'state_keys', 'data_parallel_world_size', 'data_parallel_rank',
        'buffers': [{'param_dtype', 'grad_dtype', 'per_bucket_numel_unpadded', 'param': [flat
        shard per bucket], '<state key>': [...]}]}: bucket b's shard of rank r covers bucket
        elements [r * S, (r + 1) * S) with S its length (the last shard includes end padding).
        Every rank writes its own file, so saving costs no gather.
        """
        self._finish_param_syncs()
        self._ensure_state()
        keys = ['param'] + _state_keys(self.optimizer)
        main_of = dict(self._shard_main_params_with_model_params())
        buffers_out = self._layout()
        for gbuf_index, buffer in enumerate(self.buffers):
            per_key = {key: [] for key in keys}
            for bucket_index in range(len(buffer.buckets)):
                local = self._local_bucket_state(gbuf_index, bucket_index, keys, main_of)
                for key in keys:
                    per_key[key].append(local[key])
            buffers_out[gbuf_index].update(per_key)
        return {
            'format': PARAMETER_STATE_SHARD_FORMAT,
            'state_keys': keys[1:],
            'data_parallel_world_size': self.data_parallel_world_size,
            'data_parallel_rank': self.data_parallel_rank,
            'buffers': buffers_out,
        }

    def load_parameter_state_from_shards(self, shards: List[Dict]):
        """Load the shards written by `get_parameter_state_shard` at any data-parallel size.

        `shards` holds the shard of every saved DP rank (in any order; memory-mapped tensors are
        best: each rank copies only the saved ranges overlapping its own new shard, so no rank
        reads whole files). No collective until the final parameter all-gather. Raises
        ValueError (on every rank alike, since all read the same files) when the shards are
        incomplete or their bucket layout / state kind does not match this model and optimizer.
        """
        self._finish_param_syncs()
        self._ensure_state()
        keys = ['param'] + _state_keys(self.optimizer)
        by_rank = {}
        for shard in shards:
            problem = self._check_parameter_state(shard, keys, PARAMETER_STATE_SHARD_FORMAT)
            if problem:
                raise ValueError(problem)
            by_rank.setdefault(shard['data_parallel_rank'], shard)
        saved_dp = shards[0]['data_parallel_world_size'] if shards else 0
        if sorted(by_rank) != list(range(saved_dp)) or any(
            s['data_parallel_world_size'] != saved_dp for s in by_rank.values()
        ):
            raise ValueError(
                f'parameter-state shards of data-parallel ranks {sorted(by_rank)} do not make up '
                f'a data-parallel size of {saved_dp}'
            )
        main_of = dict(self._shard_main_params_with_model_params())
        model_agrees = True
        for gbuf_index, buffer in enumerate(self.buffers):
            for bucket_index, bucket in enumerate(buffer.buckets):
                size = self.bucket_shard_ranges[gbuf_index][bucket_index].size
                lo = self.data_parallel_rank * size
                hi = min(lo + size, bucket.numel_unpadded)
                for key in keys:
                    if saved_dp == self.data_parallel_world_size:
                        # Same DP size: the saved shard is this rank's shard (a memory-mapped view).
                        saved = by_rank[self.data_parallel_rank]['buffers'][gbuf_index][key]
                        local = saved[bucket_index]
                        assert local.numel() == size
                        model_agrees &= self._set_local_bucket_state(
                            gbuf_index, bucket_index, key, local, main_of
                        )
                        continue
                    local = torch.zeros(size, dtype=torch.float32)
                    for rank in range(saved_dp):
                        saved = by_rank[rank]['buffers'][gbuf_index][key][bucket_index]
                        start = rank * saved.numel()
                        a, b = max(lo, start), min(hi, start + saved.numel())
                        if a < b:
                            local[a - lo : b - lo] = saved[a - start : b - start]
                    model_agrees &= self._set_local_bucket_state(
                        gbuf_index, bucket_index, key, local, main_of
                    )
        self._sync_model_params_after_load(model_agrees)

    def get_parameter_state_dp_zero(self) -> Optional[Dict]:
        """Gather the sharded fp32 main params and optimizer state on data-parallel rank 0.

        Collective over the data-parallel group. Returns, on DP rank 0 only (None elsewhere):
        {'format', 'state_keys', 'data_parallel_world_size', 'buffers': [{'param_dtype',
        'grad_dtype', 'per_bucket_numel_unpadded', 'param': [fp32 tensor per bucket],
        '<state key>': [...]}]} with every bucket's tensors unpadded.
        """
        self._finish_param_syncs()
        self._ensure_state()
        group = self._gloo_group()
        dst = torch.distributed.get_global_rank(group, 0)
        keys = ['param'] + _state_keys(self.optimizer)
        pairs = self._shard_main_params_with_model_params()
        main_of = {model_param: main_param for model_param, main_param in pairs}

        buffers_out = self._layout() if self.is_dp_zero() else None
        for gbuf_index, buffer in enumerate(self.buffers):
            per_key = {key: [] for key in keys}
            for bucket_index, bucket in enumerate(buffer.buckets):
                local = self._local_bucket_state(gbuf_index, bucket_index, keys, main_of)
                for key in keys:
                    gather_list = None
                    if self.is_dp_zero():
                        gather_list = [
                            torch.empty_like(local[key])
                            for _ in range(self.data_parallel_world_size)
                        ]
                    torch.distributed.gather(local[key], gather_list, dst=dst, group=group)
                    if self.is_dp_zero():
                        per_key[key].append(torch.cat(gather_list)[: bucket.numel_unpadded].clone())
            if self.is_dp_zero():
                buffers_out[gbuf_index].update(per_key)

        if not self.is_dp_zero():
            return None
        return {
            'format': PARAMETER_STATE_FORMAT,
            'state_keys': keys[1:],
            'data_parallel_world_size': self.data_parallel_world_size,
            'buffers': buffers_out,
        }

    def save_parameter_state(self, filename: str):
        """Save the fp32 main params and optimizer state of all DP ranks to one file (DP rank 0).

        Collective over the data-parallel group; only DP rank 0 writes `filename`.
        """
        state = self.get_parameter_state_dp_zero()
        if self.is_dp_zero():
            torch.save(state, filename)

    def load_parameter_state_from_dp_zero(self, state: Optional[Dict]):
        """Scatter a gathered parameter state (given on DP rank 0) into this rank's shards.

        Collective over the data-parallel group. Raises ValueError on every rank when the saved
        bucket layout or optimizer state kind does not match this model and optimizer.
        """
        self._finish_param_syncs()
        self._ensure_state()
        group = self._gloo_group()
        src = torch.distributed.get_global_rank(group, 0)
        keys = ['param'] + _state_keys(self.optimizer)

        # Validate on DP rank 0 and share the verdict, so that no rank is left in a collective.
        verdict = [None]
        if self.is_dp_zero():
            verdict[0] = self._check_parameter_state(state, keys)
        torch.distributed.broadcast_object_list(verdict, src=src, group=group)
        if verdict[0]:
            raise ValueError(verdict[0])

        main_of = dict(self._shard_main_params_with_model_params())
        model_agrees = True
        for gbuf_index, buffer in enumerate(self.buffers):
            for bucket_index, bucket in enumerate(buffer.buckets):
                shard_size = self.bucket_shard_ranges[gbuf_index][bucket_index].size
                for key in keys:
                    local = torch.empty(shard_size, dtype=torch.float32)
                    scatter_list = None
                    if self.is_dp_zero():
                        world = torch.zeros(
                            shard_size * self.data_parallel_world_size, dtype=torch.float32
                        )
                        saved = state['buffers'][gbuf_index][key][bucket_index]
                        world[: saved.numel()] = saved
                        scatter_list = list(world.chunk(self.data_parallel_world_size))
                    torch.distributed.scatter(local, scatter_list, src=src, group=group)
                    model_agrees &= self._set_local_bucket_state(
                        gbuf_index, bucket_index, key, local, main_of
                    )
        # Model params follow their (possibly fp32-from-fp16) main params.
        self._sync_model_params_after_load(model_agrees)

    def _check_parameter_state(self, state, keys, fmt=PARAMETER_STATE_FORMAT) -> Optional[str]:
        """Why `state` cannot be loaded here, or None."""
        if not isinstance(state, dict) or state.get('format') != fmt:
            return (
                'not a DistributedOptimizer parameter-state file (format tag missing or different)'
            )
        if ['param'] + list(state['state_keys']) != keys:
            return (
                f"parameter-state file holds optimizer state {state['state_keys']}, this optimizer "
                f"needs {keys[1:]}"
            )
        layout = self._layout()
        if len(state['buffers']) != len(layout):
            return (
                f"parameter-state file has {len(state['buffers'])} grad buffers, "
                f"the model has {len(layout)}"
            )
        for index, (saved, current) in enumerate(zip(state['buffers'], layout)):
            for field in ('param_dtype', 'grad_dtype', 'per_bucket_numel_unpadded'):
                if saved[field] != current[field]:
                    return (
                        f"parameter-state file buffer {index} has {field}={saved[field]}, "
                        f"the model has {field}={current[field]} "
                        f"(same model and bucket size required)"
                    )
        return None

    def load_parameter_state(self, filename: str):
        """Load a file written by `save_parameter_state` (any data-parallel size).

        Collective over the data-parallel group; only DP rank 0 reads `filename`.
        """
        state = None
        if self.is_dp_zero():
            # Memory-mapped: each bucket's shards are read from the page cache as they are sent.
            state = weights_only_load(filename, what=filename, mmap=True)
        self.load_parameter_state_from_dp_zero(state)
