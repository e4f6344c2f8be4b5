"""Recording one call's events on the tracker to replay them for a later call that would make
exactly the same ones (``trace/core/step_memo.py``). A part of ``StorageTracker`` (``tracker.py``),
kept apart: it reads the tracker's ``timeline``, ``step`` and ``phase`` and clears its pending
twin folds (``twin_folding.py``) at a recording's edges.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vramledger.inputs.categories import Category


@dataclass(frozen=True)
class Recording:
    """The events of one call, relative to where they began (``StorageTracker.recording``):
    ``storages`` as (bytes, category, on host, module, recomputed, operator, block, block is the
    call's, label); ``events`` as (relative ``sid`` or ``~sid``, event block, event block is the
    call's)."""

    storages: list[tuple[Any, ...]]
    events: list[tuple[int, int | None, bool]]


class Recordings:
    """Recording and replaying calls' events, mixed into ``StorageTracker``."""

    def position(self) -> tuple[int, int, int]:
        """Where the timeline is now (events, storages, marks): the start of a recording."""
        self._twin = None  # no fold across a recording's edge (it would move its events)
        self._confirm = None
        tl = self.timeline
        return len(tl.events), tl.num_storages, len(tl.marks)

    def recording(self, start: tuple[int, int, int], block: int | None) -> Recording | None:
        """The events since ``start``, if they are self-contained: every storage they allocate
        is freed among them and they touch no other (and no phase began). ``block``: the block
        label the call ran for, which a replay replaces with its own."""
        first_event, first_sid, marks = start
        tl = self.timeline
        if len(tl.marks) != marks:
            return None
        events: list[tuple[int, int | None, bool]] = []
        live: set[int] = set()
        for e, event_block in zip(
            tl.events[first_event:], tl.event_block[first_event:], strict=True
        ):
            sid = e if e >= 0 else ~e
            if sid < first_sid or (e < 0 and sid not in live):
                return None
            (live.add if e >= 0 else live.discard)(sid)
            same = block is not None and event_block == block
            events.append((e - first_sid if e >= 0 else ~(sid - first_sid), event_block, same))
        if live:
            return None
        sids = range(first_sid, tl.num_storages)
        return Recording(
            events=events,
            storages=[
                (
                    tl.nbytes[s],
                    tl.tags[s],
                    tl.on_host[s],
                    tl.module[s],
                    tl.recomputed[s],
                    tl.op[s],
                    tl.block[s],
                    block is not None and tl.block[s] == block,
                    tl.labels.get(s),
                )
                for s in sids
            ],
        )

    def replay(self, recording: Recording, block: int | None) -> None:
        """Append a recording's events again, for a call that would make exactly them, its
        block labels made ``block``'s."""
        self._twin = None
        self._confirm = None
        tl = self.timeline
        base = tl.num_storages
        for nbytes, tag, on_host, module, again, op, own_block, same, label in recording.storages:
            sid = tl.add_storage(nbytes, tag or Category.TEMPORARIES)
            tl.tags[sid] = tag
            tl.on_host[sid] = on_host
            tl.module[sid] = module
            tl.recomputed[sid] = again
            tl.op[sid] = op
            tl.origin[sid] = (self.step, self.phase)
            tl.block[sid] = block if same else own_block
            if label is not None:
                tl.labels[sid] = label
        for e, event_block, same in recording.events:
            tl.events.append(e + base if e >= 0 else ~(~e + base))
            tl.event_block.append(block if same else event_block)
