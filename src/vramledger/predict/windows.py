"""Each optimizer's steady window in a program that trains with several.

A program may train with one optimizer and then another (SGD, then Adam) or interleave two (a
GAN's generator and discriminator). Step ``k``'s window runs from the ``optimizer.step()`` that
ended step ``k - 1`` to the one that ends step ``k`` (``trace/program/program_trace.py``; a real run
counts the same windows, ``measure/program.py``). An optimizer's steady peak is the largest
peak of its steps after its first (the first creates its state lazily); an optimizer that made
one step has only that one.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from vramledger.inputs.program import ProgramRun


@dataclass(frozen=True, kw_only=True)
class OptimizerWindow:
    """One optimizer's steps and their peaks (bytes as the allocator counts them)."""

    optimizer: str
    """Its class name, numbered when two share one (``Adam #2``)."""
    steps: list[int]
    """The program's steps (1-based, all optimizers counted) this optimizer made."""
    peak_bytes: int
    """The largest peak of its steps after its first (its first's when it made one)."""
    first_step_peak_bytes: int
    steady: bool
    """It made two steps or more: ``peak_bytes`` is a steady-state peak."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def optimizer_windows(step_peaks: dict[int, int], run: ProgramRun) -> list[OptimizerWindow]:
    """Each optimizer's window from the peaks of the program's steps."""
    out = []
    for index, name in enumerate(run.optimizer_names):
        steps = sorted(k for k, o in run.optimizer_of_step.items() if o == index)
        peaks = [step_peaks.get(k, 0) for k in steps]
        if not steps:
            continue
        steady = peaks[1:]
        out.append(
            OptimizerWindow(
                optimizer=name,
                steps=steps,
                peak_bytes=max(steady) if steady else peaks[0],
                first_step_peak_bytes=peaks[0],
                steady=bool(steady),
            )
        )
    return out
