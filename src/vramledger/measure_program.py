"""``measure_program``: run the user's program for real on CPU and count what the CPU allocator
hands out: the truth ``run_program --target cpu`` is checked against.

The program runs unchanged (``program.py``) with no fake tensor and no dispatch mode: "cuda"
is the CPU (``cuda_emulation.CpuForCuda``: a factory's ``device="cuda"`` makes a real CPU
tensor, ``.to("cuda")``/``.cuda()`` of a CPU tensor is that tensor), and
``torch.cuda.memory_allocated()``, ``max_memory_allocated()`` and the rest answer from
``cpu_allocator_count`` (every CPU allocation on every thread, counted from just before the
program starts). Each step's peak is counted over the same windows a trace reports (from one
``optimizer.step()`` to the next, ``trace/program_trace.py``).

What differs from a GPU run, by construction: every CPU allocation of the program counts (its
data pipeline's too, which a GPU's allocator never sees), and a tensor moved to "cuda" is
counted from its creation on the host rather than from the copy.
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field
from typing import Any

from . import cpu_allocator_count as count
from .bnb_weights import refused_quantized_weights
from .gpus import resolve_gpu
from .predict_program import DEFAULT_GPU, emulated_gpu
from .program import ProgramRun, ProgramSpec, launch, skipped_saves_note
from .trace.cuda_emulation import CpuForCuda, CudaEmulation
from .windows import OptimizerWindow, optimizer_windows

COUNTED = "cpu_allocator_count: every CPU allocation on every thread, from the program's start"


class CountedCpu:
    """``torch.cuda``'s memory answers from the CPU allocator's count, and each step's peak.

    The allocator counter has one peak register; the program's resets and the step windows'
    both use it, so each keeps the peaks it would have lost to the other's reset."""

    def __init__(self) -> None:
        count.install()
        self.base = count.live()
        count.reset_peak()
        self._program = 0  # the program's peak since its last reset, before the register's
        self._step = 0  # this step's peak, before the register's
        self.step_peaks: dict[int, int] = {}

    def allocated(self) -> int:
        return count.live() - self.base

    def max_allocated(self) -> int:
        return max(self._program, count.peak()) - self.base

    def reserved(self) -> int:
        return self.allocated()  # the CPU allocator caches nothing

    def max_reserved(self) -> int:
        return self.max_allocated()

    def reset_peak(self) -> None:
        self._step = max(self._step, count.peak())
        self._program = 0
        count.reset_peak()

    def end_step(self, step: int) -> None:
        peak = count.peak()
        self.step_peaks[step] = max(self._step, peak) - self.base
        self._program = max(self._program, peak)
        self._step = 0
        count.reset_peak()

    # program.StepHooks
    def before_step(self, optimizer: Any, step: int) -> None:
        pass

    def after_step(self, optimizer: Any, step: int) -> None:
        self.end_step(step)


@dataclass(frozen=True, kw_only=True)
class ProgramMeasurement:
    """A program's real CPU run: the allocator's peaks, per step and per optimizer."""

    program: str
    ending: str
    steps: int
    optimizers: list[str]
    windows: list[OptimizerWindow]
    peak_bytes: int
    """The most the allocator held at once over the whole program."""
    step_peaks: dict[int, int]
    method: str = COUNTED
    notes: list[str] = field(default_factory=list)
    exit_code: int = 0
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "program": self.program,
            "target": "cpu",
            "measured": True,
            "ending": self.ending,
            "steps": self.steps,
            "optimizers": self.optimizers,
            "optimizer_windows": [w.to_dict() for w in self.windows],
            "program_peak_bytes": self.peak_bytes,
            "step_peaks": {str(k): v for k, v in self.step_peaks.items()},
            "measurement_method": self.method,
            "notes": self.notes,
            "exit_code": self.exit_code,
            "seconds": round(self.seconds, 3),
        }


def measure_program(spec: ProgramSpec, *, gpu: str | None = None) -> ProgramMeasurement:
    """Run ``spec``'s program for real on CPU ("cuda" mapped onto the CPU; ``gpu`` only names
    what ``torch.cuda.get_device_properties`` says) and count its allocations."""
    start = time.perf_counter()
    gc.collect()  # earlier garbage must not die inside the counted run
    counter = CountedCpu()
    emulation = CudaEmulation(emulated_gpu(resolve_gpu(gpu or DEFAULT_GPU)), counter, CpuForCuda())
    with emulation, refused_quantized_weights():
        run: ProgramRun = launch(spec, counter)
    if run.steps not in counter.step_peaks or run.ending != "max-steps":
        # what ran after the last step belongs to it, as in a trace (trace/program_trace.py)
        last = max(run.steps, 1)
        previous = counter.step_peaks.get(last, 0)
        counter.end_step(last)
        counter.step_peaks[last] = max(previous, counter.step_peaks[last])
    peaks = counter.step_peaks
    return ProgramMeasurement(
        program=" ".join([spec.program, *spec.args]),
        ending=run.ending,
        steps=run.steps,
        optimizers=list(run.optimizer_names),
        windows=optimizer_windows(peaks, run),
        peak_bytes=max(peaks.values(), default=0),
        step_peaks=peaks,
        notes=[
            "measured: the program ran for real on CPU, 'cuda' mapped onto the CPU",
            *([skipped_saves_note(run.skipped_saves)] if run.skipped_saves else []),
        ],
        exit_code=run.exit_code,
        seconds=time.perf_counter() - start,
    )
