"""A Timeline replayed: the peaks of each step and (step, phase), with their breakdown by category.

Replay takes the bytes held after each event from the Timeline's one replay (``event_totals.py``:
raw tensor bytes, or the allocator's block bytes) and records the largest total of each step and
of each (step, phase), with its breakdown by category. The steady state is steps >= 2 (step 1
creates the optimizer state lazily). Every breakdown sums exactly to its total (asserted).
Besides the full :func:`replay`: the steady-state peaks alone (``steady_*``, for a planner that
asks them of hundreds of derived timelines), a breakdown at one event, and the sampled
:func:`series` a chart draws. ``ledger.py`` turns two replays (tensor bytes and the allocator's
blocks) into the Ledger.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from vramledger.inputs.categories import CATEGORY_PRIORITY, MODEL_STATE_CATEGORIES, Category, Phase
from vramledger.ledger.peak_modules import OUTSIDE
from vramledger.record.allocator import AllocatorModel
from vramledger.record.event_totals import EventTotals, live_at, sizes_in
from vramledger.record.timeline import Timeline

_NCAT = len(CATEGORY_PRIORITY)


@dataclass(frozen=True, kw_only=True)
class PeakPoint:
    """The live memory at one moment (the largest of some span of the run)."""

    total: int
    by_category: dict[Category, int]
    step: int
    phase: Phase
    event: int
    """Index into ``Timeline.events`` of the allocation that reached it."""

    def __post_init__(self) -> None:
        assert sum(self.by_category.values()) == self.total, "breakdown must sum to the total"


@dataclass(frozen=True, kw_only=True)
class Replay:
    """What a replay of a Timeline under one allocator model finds."""

    step_peaks: dict[int, PeakPoint]
    phase_peaks: dict[tuple[int, Phase], int]
    phase_peak_events: dict[tuple[int, Phase], int]
    """Index into ``Timeline.events`` where each (step, phase) reached its peak (-1: at its
    start); ``breakdown_at`` gives the categories there."""
    step_start: dict[int, int]
    """Live bytes when each step begins (what the step inherits)."""
    host_peak: int
    """Largest live bytes kept in host memory (storages marked on_host)."""
    reserved_peaks: dict[int, int]
    """Per step, the largest bytes the allocator had reserved (empty if it reserves nothing
    beyond what it allocates)."""
    model_state_peaks: dict[int, int]
    """Per step, the largest sum of the model-state categories held at once."""
    activations_by_module: dict[str, int]
    """Activation bytes live at the end of the last forward, by innermost module."""


def replay(
    timeline: Timeline,
    allocator: AllocatorModel | None = None,
    *,
    totals: EventTotals | None = None,
) -> Replay:
    """Replay with tensor bytes (no allocator) or with the blocks ``allocator`` hands out
    (``totals``: the events converted once, for timelines that share them)."""
    totals = totals or EventTotals(timeline)
    sizes, reserved = _allocated(timeline, allocator)
    cat = _category_ranks(timeline)
    device = sizes_in(sizes, timeline.on_host, host=False)
    is_state = [c in MODEL_STATE_CATEGORIES for c in CATEGORY_PRIORITY]
    walk = _walk(timeline, totals, device, reserved, state=[is_state[c] for c in cat])
    at = [position for _, position, _, _ in walk.best.values()]
    breakdowns = totals.by_key(device, cat, _NCAT, at)
    step_peaks = {
        s: PeakPoint(
            total=t,
            by_category=dict(zip(CATEGORY_PRIORITY, breakdown, strict=True)),
            step=s,
            phase=p,
            event=e,
        )
        for (s, (t, _, p, e)), breakdown in zip(walk.best.items(), breakdowns, strict=True)
    }
    forward_end_modules = (
        _activations_by_module(timeline, live_at(timeline, walk.forward_end - 1, device_only=True))
        if walk.forward_end is not None
        else {}
    )
    return Replay(
        step_peaks=step_peaks,
        phase_peaks=walk.phase_peaks,
        phase_peak_events=walk.phase_events,
        step_start=walk.step_start,
        host_peak=_host_peak(totals, sizes, timeline.on_host),
        reserved_peaks=walk.reserved_peaks,
        model_state_peaks=walk.model_state_peaks,
        activations_by_module=forward_end_modules,
    )


def _host_peak(totals: EventTotals, sizes: list[int], on_host: list[bool]) -> int:
    """The most bytes of ``sizes`` held at once in host memory."""
    in_host = sizes_in(sizes, on_host, host=True)
    return totals.peak(in_host) if any(in_host) else 0


def _allocated(timeline: Timeline, allocator: AllocatorModel | None) -> tuple[list[int], list[int]]:
    """Each storage's bytes as ``allocator`` hands them out (its tensor bytes with none), and the
    bytes it has reserved after each event (empty if it reserves nothing more)."""
    if allocator is None:
        return list(timeline.nbytes), []
    return allocator.block_sizes(timeline.nbytes, timeline.events, timeline.on_host)


def _category_ranks(timeline: Timeline) -> list[int]:
    """Each storage's category, as its index in ``CATEGORY_PRIORITY``."""
    rank = {c: i for i, c in enumerate(CATEGORY_PRIORITY)}
    temporaries = rank[Category.TEMPORARIES]  # Timeline.category, inlined (300k storages)
    return [rank[tag] if tag is not None else temporaries for tag in timeline.tags]


_NOT_A_PEAK = -(1 << 62)
"""Below every total: the value of an event that cannot reach a peak (a free, a host storage)."""


@dataclass(kw_only=True)
class _Walk:
    """What a walk over a timeline's marks finds in its totals (``_walk``)."""

    best: dict[int, tuple[int, int, Phase, int]] = field(default_factory=dict)
    """Per step: its largest total, the event after which its breakdown is taken (-1: before
    any), its phase and ``PeakPoint.event``."""
    phase_peaks: dict[tuple[int, Phase], int] = field(default_factory=dict)
    phase_events: dict[tuple[int, Phase], int] = field(default_factory=dict)
    step_start: dict[int, int] = field(default_factory=dict)
    reserved_peaks: dict[int, int] = field(default_factory=dict)
    model_state_peaks: dict[int, int] = field(default_factory=dict)
    forward_end: int | None = None
    """Index of the mark where the last step's (last) forward pass ends."""


def _walk(
    timeline: Timeline,
    totals: EventTotals,
    device: list[int],
    reserved: list[int],
    *,
    state: list[bool] | None = None,
) -> _Walk:
    """The peaks of each step and (step, phase) in the device totals, from one replay
    (``device[sid]``: a storage's device bytes, 0 in host memory): the total entering each mark
    and after each allocation of a device storage count, the first of equal ones wins; the
    reserved bytes after an event count to the step before a mark at it. ``state`` (which
    storages are model state): the same for the model-state bytes, per step."""
    events, host = totals.events, timeline.on_host
    held = totals.held(device)
    # the totals that may be a peak: after allocating a storage in device memory
    peaks = [
        h if e >= 0 and not host[e] else _NOT_A_PEAK for h, e in zip(held, events, strict=True)
    ]
    state_held = state_peaks = None
    if state is not None:
        state_held = totals.held([b if s else 0 for b, s in zip(device, state, strict=True)])
        state_peaks = [
            h if e >= 0 and state[e] and not host[e] else _NOT_A_PEAK
            for h, e in zip(state_held, events, strict=True)
        ]
    w = _Walk()
    step, phase, last_step = 0, Phase.SETUP, timeline.steps
    step_best = phase_best = state_best = -1
    reserved_from = 0
    for mark, a, b in _runs(timeline.marks, len(events)):
        if mark is not None:
            index, new_step, new_phase = mark
            _count_reserved(w, step, reserved[reserved_from : index + 1])
            reserved_from = max(reserved_from, index + 1)
            entering = held[index - 1] if index else 0
            if new_step == last_step and phase is Phase.FORWARD and new_phase is Phase.BACKWARD:
                w.forward_end = index
            if new_step != step:
                w.step_start[new_step] = entering
                step_best = -1
                if state_held is not None:
                    state_best = state_held[index - 1] if index else 0
                    w.model_state_peaks[new_step] = state_best
            step, phase = new_step, new_phase
            phase_best = w.phase_peaks.get((step, phase), -1)
            if entering > step_best:
                step_best = entering
                w.best[step] = (entering, index - 1, phase, index)
            if entering > phase_best:
                phase_best = w.phase_peaks[(step, phase)] = entering
                w.phase_events[(step, phase)] = index - 1
        if a == b:
            continue
        top, event = _first_largest(peaks, a, b)
        if top > step_best:
            step_best = top
            w.best[step] = (top, event, phase, event)
        if top > phase_best:
            phase_best = w.phase_peaks[(step, phase)] = top
            w.phase_events[(step, phase)] = event
        if state_peaks is not None:
            top = max(state_peaks[a:b])
            if top > state_best:
                state_best = w.model_state_peaks[step] = top
    _count_reserved(w, step, reserved[reserved_from:])
    return w


def _count_reserved(w: _Walk, step: int, reserved: list[int]) -> None:
    """Count the reserved bytes after some events to ``step``."""
    if reserved and max(reserved) > w.reserved_peaks.get(step, 0):
        w.reserved_peaks[step] = max(reserved)


def _runs(
    marks: list[tuple[int, int, Phase]], n: int
) -> list[tuple[tuple[int, int, Phase] | None, int, int]]:
    """The events ``[a, b)`` that run under each mark (None: before the first), in order; a
    mark at the end of the events opens nothing."""
    runs: list[tuple[tuple[int, int, Phase] | None, int, int]] = []
    a, opened = 0, None
    for mark in marks:
        if not a <= mark[0] < n:
            break
        runs.append((opened, a, mark[0]))
        a, opened = mark[0], mark
    runs.append((opened, a, n))
    return runs


def _first_largest(values: list[int], a: int, b: int) -> tuple[int, int]:
    """The largest of ``values[a:b]`` and the index of its first occurrence."""
    run = values[a:b]
    top = max(run)
    return top, a + run.index(top)


@dataclass(frozen=True, kw_only=True)
class Series:
    """Device bytes by category over a run, for a chart: ``points`` samples of the event stream,
    each the largest total of its stretch of events (so no peak is lost) with its breakdown."""

    events: list[int]
    """Index into ``Timeline.events`` of each sample."""
    by_category: dict[Category, list[int]]
    totals: list[int]
    phases: list[tuple[int, int, Phase]]
    """(sample index, step, phase) where each phase begins."""


def series(timeline: Timeline, points: int = 1200) -> Series:
    """Sample the live device bytes by category (raw tensor bytes) over the run."""
    totals = EventTotals(timeline)
    device = sizes_in(timeline.nbytes, timeline.on_host, host=False)
    held = totals.held(device)
    n = len(held)
    stretch = max(1, -(-n // points))
    picks = [_first_largest(held, a, min(a + stretch, n))[1] for a in range(0, n, stretch)]
    breakdowns = totals.by_key(device, _category_ranks(timeline), _NCAT, picks)
    marks = {i: (step, phase) for i, step, phase in timeline.marks if i < n}
    return Series(
        events=picks,
        by_category={c: [b[j] for b in breakdowns] for j, c in enumerate(CATEGORY_PRIORITY)},
        totals=[held[i] for i in picks],
        phases=[(i // stretch, step, phase) for i, (step, phase) in sorted(marks.items())],
    )


def breakdown_at(timeline: Timeline, event: int) -> dict[Category, int]:
    """Device bytes by category just after ``timeline.events[event]``."""
    cat = _category_ranks(timeline)
    device = sizes_in(timeline.nbytes, timeline.on_host, host=False)
    (row,) = EventTotals(timeline).by_key(device, cat, _NCAT, [event])
    return dict(zip(CATEGORY_PRIORITY, row, strict=True))


def steady_phase_point(r: Replay, phase: Phase) -> tuple[int, int] | None:
    """(peak bytes, event index) of ``phase``'s largest peak in the steady state (steps >= 2)."""
    points = [
        (v, r.phase_peak_events[k]) for k, v in r.phase_peaks.items() if k[0] >= 2 and k[1] is phase
    ]
    return max(points, default=None)


def _activations_by_module(timeline: Timeline, live: set[int]) -> dict[str, int]:
    out: dict[str, int] = defaultdict(int)
    for sid in live:
        if timeline.category(sid) is Category.ACTIVATIONS:
            out[timeline.module[sid] or OUTSIDE] += timeline.nbytes[sid]
    return dict(out)


def steady_peak(r: Replay) -> PeakPoint:
    steady = [p for s, p in r.step_peaks.items() if s >= 2]
    if not steady:
        raise ValueError("the timeline has no steady-state step (steps >= 2)")
    return max(steady, key=lambda p: p.total)


def steady_tensor_peak(timeline: Timeline, totals: EventTotals | None = None) -> int:
    """``steady_peak(replay(timeline)).total`` (device tensor bytes, no allocator) without the
    per-category bookkeeping, for a planner that asks it of hundreds of derived timelines
    (``totals``: made once for their shared events)."""
    device = sizes_in(timeline.nbytes, timeline.on_host, host=False)
    return _steady_total(_walk(timeline, totals or EventTotals(timeline), device, []))


@dataclass(frozen=True)
class SteadyPeaks:
    """What a planner needs of a timeline under an allocator, without a full replay."""

    allocated: int
    """``steady_peak(replay(timeline, allocator)).total``."""
    reserved: int
    """``steady_reserved_peak(replay(timeline, allocator))``."""
    host: int
    """``replay(timeline).host_peak``: the most bytes held in host memory at once."""


def steady_peaks(
    timeline: Timeline, allocator: AllocatorModel, totals: EventTotals | None = None
) -> SteadyPeaks:
    """The allocator's steady-state allocated and reserved peaks and the host peak, from the
    replay without its breakdowns (a plan's re-estimates and derivations need nothing else of
    their timelines; ``totals``: made once for timelines sharing these events)."""
    totals = totals or EventTotals(timeline)
    sizes, reserved = _allocated(timeline, allocator)
    walk = _walk(timeline, totals, sizes_in(sizes, timeline.on_host, host=False), reserved)
    allocated = _steady_total(walk)
    return SteadyPeaks(
        allocated=allocated,
        reserved=max((v for k, v in walk.reserved_peaks.items() if k >= 2), default=allocated),
        host=_host_peak(totals, timeline.nbytes, timeline.on_host),
    )


def _steady_total(walk: _Walk) -> int:
    """``steady_peak``'s total."""
    steady = [total for step, (total, _, _, _) in walk.best.items() if step >= 2]
    if not steady:
        raise ValueError("the timeline has no steady-state step (steps >= 2)")
    return max(steady)


def steady_reserved_peak(r: Replay) -> int:
    """The most the allocator held in a steady-state step (the allocated peak where the replay
    had no allocator that reserves)."""
    return max((v for k, v in r.reserved_peaks.items() if k >= 2), default=steady_peak(r).total)


def steady_phase_peaks(r: Replay) -> dict[Phase, int]:
    out: dict[Phase, int] = {}
    for (step, phase), value in r.phase_peaks.items():
        if step >= 2:
            out[phase] = max(out.get(phase, 0), value)
    return out
