"""Where a traced timeline walks the model's blocks in order: its *regions*.

``blocks.py`` extends a timeline traced with a few identical blocks to any depth: it copies the
events outside the blocks as they are and, in each stretch of the timeline that walks every
block in order (a region: the forward, the backward, each multi-tensor optimizer operator ...),
writes one block's events for each block. This module finds those regions in the traced
timeline, and in each the events of every block (its *chunk*); a timeline without that
structure raises :class:`NotExtensible`.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from vramledger.inputs.categories import Phase
from vramledger.record.timeline import Timeline


class NotExtensible(Exception):
    """The timeline does not have the repeated-block structure ``extend`` needs."""


@dataclass
class Region:
    start: int  # first event index
    stop: int  # one past the last event index
    ascending: bool
    chunks: list[tuple[int, int]]  # (start, stop) event span of each block, in region order


@dataclass(frozen=True)
class _Stream:
    """The traced events, as the regions are looked for in them."""

    tl: Timeline
    labels: list[int | None]
    """Each event's block, with free sweeps relabelled by their storages' blocks."""
    sweep: list[int | None]
    """The sweep of frees each event belongs to (its first event), None outside every sweep."""
    timed: list[bool]
    """In forward or backward (labelled by the block running, not by storage)."""
    phase_starts: set[int]


def find_regions(tl: Timeline, blocks: int, template: int) -> list[Region]:
    """Split the event stream into regions that walk all blocks in order.

    In forward and backward a block's events are everything while it runs, so a region runs
    to its last labelled event. Elsewhere (setup, optimizer) labels come from the storages, and
    two regions can meet on the same block (a multi-tensor operator's outputs allocated in block
    order, then freed in reverse as the list is released; the last block's gradients freed,
    then the first block's as ``zero_grad`` walks the parameters); there the last block's events
    stop, at an unlabelled event or a free, once it has as many labelled events as the first
    block had. When every parameter the optimizer steps is in a block (LoRA adapters, a frozen
    embedding and head) no unlabelled event stands between such regions.

    Two kinds of events are taken for what they are rather than by their label: a free of the
    previous block's storage inside a block (a for-loop over parameters frees one parameter's
    temporary when the next one is computed) belongs to the block where it happens; and a run
    of frees outside any block that releases storages of several blocks (autocast's weight
    cache when the autocast region ends) is a region of its own, by the storages' blocks.

    ``template`` is the block whose chunk the extension repeats for the middle blocks
    (``blocks.HEAD``): what follows its last labelled event measures a region's tail.
    """
    timed = _timed_events(tl)
    labels, sweep = _with_free_sweeps(tl)
    _refuse_graph_release(tl, sweep)
    stream = _Stream(tl, labels, sweep, timed, {index for index, _, _ in tl.marks})
    regions: list[Region] = []
    i = 0
    while i < len(labels):
        region = None if labels[i] is None else _region_at(stream, i, blocks, template)
        if region is None:
            i += 1
            continue
        regions.append(region)
        i = region.stop
    return regions


def _region_at(stream: _Stream, start: int, blocks: int, template: int) -> Region | None:
    """The region that begins at the labelled event ``start``; None when that event is a late
    free of a block's storage after its region ended, not a region."""
    first = stream.labels[start]
    late_free = stream.tl.events[start] < 0
    if first not in (0, blocks - 1):
        if late_free:
            return None
        raise NotExtensible(f"a region starts at block {first}")
    ascending = first == 0
    order = list(range(blocks)) if ascending else list(range(blocks - 1, -1, -1))
    chunks, last_labelled = _walk(stream, start, order)
    if len(chunks) != len(order) - 1:
        if late_free:
            return None
        raise NotExtensible("a region does not visit every block")
    stop = _with_tail(stream, start, chunks, last_labelled + 1, template)
    chunks.append((chunks[-1][1] if chunks else start, stop))
    return Region(start=start, stop=stop, ascending=ascending, chunks=chunks)


def _walk(stream: _Stream, start: int, order: list[int]) -> tuple[list[tuple[int, int]], int]:
    """Walk the blocks in ``order`` from event ``start`` to the end of the region: the chunk of
    every block but the one reached last (its chunk begins where the last one returned ends)
    and the region's last labelled event (see :func:`find_regions` on where a region ends)."""
    labels, events, timed = stream.labels, stream.tl.events, stream.timed
    chunks: list[tuple[int, int]] = []
    chunk_start = last_labelled = start
    pos = counted = 0
    first_count = None
    for j in range(start, len(labels)):
        if j in stream.phase_starts and j > start:
            break  # a region never spans two phases
        if stream.sweep[j] != stream.sweep[start]:
            break  # a sweep of frees is a region of its own
        lab = labels[j]
        complete = (
            pos == len(order) - 1
            and not timed[j]
            and first_count is not None
            and counted >= first_count
        )
        if lab is None:
            if complete:
                break
        elif complete and events[j] < 0:
            break  # the next region's first free (see find_regions)
        elif lab == order[pos]:
            counted += 1
            last_labelled = j
        elif pos > 0 and lab == order[pos - 1] and events[j] < 0:
            pass  # a late free of the previous block's storage, inside this block
        elif pos + 1 < len(order) and lab == order[pos + 1]:
            chunks.append((chunk_start, j))
            if first_count is None:
                first_count = counted
            pos, counted, chunk_start, last_labelled = pos + 1, 1, j, j
        else:
            break
    return chunks, last_labelled


def _with_tail(
    stream: _Stream, start: int, chunks: list[tuple[int, int]], stop: int, template: int
) -> int:
    """Where a region that ends at ``stop`` ends with its tail: in forward and backward, the
    code between one block call and the next (say, releasing the previous block's output) also
    runs after the last block, so as many unlabelled events are taken after it as follow the
    template block's last labelled event."""
    labels, timed, n = stream.labels, stream.timed, len(stream.labels)
    if timed[start] and len(chunks) >= 2:
        a, b = chunks[min(template, len(chunks) - 1)]
        tail = b - 1 - max(e for e in range(a, b) if labels[e] is not None)
        if all(labels[e] is None and timed[e] for e in range(stop, min(stop + tail, n))):
            stop = min(stop + tail, n)
    return stop


def _with_free_sweeps(tl: Timeline) -> tuple[list[int | None], list[int | None]]:
    """Labels with free sweeps relabelled by the storages' blocks, and each event's sweep."""
    labels = list(tl.event_block)
    n = len(labels)
    sweep: list[int | None] = [None] * n
    i = 0
    while i < n:
        if tl.events[i] >= 0 or labels[i] is not None:
            i += 1
            continue
        j = i
        while j < n and tl.events[j] < 0 and labels[j] is None:
            j += 1
        owners = [tl.block[~tl.events[e]] for e in range(i, j)]
        if len({b for b in owners if b is not None}) >= 2:
            labels[i:j] = owners
            sweep[i:j] = [i] * (j - i)
        i = j
    return labels, sweep


def _refuse_graph_release(tl: Timeline, sweep: list[int | None]) -> None:
    """A sweep of frees in backward, outside every block, is the autograd graph released after
    the backward (``tracker.py`` ends a backward outside every block) freeing tensors of several
    blocks that a custom autograd Function kept on its ``ctx`` rather than saving them
    (bitsandbytes' LLM.int8 ``MatMul8bitLt``). Python releases that graph object by object, and
    past a nesting depth (CPython's trashcan) it defers the rest, so the order of the frees
    depends on the depth: a 24-layer LLM.int8 model frees the loss among its blocks' tensors,
    a 5-layer one after them, and an extended trace would differ from the full one (in the order
    of frees only, which no peak depends on, but the extension is exact or not used)."""
    bounds = [*tl.marks, (len(tl.events), 0, Phase.SETUP)]
    starts = {s for s in sweep if s is not None}
    for (a, _, phase), (b, _, _) in itertools.pairwise(bounds):
        if phase is Phase.BACKWARD and any(a <= s < b for s in starts):
            raise NotExtensible(
                "the autograd graph released after backward frees tensors of several blocks, "
                "in an order that depends on the depth"
            )


def _timed_events(tl: Timeline) -> list[bool]:
    """True for events in forward or backward (labelled by the block running, not by storage)."""
    timed = [False] * len(tl.events)
    bounds = [*tl.marks, (len(tl.events), 0, Phase.SETUP)]
    for (a, _, phase), (b, _, _) in itertools.pairwise(bounds):
        if phase in (Phase.FORWARD, Phase.BACKWARD):
            for e in range(a, b):
                timed[e] = True
    return timed
