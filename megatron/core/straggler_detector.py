"""StragglerDetector: per-rank timing of marked training sections, reported as min/max over ranks.

Megatron's API (`megatron/core/utils.py` of core_r0.8.0), re-exported from `megatron.core.utils`:
the class is a process-wide singleton, so the instance a training script creates at import time
(`stimer = StragglerDetector()`) is the one `train()` configures with `--log-straggler`.

    with stimer(bdata=True):        # data loading: counted as data time
        batch = get_batch(it)
    with stimer:                    # compute: counted as round-trip time
        out = model(batch)
    stimer.report(total_flops, log_interval)   # collective over the default group

Until `configure(..., enabled=True)` every call is a no-op, as in Megatron. Each rank reports its
average compute time per iteration (Rtt), data time per iteration (DRtt) and the throughput
estimated from those times (Etpt, TFLOP/s); rank 0 logs the minimum and maximum of each with the
rank that has it, and with `mmcnt > 1` the `mmcnt` slowest and fastest ranks. GPU power,
temperature, utilization and clock are read through torch.cuda when it can (NVML); otherwise 0.
The run-time on/off HTTP controller of Megatron's detector is not implemented.
"""

import logging
import time
from datetime import datetime
from typing import List, Tuple

import torch

from megatron.core.device import get_current_device, uses_cuda
from megatron.core.straggler_controller import StragglerController

logger = logging.getLogger('megatron.core.utils')

# Per-rank values exchanged by report(), in this order.
_FIELDS = ('rtt_ms', 'drtt_ms', 'etpt_tflops', 'power_w', 'temp_c', 'util_pct', 'clock_mhz')


def _uses_cuda() -> bool:
    return uses_cuda()


def _synchronize_device():
    # Section boundaries must include the queued GPU work, as CUDA events would.
    if _uses_cuda() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _gpu_readings() -> List[float]:
    """[power W, temperature C, utilization %, SM clock MHz] of this rank's GPU, or zeros."""
    if not (_uses_cuda() and torch.cuda.is_initialized()):
        return [0.0, 0.0, 0.0, 0.0]
    readings = []
    for read in (
        torch.cuda.power_draw,
        torch.cuda.temperature,
        torch.cuda.utilization,
        torch.cuda.clock_rate,
    ):
        try:
            readings.append(float(read()))
        except Exception:  # NVML (pynvml) missing or not permitted: Megatron reports 0 too.
            readings.append(0.0)
    readings[0] /= 1000.0  # power_draw is in mW
    return readings


class StragglerDetector:
    """Singleton timer of the sections marked with `with stimer:` / `with stimer(bdata=True):`."""

    _instance = None
    _configured = False

    def __new__(cls):
        if cls._instance is None:
            cls._instance = super().__new__(cls)
            cls._instance._set_defaults()
        return cls._instance

    def _set_defaults(self):
        controller = getattr(self, 'controller', None)
        if controller is not None:
            controller.stop()
        self.controller = None
        self.world = 1
        self.rank = 0
        self.mmcnt = 1
        self.amp = 3.0
        self.port = 0
        self._enabled = False
        self._bdata = False
        self._section_start = None
        self.reset()

    # ---- configuration -------------------------------------------------------------------

    def configure(
        self,
        world: int,
        rank: int,
        mmcnt: int = 1,
        amp: float = 3.0,
        port: int = 65535,
        prefill: int = 1024,
        enabled: bool = False,
        ctrlr_host: str = '127.0.0.1',
    ) -> None:
        """Arm the detector (Megatron's signature; `prefill` sizes CUDA-event queues there).

        Args:
            world: number of ranks taking part in `report`.
            rank: this rank.
            mmcnt: with > 1, also log this many slowest and fastest ranks by throughput.
            amp: kept for API parity (Megatron's amplification factor of its timing loop).
            port: rank 0 listens here for HTTP requests that flip the detector on / off at the
                next report (straggler_controller.py); 0 picks a free port, None starts none.
            enabled: start timing now; with False every call stays a no-op until switched on.
            ctrlr_host: the controller's address (Megatron listens on all interfaces; the
                default here is loopback only).
        """
        if mmcnt < 1:
            raise ValueError(f'StragglerDetector: mmcnt must be >= 1, got {mmcnt}')
        self._set_defaults()
        self.world, self.rank, self.mmcnt, self.amp, self.port = world, rank, mmcnt, amp, port
        self._enabled = bool(enabled)
        StragglerDetector._configured = True
        if rank == 0 and port is not None:
            self.controller = StragglerController(is_off=lambda: not self._enabled)
            self.controller.start(port, ctrlr_host)

    def stop_controller(self) -> None:
        """Close the on/off controller's port (rank 0), if one is running."""
        if self.controller is not None:
            self.controller.stop()
            self.controller = None

    @property
    def configured(self) -> bool:
        return StragglerDetector._configured

    @property
    def enabled(self) -> bool:
        return self._enabled

    def reset(self) -> None:
        """Zero the times accumulated since the last report."""
        self._compute_s = 0.0
        self._data_s = 0.0

    # ---- timing ----------------------------------------------------------------------------

    def __call__(self, bdata: bool = False) -> 'StragglerDetector':
        """`with stimer(bdata=True):` marks a data-loading section."""
        self._bdata = bdata
        return self

    def __enter__(self) -> 'StragglerDetector':
        self.start()
        return self

    def __exit__(self, ex_type, ex_val, ex_tb) -> bool:
        self.stop()
        self._bdata = False
        return False

    def start(self) -> None:
        if not self._enabled:
            return
        _synchronize_device()
        self._section_start = time.perf_counter()

    def stop(self) -> None:
        if not self._enabled or self._section_start is None:
            return
        _synchronize_device()
        spent = time.perf_counter() - self._section_start
        self._section_start = None
        if self._bdata:
            self._data_s += spent
        else:
            self._compute_s += spent

    def elapsed(self) -> Tuple[float, float]:
        """(compute ms, data ms) accumulated on this rank since the last reset."""
        return self._compute_s * 1000.0, self._data_s * 1000.0

    # ---- reporting -------------------------------------------------------------------------

    def report(self, total_flops: float = 0.0, log_interval: int = 0) -> bool:
        """Exchange this interval's per-rank times and log min/max over ranks (rank 0).

        A collective over the default process group when it has more than one rank: every rank
        must call it at the same iteration.

        Args:
            total_flops: floating-point operations of the whole model over the interval.
            log_interval: iterations in the interval (the per-iteration averages divide by it).

        Returns:
            True if a report was made (enabled and log_interval > 0), else False. Either way a
            flip requested through the controller since the last report is applied on every
            rank (one broadcast from rank 0 when configured with more than one rank).
        """
        made = self._enabled and log_interval > 0 and self._report(total_flops, log_interval)
        self._check_toggle()
        return made

    def _report(self, total_flops: float, log_interval: int) -> bool:
        compute_ms, data_ms = self.elapsed()
        rtt = compute_ms / log_interval
        flops_per_iteration = total_flops / log_interval
        # TFLOP/s of this rank: the model's work split evenly over the ranks, in this rank's time.
        etpt = flops_per_iteration / (rtt * 1e9 * self.world) if rtt > 0 else 0.0
        mine = [rtt, data_ms / log_interval, etpt] + _gpu_readings()
        per_rank = self._gather(mine)
        if self.rank == 0:
            self._log(per_rank)
        self.reset()
        return True

    def _check_toggle(self) -> None:
        if not StragglerDetector._configured:
            return
        off = not self._enabled
        if self.rank == 0 and self.controller is not None and self.controller.take_toggle():
            off = not off
        if (
            self.world > 1
            and torch.distributed.is_available()
            and torch.distributed.is_initialized()
        ):
            state = torch.tensor([int(off)], dtype=torch.int32, device=get_current_device())
            torch.distributed.broadcast(state, 0)
            off = bool(state.item())
        if off == self._enabled:  # the state flips
            self._enabled = not off
            self.reset()
            self._section_start = None
            if self.rank == 0:
                logger.info(f'Toggling StragglerDetector State {"OFF" if off else "ON"}')

    def _gather(self, values: List[float]) -> List[List[float]]:
        """values of every rank, indexed by rank."""
        if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            return [values]
        if torch.distributed.get_world_size() == 1:
            return [values]
        local = torch.tensor(values, dtype=torch.float64, device=get_current_device())
        gathered = [torch.empty_like(local) for _ in range(torch.distributed.get_world_size())]
        torch.distributed.all_gather(gathered, local)
        return [t.tolist() for t in gathered]

    def _log(self, per_rank: List[List[float]]) -> None:
        def min_max(field, unit, fmt='{:.2f}'):
            column = [(values[_FIELDS.index(field)], rank) for rank, values in enumerate(per_rank)]
            low, high = min(column), max(column)
            return (
                f'{fmt.format(low[0])}{unit}/{low[1]}',
                f'{fmt.format(high[0])}{unit}/{high[1]}',
            )

        rtt, drtt = min_max('rtt_ms', 'ms'), min_max('drtt_ms', 'ms')
        pwr, tmp = min_max('power_w', 'W', '{:.0f}'), min_max('temp_c', 'C', '{:.0f}')
        utl, clk = min_max('util_pct', '%', '{:.0f}'), min_max('clock_mhz', 'MHz', '{:.0f}')
        etpt = min_max('etpt_tflops', 'TF')
        now = f"[{datetime.now().strftime('%Y-%m-%d %H:%M:%S')}]"
        logger.info(
            f'{now} | MnRtt/Rnk: {rtt[0]} | MxRtt/Rnk: {rtt[1]} | MnPwr/Rnk: {pwr[0]} | '
            f'MxPwr/Rnk: {pwr[1]} | MnTmp/Rnk: {tmp[0]} | MxTmp/Rnk: {tmp[1]} | '
            f'MnUtl/Rnk: {utl[0]} | MxUtl/Rnk: {utl[1]} | MnClk/Rnk: {clk[0]} | '
            f'MxClk/Rnk: {clk[1]} | MnDRtt/Rnk: {drtt[0]} | MxDRtt/Rnk: {drtt[1]} | '
            f'MnEtpt/Rnk: {etpt[0]} | MxEtpt/Rnk: {etpt[1]}'
        )
        if self.mmcnt > 1:
            by_tpt = sorted(
                (values[_FIELDS.index('etpt_tflops')], rank) for rank, values in enumerate(per_rank)
            )
            count = min(self.mmcnt, len(by_tpt))
            low = ' | '.join(f'{t:.2f}TF/{r}' for t, r in by_tpt[:count])
            high = ' | '.join(f'{t:.2f}TF/{r}' for t, r in reversed(by_tpt[-count:]))
            logger.info(f'^^^^ Bottom {count} Ranks with lowest  Etpt(TF): {low}')
            logger.info(f'^^^^ Top    {count} Ranks with highest Etpt(TF): {high}')
