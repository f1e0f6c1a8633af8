"""Per-layer choice of the `--tp-comm-overlap` pipelines, from a userbuffers configuration.

Megatron's `--tp-comm-overlap-cfg` is a YAML file that Transformer Engine reads as `ub_cfgs`: one
entry per GEMM, named `{buffer}_{pass}` with the buffer a linear layer's `tp_comm_buffer_name`
(`qkv`, `fc1` column-parallel; `proj`, `fc2` row-parallel) and the pass `fprop`, `dgrad` or
`wgrad`; each entry holds a `method` (`ring_exchange`, `pipeline` or `bulk`) and kernel tuning
(SM counts, CGA size, split count, atomic GEMM, fp8 buffers...). Here the method of a listed GEMM
turns on the matching overlap of `comm_overlap.py` for that layer, whatever the global switches
say; GEMMs not listed keep the global switches (as Transformer Engine keeps its defaults). The
tuning keys have no counterpart in point-to-point pipelines and are accepted without effect.

What each method means here:
- column-parallel `fprop` (ring_exchange | pipeline): the input all-gather pipelined with the GEMM;
- column-parallel `dgrad`: `bulk` re-gathers the input behind the input-gradient GEMM;
  ring_exchange | pipeline pipelines the input gradient's reduce-scatter with that GEMM
  (Megatron's `--tp-comm-overlap-rs-dgrad`);
- column-parallel `wgrad` (bulk): the input gradient's reduce-scatter behind the weight-gradient
  GEMM;
- row-parallel `fprop` (ring_exchange | pipeline): the output reduce-scatter pipelined with the
  GEMM; row-parallel `dgrad` (ring_exchange | pipeline): the output-gradient all-gather pipelined
  with the input-gradient GEMM, which the row-parallel backward always does.
"""

from dataclasses import dataclass
from typing import Mapping, Optional

COLUMN_PARALLEL_BUFFERS = ('qkv', 'fc1')
ROW_PARALLEL_BUFFERS = ('proj', 'fc2')

#: (buffer kind, pass) -> the methods that mean something for it.
_METHODS = {
    ('column', 'fprop'): ('ring_exchange', 'pipeline'),
    ('column', 'dgrad'): ('bulk', 'ring_exchange', 'pipeline'),
    ('column', 'wgrad'): ('bulk',),
    ('row', 'fprop'): ('ring_exchange', 'pipeline'),
    ('row', 'dgrad'): ('ring_exchange', 'pipeline'),
}

#: Transformer Engine's kernel tuning keys: accepted, no effect on point-to-point pipelines.
TUNING_KEYS = frozenset(
    {
        'num_sm',
        'cga_size',
        'num_splits',
        'set_sm_margin',
        'atomic_gemm',
        'fp8_buf',
        'aggregate',
        'use_ce',
        'num_max_streams',
        'comm_priority',
        'gemm_priority',
        'pipeline_rs_overlap_first_gemm',
    }
)


def _buffer_kind(buffer: str) -> Optional[str]:
    if buffer in COLUMN_PARALLEL_BUFFERS:
        return 'column'
    if buffer in ROW_PARALLEL_BUFFERS:
        return 'row'
    return None


def check_ub_cfgs(ub_cfgs: Mapping, source: str = 'the userbuffers configuration') -> None:
    """Raise ValueError naming `source` and the entry for anything this overlap cannot honour."""
    if not isinstance(ub_cfgs, Mapping):
        raise ValueError(f'{source} must map GEMM names to settings, got {type(ub_cfgs).__name__}')
    for name, settings in ub_cfgs.items():
        buffer, _, gemm_pass = str(name).rpartition('_')
        kind = _buffer_kind(buffer)
        if kind is None or (kind, gemm_pass) not in _METHODS:
            known = sorted(
                f'{b}_{p}'
                for b in COLUMN_PARALLEL_BUFFERS + ROW_PARALLEL_BUFFERS
                for k, p in _METHODS
                if k == _buffer_kind(b)
            )
            raise ValueError(f'{source}: unknown GEMM {name!r} (known: {", ".join(known)})')
        if not isinstance(settings, Mapping):
            raise ValueError(f'{source}: {name} must be a mapping of settings, got {settings!r}')
        unknown = set(settings) - TUNING_KEYS - {'method'}
        if unknown:
            raise ValueError(f'{source}: {name} has unknown settings {sorted(unknown)}')
        method = settings.get('method')
        allowed = _METHODS[(kind, gemm_pass)]
        if method is not None and method not in allowed:
            raise ValueError(
                f'{source}: {name} method {method!r} is not one of {", ".join(allowed)} for a '
                f'{kind}-parallel layer'
            )


@dataclass(frozen=True)
class LayerOverlap:
    """The overlap switches one linear layer uses (attribute names as in ModelParallelConfig)."""

    tp_comm_overlap_ag: bool
    tp_comm_overlap_rs: bool
    tp_comm_bulk_dgrad: bool
    tp_comm_bulk_wgrad: bool
    tp_comm_overlap_rs_dgrad: bool


def layer_overlap(config, buffer_name: Optional[str]) -> LayerOverlap:
    """The global `tp_comm_*` switches of `config`, overridden by the GEMMs of `buffer_name`
    listed in `config.tp_comm_overlap_ub_cfgs`."""
    switches = {
        'tp_comm_overlap_ag': bool(config.tp_comm_overlap_ag and config.tp_comm_split_ag),
        'tp_comm_overlap_rs': bool(config.tp_comm_overlap_rs and config.tp_comm_split_rs),
        'tp_comm_bulk_dgrad': bool(config.tp_comm_bulk_dgrad),
        'tp_comm_bulk_wgrad': bool(config.tp_comm_bulk_wgrad),
        'tp_comm_overlap_rs_dgrad': bool(config.tp_comm_overlap_rs_dgrad),
    }
    ub_cfgs = getattr(config, 'tp_comm_overlap_ub_cfgs', None) or {}
    kind = _buffer_kind(buffer_name) if buffer_name else None
    for gemm_pass in ('fprop', 'dgrad', 'wgrad'):
        settings = ub_cfgs.get(f'{buffer_name}_{gemm_pass}') if kind else None
        if settings is None or settings.get('method') is None:
            continue
        method = settings['method']
        if gemm_pass == 'fprop':
            switches['tp_comm_overlap_ag' if kind == 'column' else 'tp_comm_overlap_rs'] = True
        elif kind == 'column' and gemm_pass == 'dgrad':
            if method == 'bulk':
                switches['tp_comm_bulk_dgrad'] = True
            else:
                switches['tp_comm_overlap_rs_dgrad'] = True
        elif kind == 'column' and gemm_pass == 'wgrad':
            switches['tp_comm_bulk_wgrad'] = True
    return LayerOverlap(**switches)
