"""The allocator's own count of one rank's real run, per (step, phase), and the rank's result.

A run that owns its step (DeepSpeed's engine, a pipeline schedule) is measured twice, as
``measure`` measures a single process: a plain run (no dispatch mode, no tensor subclass active:
the tracker changes what autograd allocates, ``trace/core/plain_autograd.py``) whose allocations the
allocator counts (:func:`allocator_counter`, read per phase by :class:`PlainCountingObserver`),
then a tracked run of the same step for the ledger (:func:`rank_measurement`).
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from vramledger.inputs.categories import Category, Phase
from vramledger.inputs.notes import Note, Topic, tagged
from vramledger.inputs.spec import TrainingSpec
from vramledger.inputs.training import NullObserver
from vramledger.inputs.version import __version__
from vramledger.ledger.ledger import Ledger, build_ledger
from vramledger.measure import cpu_allocator_count
from vramledger.record.timeline import Timeline
from vramledger.trace.emulation.target_policy import policy_for


def allocator_counter(cuda: bool) -> tuple[Callable[[], None], Callable[[], int]]:
    """The allocator's own count of a run from here on: ``(start, end)`` — ``start()`` resets
    the peak, ``end()`` is the peak since then above what is live now. CPU: every thread's
    allocations (``cpu_allocator_count``, installed here); CUDA: ``max_memory_allocated``. What
    earlier work left for the garbage collector is collected first, so it is not freed (and
    counted) inside the run."""
    gc.collect()
    if not cuda:
        cpu_allocator_count.install()
    base = torch.cuda.memory_allocated() if cuda else cpu_allocator_count.live()

    def start() -> None:
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        else:
            cpu_allocator_count.reset_peak()

    def end() -> int:
        if cuda:
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated() - base
        return cpu_allocator_count.peak() - base

    return start, end


@dataclass(frozen=True, kw_only=True)
class RankMeasurement:
    """One rank's real run of an engine that owns its step (DeepSpeed's, a pipeline's)."""

    ledger: Ledger
    """From the storage tracker (the estimate's categories and phases)."""
    counted_step_peaks: dict[int, int]
    """Per step, the peak of the CPU allocator's own count (every thread; ``cpu_allocator_count``;
    on CUDA ``max_memory_allocated``), counted from the start of the run."""
    counted_phase_peaks: dict[tuple[int, str], int]
    """The same per (step, phase)."""

    @property
    def counted_peak_bytes(self) -> int:
        """Steady-state peak (steps >= 2) of the allocator's count."""
        return max(v for k, v in self.counted_step_peaks.items() if k >= 2)


DeepSpeedMeasurement = RankMeasurement
"""The former name (DeepSpeed's engine was the first run measured this way)."""


MEASURED = Note(Topic.MEASUREMENT, "measured")
"""The first note of every measured ledger."""


def rank_measurement(
    timeline: Timeline,
    counted: dict[tuple[int, str], int],
    spec: TrainingSpec,
    device: str,
    counts: tuple[int, int],
    notes: list[str],
) -> RankMeasurement:
    """One rank's real run as a measurement: its tracked timeline as a ledger, and the
    allocator's counted peaks per (step, phase) folded per step."""
    ledger = build_ledger(
        timeline,
        target=device,
        allocator=policy_for(device).allocator,
        parameters=counts[0],
        trainable_parameters=counts[1],
        optimizer_state_bytes=timeline.live_at_end(Category.OPTIMIZER_STATE),
        optimizer_state_method="measured",
        spec=spec.summary(),
        notes=[MEASURED, *tagged(notes, Topic.ENGINE)],
        version=__version__,
    )
    steps: dict[int, int] = {}
    for (step, _), peak in counted.items():
        steps[step] = max(steps.get(step, 0), peak)
    return RankMeasurement(ledger=ledger, counted_step_peaks=steps, counted_phase_peaks=counted)


class _PhasePeaks:
    """The allocator's peak of each (step, phase): ``start()`` resets the counter when a phase
    opens, ``end()`` reads its peak when the next opens or the run closes."""

    def __init__(self, start: Any, end: Any, out: dict[tuple[int, str], int]):
        self._start, self._end, self._out = start, end, out
        self._open: tuple[int, str] | None = None

    def open(self, step: int, phase: Phase) -> None:
        self.close()
        self._open = (step, phase.value)
        self._start()

    def close(self) -> None:
        if self._open is not None:
            key = self._open
            self._out[key] = max(self._out.get(key, 0), self._end())
            self._open = None


class PlainCountingObserver(NullObserver):
    """Reads the allocator's peak of each (step, phase) and nothing else: no tracker, no
    dispatch mode (the plain run's observer)."""

    def __init__(self, start: Any, end: Any, out: dict[tuple[int, str], int]):
        self._peaks = _PhasePeaks(start, end, out)

    def phase(self, step: int, phase: Phase) -> None:
        self._peaks.open(step, phase)

    def close(self) -> None:
        self._peaks.close()
