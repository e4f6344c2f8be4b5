"""The replay of a Timeline's events: the bytes its storages hold after each event.

Every question about a timeline's memory over the run is asked of this one replay: the ledger's
peaks by step and phase (``ledger.replay``), the planner's steady-state peaks of hundreds of
re-sized derived timelines, the HTML report's chart, what ``torch.cuda.memory_allocated()``
answers a traced program, a compiled region's eager peak. It is a cumulative sum (torch) of each
event's signed bytes, ``+size`` for an allocation and ``-size`` for a free, for any sizes of the
storages: their tensor bytes, the blocks an allocator hands out, or those of some storages only
(the others 0: device or host memory, a category). The events are converted once; each question
gives its sizes.

Which storages are alive, rather than how many bytes, is ``live_at``.
"""

from __future__ import annotations

import array
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .timeline import Timeline


class EventTotals:
    """The events of one timeline from ``start`` on, converted once for any sizes of its
    storages (timelines that share these events, re-sized, share it too)."""

    def __init__(self, timeline: Timeline, start: int = 0):
        import torch

        events = _int64(timeline.events[start:])
        self.sids = torch.where(events >= 0, events, ~events)
        """The storage of each event."""
        self.allocates = events >= 0
        """True for an allocation, False for a free."""
        self._sign = torch.where(self.allocates, 1, -1)

    def __len__(self) -> int:
        return len(self.sids)

    def _per_event(self, values: Any) -> Any:
        """``values`` (a tensor, one per storage) of each event's storage."""
        # index_select, not values[sids]: advanced indexing splits even small tensors over
        # threads, a thousand times slower on a busy machine (15 ms for 20k events, 2 cores)
        return values.index_select(0, self.sids)

    def flags(self, flags: list[bool]) -> Any:
        """Each event's storage's flag (``flags[sid]``), a bool tensor."""
        return self._per_event(_bool(flags))

    def deltas(self, sizes: list[int]) -> Any:
        """Each event's signed bytes (``+size`` allocated, ``-size`` freed)."""
        return self._per_event(_int64(sizes)) * self._sign

    def held(self, sizes: list[int]) -> Any:
        """Bytes held after each event (an int64 tensor), ``sizes[sid]`` the bytes of each
        storage."""
        return self.deltas(sizes).cumsum(0)

    def peak(self, sizes: list[int]) -> int:
        """The most bytes held at once over the events (at least 0)."""
        held = self.held(sizes)
        return max(0, int(held.max())) if len(held) else 0

    def by_key(
        self, sizes: list[int], keys: list[int], nkeys: int, events: list[int]
    ) -> list[list[int]]:
        """Bytes held after each of ``events`` (indices; -1: before any), split by the key of
        each storage (``keys[sid]`` in ``range(nkeys)``): one row of ``nkeys`` per event."""
        import torch

        if not events:
            return []
        # Each event adds its bytes to the row of the first boundary (event asked for + 1)
        # after it; the rows' running sums are then the bytes held at each boundary.
        n = len(self.sids)
        bounds = sorted({e + 1 for e in events})
        starts = torch.zeros(n + 1, dtype=torch.int64)
        starts.index_fill_(0, _int64(bounds), 1)
        row = starts.cumsum(0)[:n]  # boundaries at or before each event
        table = torch.zeros((len(bounds) + 1) * nkeys, dtype=torch.int64)
        table.index_add_(0, row * nkeys + self._per_event(_int64(keys)), self.deltas(sizes))
        rows = table.view(-1, nkeys).cumsum(0).tolist()
        where = {b: i for i, b in enumerate(bounds)}
        return [rows[where[e + 1]] for e in events]


def _int64(values: list[int]) -> Any:
    """An int64 tensor of ``values`` (through an array: ten times faster than from a list)."""
    import torch

    return (
        torch.frombuffer(array.array("q", values), dtype=torch.int64)
        if values
        else (torch.zeros(0, dtype=torch.int64))
    )


def _bool(values: list[bool]) -> Any:
    import torch

    return (
        torch.frombuffer(bytearray(values), dtype=torch.bool)
        if values
        else (torch.zeros(0, dtype=torch.bool))
    )


def sizes_in(sizes: list[int], on_host: list[bool], *, host: bool) -> list[int]:
    """Each storage's ``sizes`` if it is kept in host memory (``host``) or on the device
    (``not host``), else 0: the sizes that replay one of the two memories."""
    return [n if bool(h) == host else 0 for n, h in zip(sizes, on_host, strict=True)]


def live_at(timeline: Timeline, event: int, *, device_only: bool = False) -> set[int]:
    """Storages alive just after ``timeline.events[event]`` (-1: before any); ``device_only``:
    those the target keeps in device memory (not ``on_host``)."""
    alive: set[int] = set()
    add, discard = alive.add, alive.discard
    host = timeline.on_host if device_only and any(timeline.on_host) else None
    for ev in timeline.events[: event + 1]:
        if ev >= 0:
            if host is None or not host[ev]:
                add(ev)
        elif host is None or not host[~ev]:
            discard(~ev)
    return alive
