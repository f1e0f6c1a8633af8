"""The Mamba-2 mixer (`MambaMixer`) in plain PyTorch, split across tensor-parallel ranks.

Notation: s sequence, b batch, H hidden size, d_inner = nh * P (nh heads of size P), G groups of
state size N, K conv width, tp the tensor-parallel size; `_l` = this rank's share (divided by
tp). conv_dim = d_inner + 2 * G * N (the x, B, C channels).

Forward (training and prefill):
1. in_proj = fused pre-norm + column-parallel linear: [s, b, H] -> [s, b, P_in_l], read as
   z (d_inner_l) | x (d_inner_l) | B (G_l * N) | C (G_l * N) | dt (nh_l);
2. depthwise causal conv (width K, bias) over x | B | C, then SiLU;
3. dt = softplus(dt + dt_bias) (fp32, no clamp), A = -exp(A_log);
4. the SSD scan (ssd_scan.py), plus the D skip D_h * x;
5. y * SiLU(z), then an RMS norm over each group of d_inner / G channels (eps 1e-5, fp32);
6. out_proj, row-parallel: [s, b, d_inner_l] -> [s, b, H] (all-reduce over tp, or
   reduce-scatter to [s/tp, b, H] under sequence parallelism).

Tensor parallelism: rank r owns heads [r * nh_l, (r + 1) * nh_l) and groups
[r * G_l, (r + 1) * G_l); a group never spans two ranks (G % tp == 0), so the conv, the scan
and the grouped norm are local. in_proj's rows on rank r are the r-th slice of *each* segment
(z_r | x_r | B_r | C_r | dt_r), and the conv's channels the r-th slice of x, B and C: a global
weight is sharded per segment (`split_in_proj` / `split_conv`), never in contiguous blocks.

Context parallelism (CP size P, training only): this rank's in_proj output holds s/P positions
(the dual-chunk layout of attention, of each row or of each packed sequence); steps 2-4 run on
the full sequence for nh_l / P heads after an all-to-all over the CP group, and the result
returns to this rank's positions before the norm (mamba_context_parallel.py).
"""

import math
from contextlib import nullcontext
from dataclasses import dataclass
from typing import List, Optional, Union

import torch
import torch.nn.functional as F
from torch import Tensor

from megatron.core.inference_params import RecurrentState
from megatron.core.process_groups_config import ProcessGroupCollection, resolve_process_groups
from megatron.core.ssm.causal_conv1d import (
    causal_conv1d,
    causal_conv1d_step,
    conv_state_from_prefill,
)
from megatron.core.ssm.mamba_context_parallel import (
    MambaContextParallel,
    check_mamba_cp_dims,
    packed_segment_ids,
)
from megatron.core.ssm.ssd_scan import ssd_chunked_scan
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import get_current_device

#: The mixer's gated norm epsilon (hard-coded in Megatron, not --norm-epsilon).
GATED_NORM_EPS = 1e-5


@dataclass
class MambaMixerSubmodules:
    """Specs of the mixer's two linears."""

    in_proj: Union[ModuleSpec, type] = None
    out_proj: Union[ModuleSpec, type] = None


def mamba_dims(config: TransformerConfig, d_model: int, expand: int = 2) -> dict:
    """Global sizes of a mixer: d_inner, nheads, headdim, ngroups, d_state, conv_dim, in_proj."""
    headdim = config.mamba_head_dim
    nheads = config.mamba_num_heads or (expand * d_model) // headdim
    d_inner = nheads * headdim
    ngroups, d_state = config.mamba_num_groups, config.mamba_state_dim
    conv_dim = d_inner + 2 * ngroups * d_state
    return dict(
        d_inner=d_inner,
        nheads=nheads,
        headdim=headdim,
        ngroups=ngroups,
        d_state=d_state,
        conv_dim=conv_dim,
        in_proj=conv_dim + d_inner + nheads,
    )


def check_mamba_dims(
    config: TransformerConfig, d_model: int, tp_size: int, cp_size: int = 1
) -> None:
    """One-line ValueErrors for mixer sizes the TP / CP split or the scan cannot take."""
    dims = mamba_dims(config, d_model)
    nheads, ngroups = dims['nheads'], dims['ngroups']
    if not config.mamba_num_heads and (2 * d_model) % config.mamba_head_dim != 0:
        raise ValueError(
            f"2 * hidden_size ({2 * d_model}) must be divisible by mamba_head_dim "
            f"({config.mamba_head_dim})"
        )
    if nheads % ngroups != 0:
        raise ValueError(
            f"Mamba heads ({nheads}) must be divisible by mamba_num_groups ({ngroups})"
        )
    if nheads % tp_size != 0:
        raise ValueError(
            f"Mamba heads ({nheads}) must be divisible by tensor_model_parallel_size ({tp_size})"
        )
    if ngroups % tp_size != 0:
        raise ValueError(
            f"mamba_num_groups ({ngroups}) must be divisible by tensor_model_parallel_size "
            f"({tp_size})"
        )
    check_mamba_cp_dims(nheads // tp_size, ngroups // tp_size, cp_size, tp_size)


def segment_sizes(config: TransformerConfig, d_model: int) -> List[int]:
    """Global in_proj segment sizes [z, x, B, C, dt]."""
    d = mamba_dims(config, d_model)
    gn = d['ngroups'] * d['d_state']
    return [d['d_inner'], d['d_inner'], gn, gn, d['nheads']]


def split_in_proj(weight: Tensor, sizes: List[int], tp_size: int, rank: int) -> Tensor:
    """This rank's in_proj rows of a global weight: the rank-th slice of every segment."""
    return _split_segments(weight, sizes, tp_size, rank)


def split_conv(tensor: Tensor, sizes: List[int], tp_size: int, rank: int) -> Tensor:
    """This rank's conv channels (weight or bias) of a global tensor: sizes = [x, B, C]."""
    return _split_segments(tensor, sizes, tp_size, rank)


def _split_segments(tensor: Tensor, sizes: List[int], tp_size: int, rank: int) -> Tensor:
    parts = torch.split(tensor, sizes, dim=0)
    return torch.cat([part.chunk(tp_size, dim=0)[rank] for part in parts], dim=0)


def merge_segments(shards: List[Tensor], sizes: List[int]) -> Tensor:
    """The inverse of `_split_segments`: per-rank tensors -> the global one."""
    tp_size = len(shards)
    local = [size // tp_size for size in sizes]
    pieces = [torch.split(shard, local, dim=0) for shard in shards]
    return torch.cat([torch.cat([p[i] for p in pieces], dim=0) for i in range(len(sizes))], dim=0)


def _rng_fork():
    """The model-parallel RNG stream when seeded (so tp ranks draw different shards)."""
    tracker = get_cuda_rng_tracker()
    return tracker.fork() if tracker.is_initialized() else nullcontext()


class MambaMixer(MegatronModule):
    """Mamba-2 (SSD) token mixer, tensor-parallel over heads (see the module docstring).

    Parameters (this rank): in_proj.weight [P_in_l, H], in_proj.layer_norm_weight [H],
    conv1d.weight [conv_dim_l, 1, K], conv1d.bias [conv_dim_l], dt_bias / A_log / D [nh_l],
    norm.weight [d_inner_l], out_proj.weight [H, d_inner_l].

    Initialization (Megatron core_r0.8.0's scheme): in_proj and conv weights uniform in
    +-1/sqrt(fan_in) (kaiming_uniform with a = sqrt(5)), conv bias likewise, out_proj
    N(0, init_method_std / sqrt(num_layers)), dt_bias = softplus^-1(dt) with dt log-uniform in
    [dt_min, dt_max] (floored at dt_init_floor), A_log = log U(A_init_range), D = 1, norm
    weight 1. Drawn under the model-parallel RNG stream.

    Args:
        config (TransformerConfig): sizes (mamba_* fields), normalization, dtype, init.
        submodules (MambaMixerSubmodules): in_proj / out_proj classes.
        d_model: H.
        d_conv: K.
        expand: d_inner / H when config.mamba_num_heads is None.
        layer_number: 1-based global layer number (keys the inference cache).
        chunk_size: chunk length of the scan.
        pg_collection: groups (tp splits the mixer; under cp > 1 the conv and the scan run on
            the full sequence for nh_l / cp heads, see mamba_context_parallel.py).
    """

    def __init__(
        self,
        config: TransformerConfig,
        submodules: MambaMixerSubmodules,
        d_model: int,
        d_conv: int = 4,
        conv_init: Optional[float] = None,
        expand: int = 2,
        A_init_range=(1, 16),
        D_has_hdim: bool = False,
        dt_min: float = 0.001,
        dt_max: float = 0.1,
        dt_init_floor: float = 1e-4,
        conv_bias: bool = True,
        chunk_size: int = 128,
        layer_number: Optional[int] = None,
        pg_collection: Optional[ProcessGroupCollection] = None,
    ):
        super().__init__(config=config)
        self.pg_collection = resolve_process_groups(pg_collection, ("tp", "cp"))
        tp_size = self.pg_collection.tp.size()
        cp_size = self.pg_collection.cp.size()
        check_mamba_dims(config, d_model, tp_size, cp_size)
        dims = mamba_dims(config, d_model, expand)
        self.d_model = d_model
        self.d_conv = d_conv
        self.chunk_size = chunk_size
        self.layer_number = layer_number
        self.headdim, self.d_state = dims['headdim'], dims['d_state']
        self.d_inner_l = dims['d_inner'] // tp_size
        self.nheads_l = dims['nheads'] // tp_size
        self.ngroups_l = dims['ngroups'] // tp_size
        self.conv_dim_l = dims['conv_dim'] // tp_size
        self.group_size = dims['d_inner'] // dims['ngroups']
        self.segment_sizes = segment_sizes(config, d_model)
        self.cp = None
        if cp_size > 1:
            self.cp = MambaContextParallel(
                self.pg_collection.cp,
                self.d_inner_l,
                self.nheads_l,
                self.ngroups_l,
                self.d_state,
                self.headdim,
            )
        device = get_current_device()
        factory = dict(device=device, dtype=config.params_dtype)
        num_layers = config.num_layers

        def in_proj_init(weight):
            bound = 1.0 / math.sqrt(d_model)
            return torch.nn.init.uniform_(weight, -bound, bound)

        def out_proj_init(weight):
            return torch.nn.init.normal_(
                weight, 0.0, config.init_method_std / math.sqrt(num_layers)
            )

        self.in_proj = build_module(
            submodules.in_proj,
            d_model,
            dims['in_proj'],
            config=config,
            init_method=in_proj_init,
            bias=False,
            skip_bias_add=False,
            gather_output=False,
            tp_group=self.pg_collection.tp,
        )
        self.conv1d = torch.nn.Conv1d(
            self.conv_dim_l,
            self.conv_dim_l,
            kernel_size=d_conv,
            groups=self.conv_dim_l,
            padding=d_conv - 1,
            bias=conv_bias,
            **factory,
        )
        nh = self.nheads_l
        self.dt_bias = torch.nn.Parameter(torch.empty(nh, **factory))
        self.A_log = torch.nn.Parameter(torch.empty(nh, device=device, dtype=torch.float32))
        d_size = self.d_inner_l if D_has_hdim else nh
        self.D = torch.nn.Parameter(torch.ones(d_size, device=device, dtype=torch.float32))
        self.norm = _GroupedGatedRMSNorm(self.d_inner_l, self.group_size, **factory)
        if config.perform_initialization:
            with _rng_fork(), torch.no_grad():
                bound = conv_init if conv_init is not None else 1.0 / math.sqrt(d_conv)
                self.conv1d.weight.uniform_(-bound, bound)
                if self.conv1d.bias is not None:
                    self.conv1d.bias.uniform_(-bound, bound)
                u = torch.rand(nh, device=device, dtype=config.params_dtype).float()
                dt = torch.exp(u * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min))
                dt = dt.clamp(min=dt_init_floor)
                self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))
                self.A_log.copy_(torch.log(torch.empty_like(self.A_log).uniform_(*A_init_range)))
        for param in (self.conv1d.weight, self.conv1d.bias, self.dt_bias, self.A_log, self.D):
            if param is not None:
                set_tensor_model_parallel_attributes(param, True, 0, 1)
        set_tensor_model_parallel_attributes(self.norm.weight, True, 0, 1)
        self.out_proj = build_module(
            submodules.out_proj,
            self.d_inner_l * tp_size,
            d_model,
            config=config,
            init_method=out_proj_init,
            bias=False,
            input_is_parallel=True,
            skip_bias_add=True,
            tp_group=self.pg_collection.tp,
        )

    def sharded_state_dict(self, prefix: str = '', sharded_offsets: tuple = (), metadata=None):
        """Distributed checkpoint with TP-invariant per-segment keys (in_proj.weight.z/.x/.B/
        .C/.dt, conv1d.weight.x/.B/.C, ...; see mamba_sharded_state_dict.py)."""
        from megatron.core.ssm.mamba_sharded_state_dict import mixer_sharded_state_dict

        return mixer_sharded_state_dict(self, prefix, sharded_offsets, metadata)

    def _split_projection(self, zxbcdt: Tensor):
        """[b, s, P_in_l] -> z [b, s, d_inner_l], xBC [b, s, conv_dim_l], dt [b, s, nh_l]."""
        return torch.split(zxbcdt, [self.d_inner_l, self.conv_dim_l, self.nheads_l], dim=-1)

    def _scan_inputs(self, xbc: Tensor, dt: Tensor, heads: Optional[slice] = None, ngroups=None):
        """Post-conv xBC [b, s, conv_dim] and raw dt -> x, B, C (head/group views), dt, A.

        `heads` / `ngroups`: a slice of this TP rank's heads and its group count (CP head
        shares); None: all nh_l heads and G_l groups."""
        heads = slice(None) if heads is None else heads
        ngroups = self.ngroups_l if ngroups is None else ngroups
        dt_bias, A_log = self.dt_bias[heads], self.A_log[heads]
        b, s = xbc.shape[:2]
        gn = ngroups * self.d_state
        x, B, C = torch.split(xbc, [xbc.shape[-1] - 2 * gn, gn, gn], dim=-1)
        x = x.reshape(b, s, dt_bias.numel(), self.headdim)  # [b, s, nh_l, P]
        B = B.reshape(b, s, ngroups, self.d_state)  # [b, s, G_l, N]
        C = C.reshape(b, s, ngroups, self.d_state)
        dt = F.softplus(dt.float() + dt_bias.float())  # [b, s, nh_l]
        A = -torch.exp(A_log.float())  # [nh_l]
        return x, B, C, dt, A

    def _d_skip(self, x: Tensor, heads: Optional[slice] = None) -> Tensor:
        """D * x for x [b, s, nh, P] (D per head, or per channel with D_has_hdim); `heads`:
        the slice of this TP rank's heads x holds (None: all)."""
        D = self.D.float()
        if D.numel() == self.nheads_l:
            D = D if heads is None else D[heads]
            return x.float() * D[:, None]
        D = D.view(self.nheads_l, self.headdim)
        return x.float() * (D if heads is None else D[heads])

    def forward(
        self,
        hidden_states: Tensor,
        inference_params=None,
        seq_idx: Optional[Tensor] = None,
        packed_seq_params=None,
    ):
        """hidden_states [s, b, H] ([s/tp, b, H] under SP) -> (out [s, b, H] (or [s/tp, b, H]),
        None).

        Args:
            inference_params (InferenceParams): conv / SSM state cache; tokens after the first
                call (sequence_len_offset > 0) are decoded one position at a time. The dynamic
                engine's DynamicInferenceContext (one packed row of many requests' tokens)
                keeps one state per request slot instead (`_dynamic_step`).
            seq_idx: [b, s] document ids of packed sequences (the conv and scan do not cross
                document boundaries); None: one document per row. Under context parallelism
                [b, s/cp]: this rank's dual-chunk slice of the global ids (whole-row layout).
            packed_seq_params (PackedSeqParams): read under context parallelism only (then
                seq_idx must be None): packed sequences split per sequence (--sft); the conv
                and the scan restart at the segments of the whole sequence. Without CP the
                caller passes their seq_idx instead.
        """
        if self.cp is not None and inference_params is not None:
            raise ValueError(
                f"--context-parallel-size ({self.cp.size}) > 1 is not supported for Mamba "
                "inference (context parallelism is a training layout): use 1"
            )
        zxbcdt, _ = self.in_proj(hidden_states)  # [s, b, P_in_l]
        zxbcdt = zxbcdt.transpose(0, 1)  # [b, s, P_in_l]
        dynamic = inference_params is not None and inference_params.is_dynamic_batching()
        cache = None if dynamic else self._cache(inference_params, zxbcdt.shape[0])
        if dynamic:
            y = self._dynamic_step(zxbcdt, inference_params)
        elif cache is not None and inference_params.sequence_len_offset > 0:
            y = self._decode(zxbcdt, *cache)
        else:
            y = self._full_sequence(zxbcdt, seq_idx, cache, packed_seq_params)
        y = y.transpose(0, 1).contiguous()  # [s, b, d_inner_l]
        out, out_bias = self.out_proj(y)
        return out, out_bias

    def _full_sequence(
        self, zxbcdt: Tensor, seq_idx: Optional[Tensor], cache, packed_seq_params=None
    ) -> Tensor:
        """Training / prefill over the whole sequence: [b, s, P_in_l] -> [b, s, d_inner_l]."""
        b, s = zxbcdt.shape[:2]
        z, xbc, dt = self._split_projection(zxbcdt)
        if self.cp is not None:
            y = self._full_sequence_cp(z, xbc, dt, seq_idx, packed_seq_params)
            return y.to(zxbcdt.dtype)
        xbc_t = xbc.transpose(1, 2)  # [b, conv_dim_l, s]
        if cache is not None:
            cache[0].copy_(conv_state_from_prefill(xbc_t, self.d_conv))
        conv = causal_conv1d(xbc_t, self.conv1d.weight, self.conv1d.bias, seq_idx)
        xbc = F.silu(conv).transpose(1, 2)  # [b, s, conv_dim_l]
        x, B, C, dt, A = self._scan_inputs(xbc, dt)
        y, final_state = ssd_chunked_scan(
            x, dt, A, B, C, chunk_size=self.chunk_size, seq_idx=seq_idx
        )  # [b, s, nh_l, P]
        if cache is not None:
            cache[1].copy_(final_state)
        y = y + self._d_skip(x)
        y = y.reshape(b, s, self.d_inner_l)  # [b, s, d_inner_l]
        return self.norm(y, z).to(zxbcdt.dtype)

    def _full_sequence_cp(
        self, z: Tensor, xbc: Tensor, dt: Tensor, seq_idx, packed_seq_params=None
    ) -> Tensor:
        """Training under context parallelism: z [b, s/P, d_inner_l], xbc [b, s/P, conv_dim_l],
        dt [b, s/P, nh_l] of this rank's tokens -> [b, s/P, d_inner_l]; the conv, scan and D
        skip see the whole sequence for this rank's head share. The tokens are this rank's
        dual chunks of each row, or of each packed sequence with `packed_seq_params`."""
        cp = self.cp
        b, s_local = xbc.shape[:2]
        offsets = None
        if packed_seq_params is not None:
            if seq_idx is not None:
                raise ValueError(
                    "give the Mamba mixer seq_idx or packed_seq_params under context "
                    "parallelism, not both"
                )
            offsets = packed_seq_params.segment_offsets()
        order, inverse = cp.exchange_order(b, s_local, xbc.device, offsets)
        xbc, dt = cp.seq_to_heads(xbc, dt, order)  # [b, s, conv_dim_c], [b, s, nh_c]
        if offsets is not None:
            seq_idx = packed_segment_ids(offsets, b, s_local, cp.size)  # [b, s]
        elif seq_idx is not None:
            seq_idx = cp.gather_seq_idx(seq_idx, order)  # [b, s]
        channels = cp.conv_channels(xbc.device)
        weight = self.conv1d.weight.index_select(0, channels)  # [conv_dim_c, 1, K]
        bias = None if self.conv1d.bias is None else self.conv1d.bias.index_select(0, channels)
        conv = causal_conv1d(xbc.transpose(1, 2), weight, bias, seq_idx)  # [b, conv_dim_c, s]
        xbc = F.silu(conv).transpose(1, 2)  # [b, s, conv_dim_c]
        heads = cp.head_slice()
        x, B, C, dt, A = self._scan_inputs(xbc, dt, heads, cp.ngroups_c)
        y, _ = ssd_chunked_scan(x, dt, A, B, C, chunk_size=self.chunk_size, seq_idx=seq_idx)
        y = y + self._d_skip(x, heads)  # [b, s, nh_c, P] fp32
        y = cp.heads_to_seq(y.reshape(*y.shape[:2], cp.d_inner_c), inverse)  # [b, s/P, d_l]
        return self.norm(y, z)

    def _continue_sequence(self, zxbcdt: Tensor, conv_state: Tensor, ssm_state: Tensor) -> Tensor:
        """Several positions after a cached state (a prompt chunk, or a whole prompt from zero
        states): [b, n, P_in_l] -> [b, n, d_inner_l] by the chunked scan from ssm_state; both
        states [b, ...] are advanced in place."""
        b, n = zxbcdt.shape[:2]
        z, xbc, dt = self._split_projection(zxbcdt)
        # The last K - 1 cached inputs precede the chunk: its first outputs see them.
        xbc_t = torch.cat([conv_state[..., 1:].to(xbc.dtype), xbc.transpose(1, 2)], dim=-1)
        conv = causal_conv1d(xbc_t, self.conv1d.weight, self.conv1d.bias)[..., self.d_conv - 1 :]
        conv_state.copy_(xbc_t[..., -self.d_conv :])
        xbc = F.silu(conv).transpose(1, 2)  # [b, n, conv_dim_l]
        x, B, C, dt, A = self._scan_inputs(xbc, dt)
        y, final_state = ssd_chunked_scan(
            x, dt, A, B, C, chunk_size=self.chunk_size, initial_state=ssm_state
        )  # [b, n, nh_l, P]
        ssm_state.copy_(final_state)
        y = (y + self._d_skip(x)).reshape(b, n, self.d_inner_l)
        return self.norm(y, z).to(zxbcdt.dtype)

    def _dynamic_step(self, zxbcdt: Tensor, context) -> Tensor:
        """A packed step of the dynamic engine: zxbcdt [1, T, P_in_l] of many requests ->
        [1, T, d_inner_l]. Requests continuing with one token are stepped together from their
        slots' states (gathered, stepped, scattered back); each other chunk is scanned from its
        request's state (zeros for a chunk starting at position 0)."""
        conv_pool, ssm_pool = context.mamba_states(
            self.layer_number,
            (self.conv_dim_l, self.d_conv),
            self.conv1d.weight.dtype,
            (self.nheads_l, self.headdim, self.d_state),
            zxbcdt.device,
        )
        out = zxbcdt.new_empty(1, zxbcdt.shape[1], self.d_inner_l)
        positions, slots = context.mamba_decode_rows
        if positions.numel() > 0:
            conv_state = conv_pool.index_select(0, slots)  # [n, conv_dim_l, K]
            ssm_state = ssm_pool.index_select(0, slots)  # [n, nh_l, P, N]
            rows = zxbcdt[0].index_select(0, positions)[:, None]  # [n, 1, P_in_l]
            y = self._decode(rows, conv_state, ssm_state)  # [n, 1, d_inner_l]
            conv_pool.index_copy_(0, slots, conv_state)
            ssm_pool.index_copy_(0, slots, ssm_state)
            out[0].index_copy_(0, positions, y[:, 0])
        for q_start, q_end, slot, fresh in context.mamba_chunk_rows:
            conv_state, ssm_state = conv_pool[slot : slot + 1], ssm_pool[slot : slot + 1]
            if fresh:
                conv_state.zero_()
                ssm_state.zero_()
            out[:, q_start:q_end] = self._continue_sequence(
                zxbcdt[:, q_start:q_end], conv_state, ssm_state
            )
        return out

    def _decode(self, zxbcdt: Tensor, conv_state: Tensor, ssm_state: Tensor) -> Tensor:
        """Positions after the cached ones, one at a time: [b, s, P_in_l] -> [b, s, d_inner_l]."""
        outputs = []
        for t in range(zxbcdt.shape[1]):
            z, xbc, dt = self._split_projection(zxbcdt[:, t : t + 1])
            conv = causal_conv1d_step(xbc[:, 0], conv_state, self.conv1d.weight, self.conv1d.bias)
            xbc = F.silu(conv)[:, None]  # [b, 1, conv_dim_l]
            x, B, C, dt, A = self._scan_inputs(xbc, dt)
            heads = self.nheads_l // self.ngroups_l
            B = B[:, 0].float().repeat_interleave(heads, dim=1)  # [b, nh_l, N]
            C = C[:, 0].float().repeat_interleave(heads, dim=1)
            x0, dt0 = x[:, 0].float(), dt[:, 0]  # [b, nh_l, P], [b, nh_l]
            decay = torch.exp(dt0 * A)[..., None, None]  # [b, nh_l, 1, 1]
            update = (dt0[..., None] * x0)[..., None] * B[:, :, None, :]  # [b, nh_l, P, N]
            ssm_state.copy_(decay * ssm_state + update)
            y = torch.einsum('bhpn,bhn->bhp', ssm_state, C)[:, None]  # [b, 1, nh_l, P]
            y = (y + self._d_skip(x)).reshape(-1, 1, self.d_inner_l)
            outputs.append(self.norm(y, z).to(zxbcdt.dtype))
        return torch.cat(outputs, dim=1)

    def _cache(self, inference_params, batch: int):
        """(conv_state [b, conv_dim_l, K], ssm_state [b, nh_l, P, N] fp32) of this layer's rows
        [batch_size_offset, + b) in inference_params, allocated on first use; None in
        training."""
        if inference_params is None:
            return None
        if self.config.sequence_parallel:
            raise ValueError("Mamba inference does not support sequence_parallel")
        memory = inference_params.key_value_memory_dict
        rows = inference_params.max_batch_size
        states = memory.get(self.layer_number)
        if states is None or states[0].shape[0] != rows:
            device = self.conv1d.weight.device
            states = RecurrentState(
                torch.zeros(
                    rows,
                    self.conv_dim_l,
                    self.d_conv,
                    device=device,
                    dtype=self.conv1d.weight.dtype,
                ),
                torch.zeros(
                    rows,
                    self.nheads_l,
                    self.headdim,
                    self.d_state,
                    device=device,
                    dtype=torch.float32,
                ),
            )
            memory[self.layer_number] = states
        start = inference_params.batch_size_offset
        return states[0][start : start + batch], states[1][start : start + batch]


class _GroupedGatedRMSNorm(torch.nn.Module):
    """y * SiLU(z), then RMS-normalised over each group of `group_size` contiguous channels
    (fp32), times a per-channel weight. The weight [d_inner_l] is split across tensor-parallel
    ranks along dim 0 (groups never span ranks)."""

    def __init__(self, hidden: int, group_size: int, device=None, dtype=None):
        super().__init__()
        self.group_size = group_size
        self.weight = torch.nn.Parameter(torch.ones(hidden, device=device, dtype=dtype))

    def forward(self, y: Tensor, z: Tensor) -> Tensor:
        """y, z [..., hidden] -> [..., hidden] in the weight's dtype."""
        g = y.float() * F.silu(z.float())
        shape = g.shape
        g = g.view(*shape[:-1], -1, self.group_size)  # [..., groups, group_size]
        g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + GATED_NORM_EPS)
        return self.weight * g.view(shape).to(self.weight.dtype)
