"""The replay of a Timeline's events: the bytes its storages hold after each event.

Every question about a timeline's memory over the run is asked of this one replay: the ledger's
peaks by step and phase (``replay.replay``), the planner's steady-state peaks of hundreds of
re-sized derived timelines, the HTML report's chart, what ``torch.cuda.memory_allocated()``
answers a traced program, a compiled region's eager peak. It is the running sum of each event's
signed bytes, ``+size`` for an allocation and ``-size`` for a free, for any sizes of the
storages: their tensor bytes, the blocks an allocator hands out, or those of some storages only
(the others 0: device or host memory, model state). Sums and maxima over lists run in C
(``itertools.accumulate``, ``max``): no torch, so it runs the same inside a trace (under fake
tensors and the storage tracker) and outside, whatever a user's program left set.

Which storages are alive, rather than how many bytes, is ``live_at``.
"""

from __future__ import annotations

from itertools import accumulate
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vramledger.record.timeline import Timeline


class EventTotals:
    """The events of one timeline from ``start`` on, for any sizes of its storages (timelines
    that share these events, re-sized, share it too)."""

    def __init__(self, timeline: Timeline, start: int = 0):
        self.events = timeline.events[start:]
        """``sid`` = allocation, ``~sid`` = free (``Timeline.events``)."""

    def __len__(self) -> int:
        return len(self.events)

    def held(self, sizes: list[int]) -> list[int]:
        """Bytes held after each event, ``sizes[sid]`` the bytes of each storage."""
        return list(accumulate([sizes[e] if e >= 0 else -sizes[~e] for e in self.events]))

    def peak(self, sizes: list[int]) -> int:
        """The most bytes held at once over the events (at least 0)."""
        return max(0, max(self.held(sizes), default=0))

    def by_key(
        self, sizes: list[int], keys: list[int], nkeys: int, events: list[int]
    ) -> list[list[int]]:
        """Bytes held after each of ``events`` (indices; -1: before any), split by the key of
        each storage (``keys[sid]`` in ``range(nkeys)``): one row of ``nkeys`` per event."""
        if not events:
            return []
        wanted = sorted(set(events))
        upto = self.events[: wanted[-1] + 1]
        rows: dict[int, list[int]] = {-1: [0] * nkeys}
        current = [0] * nkeys
        at = 0
        for end in wanted:
            # the events after the previous row's, each adding its bytes to its storage's key
            chunk = upto[at : end + 1]
            for key, size in zip(
                [keys[e if e >= 0 else ~e] for e in chunk],
                [sizes[e] if e >= 0 else -sizes[~e] for e in chunk],
                strict=True,
            ):
                current[key] += size
            rows[end], at = list(current), max(at, end + 1)
        return [rows[e] for e in events]


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
