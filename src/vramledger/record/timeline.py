"""The Timeline: every storage a training step allocates and frees, in order.

A tracer (fake tensors) or a measurement (real tensors) produces one; the Ledger is computed
from it by replay. Storages are numbered (``sid``) in order of first sight; ``events`` holds
``sid`` for an allocation and ``~sid`` for a free, so the live set at any point is a prefix
replay. ``marks`` say where each (step, phase) begins.
"""

from __future__ import annotations

import bisect
import copy
from dataclasses import dataclass, field, fields

from vramledger.inputs.categories import CATEGORY_RANK, Category, Phase


@dataclass(kw_only=True)
class Timeline:
    """Allocation history of one traced or measured run (mutable while recording)."""

    nbytes: list[int] = field(default_factory=list)
    """Bytes of each storage (``UntypedStorage.nbytes()``), indexed by sid."""
    tags: list[Category | None] = field(default_factory=list)
    """Category each storage was tagged with; ``None`` means temporary."""
    on_host: list[bool] = field(default_factory=list)
    """True for storages that the target keeps in host memory (e.g. Adam's ``step`` counters
    on CUDA); they are reported apart from device memory."""
    module: list[str | None] = field(default_factory=list)
    """Module (fully qualified name) whose code allocated the storage: in forward the innermost
    module running; in backward the module whose forward made the autograd node running
    (``trace/core/backward_modules.py``), or, while activation checkpointing recomputes a forward, the
    innermost module recomputed."""
    recomputed: list[bool] = field(default_factory=list)
    """True for storages allocated while activation checkpointing recomputed a forward inside
    backward (their ``module`` is the module recomputed)."""
    op: list[str | None] = field(default_factory=list)
    """Operator whose output the storage is (``aten.mm.default``), None for registered tensors."""
    origin: list[tuple[int, Phase]] = field(default_factory=list)
    """(step, phase) in which the storage was allocated."""
    labels: dict[int, str] = field(default_factory=dict)
    """Names for synthetic storages a device policy adds (e.g. 'cuBLAS workspace')."""
    events: list[int] = field(default_factory=list)
    """``sid`` = allocation, ``~sid`` = free, in program order."""
    marks: list[tuple[int, int, Phase]] = field(default_factory=list)
    """(index into events, step, phase): from that event on, the run is in that step and phase."""
    block: list[int | None] = field(default_factory=list)
    """Index of the repeated block (e.g. decoder layer) each storage belongs to, when the trace
    labels blocks (``trace/core/blocks.py``); None outside blocks."""
    event_block: list[int | None] = field(default_factory=list)
    """Block label of each event, parallel to ``events``."""

    # -- recording -------------------------------------------------------------------------------
    def new_storage(
        self,
        nbytes: int,
        step: int,
        phase: Phase,
        module: str | None,
        op: str | None = None,
        block: int | None = None,
        recomputed: bool = False,
    ) -> int:
        sid = len(self.nbytes)
        self.nbytes.append(nbytes)
        self.tags.append(None)
        self.on_host.append(False)
        self.module.append(module)
        self.recomputed.append(recomputed)
        self.op.append(op)
        self.origin.append((step, phase))
        self.block.append(block)
        self.events.append(sid)
        self.event_block.append(block)
        return sid

    def free(self, sid: int, block: int | None = None) -> None:
        self.events.append(~sid)
        self.event_block.append(block)

    def mark(self, step: int, phase: Phase) -> None:
        self.marks.append((len(self.events), step, phase))

    def add_storage(self, nbytes: int, category: Category, *, like: int | None = None) -> int:
        """A storage the run did not record (a layout model's or a derivation's), without events:
        give it some with ``insert_events``. ``like``: take that storage's module (and whether
        it was recomputed), op, origin and block; else it is made at setup."""
        sid = len(self.nbytes)
        self.nbytes.append(nbytes)
        self.tags.append(category)
        self.on_host.append(False)
        self.module.append(self.module[like] if like is not None else None)
        self.recomputed.append(self.recomputed[like] if like is not None else False)
        self.op.append(self.op[like] if like is not None else None)
        self.origin.append(self.origin[like] if like is not None else (0, Phase.SETUP))
        self.block.append(self.block[like] if like is not None else None)
        return sid

    def insert_events(self, insertions: dict[int, list[int]]) -> None:
        """Insert events (``sid`` / ``~sid``) before the event at each index (``len(events)``:
        at the end). A mark at an index where events are inserted moves after them: they belong
        to the phase before it."""
        events: list[int] = []
        blocks: list[int | None] = []
        at: list[int] = []
        inserted: list[int] = []
        previous = 0
        for index in sorted(insertions):
            added = insertions[index]
            events += self.events[previous:index]
            blocks += self.event_block[previous:index]
            events += added
            blocks += [self.block[e if e >= 0 else ~e] for e in added]
            at.append(index)
            inserted.append((inserted[-1] if inserted else 0) + len(added))
            previous = index
        events += self.events[previous:]
        blocks += self.event_block[previous:]
        self.events, self.event_block = events, blocks

        def shift(index: int) -> int:
            k = bisect.bisect_right(at, index)
            return inserted[k - 1] if k else 0

        self.marks = [(index + shift(index), step, phase) for index, step, phase in self.marks]

    def tag(self, sid: int, category: Category) -> None:
        """Give ``sid`` a category unless it already has one of higher priority."""
        current = self.tags[sid]
        if current is None or CATEGORY_RANK[category] < CATEGORY_RANK[current]:
            self.tags[sid] = category

    def same_as(self, other: Timeline, columns: tuple[str, ...]) -> bool:
        """Whether ``other`` holds the same values as this timeline in each of ``columns``
        (field names: ``"nbytes"``, ``"events"``, ...)."""
        return all(getattr(self, c) == getattr(other, c) for c in columns)

    def copy(self) -> Timeline:
        """A copy to change (a derived layout): its own lists and labels, the same items."""
        return Timeline(**{f.name: copy.copy(getattr(self, f.name)) for f in fields(self)})

    # -- reading ---------------------------------------------------------------------------------
    def category(self, sid: int) -> Category:
        return self.tags[sid] or Category.TEMPORARIES

    def live_at_end(self, category: Category) -> int:
        """Bytes of storages of ``category`` still alive when the run ends (device and host)."""
        freed = {~e for e in self.events if e < 0}
        return sum(
            self.nbytes[s]
            for s in range(self.num_storages)
            if s not in freed and self.category(s) is category
        )

    def lifetimes(self, sids: set[int]) -> dict[int, tuple[int, int | None]]:
        """Index of the event that allocates each of ``sids`` and of the one that frees it (None:
        alive at the end); a storage without events is left out."""
        allocated: dict[int, int] = {}
        freed: dict[int, int] = {}
        for i, e in enumerate(self.events):
            if e >= 0:
                if e in sids:
                    allocated[e] = i
            elif ~e in sids:
                freed[~e] = i
        return {sid: (i, freed.get(sid)) for sid, i in allocated.items()}

    @property
    def num_storages(self) -> int:
        return len(self.nbytes)

    @property
    def steps(self) -> int:
        return max((step for _, step, _ in self.marks), default=0)
