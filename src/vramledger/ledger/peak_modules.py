"""What is live at the peak, by the module whose code allocated it and the pass that did.

Each storage of a timeline names the module that allocated it (``Timeline.module``): in forward
the innermost module running, in backward the module whose forward made the autograd node
running (``trace/core/backward_modules.py``), in activation checkpointing's recomputation the module
recomputed. So the bytes live at the peak split by module, each module's share by pass
(PyTorch's ``torch/distributed/_tools/mem_tracker.py`` keeps per-module figures of forward and
backward the same way; here they are read from the timeline, not from a second tracker):

- ``forward``: made while its forward ran (mostly what autograd saved for backward);
- ``recomputed``: made while activation checkpointing recomputed its forward inside backward;
- ``backward``: made by its backward (the gradients of its weights and of its inputs);
- ``other``: made outside forward and backward (parameters, buffers, optimizer state, the
  optimizer step's gradients): no module runs there, so this is the row of storages made
  outside every module (:data:`OUTSIDE`).

The rows sum to the peak, byte for byte (asserted by the ledger).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from vramledger.inputs.categories import Phase
from vramledger.record.event_totals import live_at
from vramledger.record.timeline import Timeline

OUTSIDE = "(outside any module)"
"""The row of storages allocated while no module ran."""
OTHER_MODULES = "(other modules)"
"""The row that sums the modules past the top ones (:func:`top_modules`)."""


PASSES = ("forward", "recomputed", "backward", "other")
"""The passes a module's bytes split into, as ``ModuleBytes`` fields (module docstring)."""
PASS_NAMES = {
    "forward": "forward",
    "recomputed": "recomputed forward",
    "backward": "backward",
    "other": "outside both",
}
"""Each pass as a report's column heading names it."""


@dataclass(frozen=True, kw_only=True)
class ModuleBytes:
    """Bytes live at one moment that one module's code allocated, by pass (module docstring)."""

    module: str
    forward: int = 0
    recomputed: int = 0
    backward: int = 0
    other: int = 0

    @property
    def total(self) -> int:
        return self.forward + self.recomputed + self.backward + self.other

    def to_dict(self) -> dict[str, Any]:
        return {
            "module": self.module,
            "bytes": self.total,
            "forward_bytes": self.forward,
            "recomputed_bytes": self.recomputed,
            "backward_bytes": self.backward,
            "other_bytes": self.other,
        }


def modules_of(timeline: Timeline, live: Iterable[int]) -> list[ModuleBytes]:
    """The device bytes of the storages ``live``, by module and pass, largest module first."""
    rows: dict[str, list[int]] = {}
    for sid in live:
        if timeline.on_host[sid]:
            continue
        row = rows.setdefault(timeline.module[sid] or OUTSIDE, [0, 0, 0, 0])
        phase = timeline.origin[sid][1]
        if timeline.recomputed[sid]:
            row[1] += timeline.nbytes[sid]
        elif phase is Phase.FORWARD:
            row[0] += timeline.nbytes[sid]
        elif phase is Phase.BACKWARD:
            row[2] += timeline.nbytes[sid]
        else:
            row[3] += timeline.nbytes[sid]
    out = [
        ModuleBytes(module=m, forward=f, recomputed=r, backward=b, other=o)
        for m, (f, r, b, o) in rows.items()
    ]
    out.sort(key=lambda row: (-row.total, row.module))
    return out


def passes_used(rows: Iterable[ModuleBytes]) -> list[str]:
    """The passes (:data:`PASSES`) that hold bytes in any of ``rows``: the columns worth
    showing."""
    rows = list(rows)
    return [p for p in PASSES if any(getattr(r, p) for r in rows)]


def top_modules(rows: list[ModuleBytes], count: int) -> list[ModuleBytes]:
    """The first ``count`` rows, the rest summed into one :data:`OTHER_MODULES` row (so the
    rows still sum to the same total)."""
    if len(rows) <= count:
        return list(rows)
    rest = rows[count:]
    return [
        *rows[:count],
        ModuleBytes(
            module=OTHER_MODULES,
            forward=sum(r.forward for r in rest),
            recomputed=sum(r.recomputed for r in rest),
            backward=sum(r.backward for r in rest),
            other=sum(r.other for r in rest),
        ),
    ]


def modules_at_peak(timeline: Timeline, event: int, total: int) -> list[ModuleBytes]:
    """:func:`modules_of` the storages live at a peak of ``total`` device bytes reached at
    ``event`` (``PeakPoint.event``: just after that allocation; or, for a peak held when a step
    began, just before its first event), checked to sum to ``total``."""
    alive = live_at(timeline, event - 1)
    if 0 <= event < len(timeline.events):
        ev = timeline.events[event]
        after = alive | {ev} if ev >= 0 else alive - {~ev}
        rows = modules_of(timeline, after)
        if sum(r.total for r in rows) == total:
            return rows
    rows = modules_of(timeline, alive)
    assert sum(r.total for r in rows) == total, "the modules must sum to the peak"
    return rows
