"""--profile: profile a window of training iterations (Megatron's flags).

Megatron profiles the iterations whose 0-based index is in [--profile-step-start,
--profile-step-end), i.e. the iterations the log numbers start+1 .. end, on the global ranks of
--profile-ranks:

- `--profile --use-pytorch-profiler` (later Megatron's flag): `torch.profiler` records the window
  (CPU activity, and CUDA kernels when the run is on a GPU) with shapes and stacks, and writes one
  Chrome trace per rank, `<--tensorboard-dir>/rank<r>.<time>.pt.trace.json`, when the window ends.
  Open it in https://ui.perfetto.dev (or chrome://tracing), or in TensorBoard with the
  torch-tb-profiler plugin (`tensorboard --logdir <--tensorboard-dir>`). The schedule waits, warms
  up for one iteration before the window (when there is one), then records the window, as
  Megatron's does.
- `--profile` alone (Megatron core_r0.8.0's meaning): opens a CUDA profiler range
  (`cudaProfilerStart` / `cudaProfilerStop`) around the window, with NVTX ranges for every op
  (`emit_nvtx`), for `nsys profile --capture-range=cudaProfilerApi`. It needs CUDA, so on a CPU
  run it is refused at start-up (see `megatron/training/validation/observability_args.py`).

The hooks cost nothing on ranks that do not profile and when --profile is off.
"""

import os

import torch

from megatron.core.device import uses_cuda


class IterationProfiler:
    """The training loop's profiler: `begin_iteration(i)` before iteration index i (0-based),
    `end_iteration(i)` after it, `close()` when the loop ends (also early)."""

    def __init__(self, args, rank: int):
        self.enabled = bool(args.profile) and rank in args.profile_ranks
        self.use_torch_profiler = bool(getattr(args, 'use_pytorch_profiler', False))
        self.start = args.profile_step_start
        self.end = args.profile_step_end
        self.trace_dir = args.tensorboard_dir
        self.rank = rank
        self._torch_prof = None
        self._nvtx = None
        self._cuda_range_open = False
        self._window_reached = False
        if self.enabled and self.use_torch_profiler:
            self._torch_prof = self._build_torch_profiler()
            self._torch_prof.start()

    def _build_torch_profiler(self):
        activities = [torch.profiler.ProfilerActivity.CPU]
        if uses_cuda():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        os.makedirs(self.trace_dir, exist_ok=True)
        return torch.profiler.profile(
            activities=activities,
            schedule=torch.profiler.schedule(
                wait=max(self.start - 1, 0),
                warmup=1 if self.start > 0 else 0,
                active=self.end - self.start,
                repeat=1,
            ),
            on_trace_ready=torch.profiler.tensorboard_trace_handler(
                self.trace_dir, worker_name=f'rank{self.rank}'
            ),
            record_shapes=True,
            with_stack=True,
        )

    def begin_iteration(self, iteration: int) -> None:
        """Before the iteration with 0-based index `iteration`."""
        if not self.enabled or self.use_torch_profiler:
            return
        if iteration == self.start:
            torch.cuda.cudart().cudaProfilerStart()
            self._nvtx = torch.autograd.profiler.emit_nvtx(record_shapes=True)
            self._nvtx.__enter__()
            self._cuda_range_open = True

    def end_iteration(self, iteration: int) -> None:
        """After the iteration with 0-based index `iteration`."""
        if not self.enabled:
            return
        if self._torch_prof is not None:
            self._window_reached = self._window_reached or iteration >= self.start
            self._torch_prof.step()
            if iteration + 1 == self.end:
                self._stop_torch_profiler()
        elif self._cuda_range_open and iteration + 1 == self.end:
            self._close_cuda_range()

    def _stop_torch_profiler(self):
        prof, self._torch_prof = self._torch_prof, None
        prof.stop()
        if self._window_reached:
            print(f'[rank {self.rank}] profiler trace written to {self.trace_dir}', flush=True)

    def _close_cuda_range(self):
        self._nvtx.__exit__(None, None, None)
        self._nvtx = None
        torch.cuda.cudart().cudaProfilerStop()
        self._cuda_range_open = False

    def close(self) -> None:
        """End profiling if the loop stopped inside the window (the trace so far is written)."""
        if self._torch_prof is not None:
            self._stop_torch_profiler()
        if self._cuda_range_open:
            self._close_cuda_range()
