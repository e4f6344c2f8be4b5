"""The predicted step as a PyTorch CUDA memory snapshot, for the viewer users already know.

``torch.cuda.memory._snapshot()`` returns a dict of the caching allocator's ``segments`` (each
with its ``blocks``) and ``device_traces`` (every ``segment_alloc``, ``alloc``,
``free_requested``, ``free_completed``); ``torch.cuda.memory._dump_snapshot`` pickles it and
https://pytorch.org/memory_viz draws it. This module replays a ledger's timeline through the
caching-allocator model (``allocator.py``, the one the ledger's allocated and reserved bytes
come from) and writes the same structure: the segments and blocks as they are at the predicted
steady-state peak, and the trace of the whole run. A block's frame names what the tracker knew
of it — category, operator, module, step and phase — where a real snapshot has the Python stack,
so the two can be put side by side in the viewer (a real run's: ``torch.cuda.memory.
_record_memory_history()`` before the step, ``_dump_snapshot()`` after it).

What is not modelled is not invented: one device, one stream, no host (offloaded) storages.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

from vramledger.inputs.errors import InputError
from vramledger.ledger.ledger import Ledger
from vramledger.ledger.replay import replay, steady_peak
from vramledger.record.allocator import CUDA_CACHING_ALLOCATOR, Blocks
from vramledger.record.event_totals import live_at
from vramledger.record.timeline import Timeline

DEVICE = 0
STREAM = 0
FRAME_FILE = "vramledger"
"""The ``filename`` of every frame: the viewer groups by it."""


def _frames(tl: Timeline, sid: int) -> list[dict[str, Any]]:
    step, phase = tl.origin[sid]
    what = tl.labels.get(sid) or tl.op[sid] or "tensor"
    name = f"{tl.category(sid).value}: {what}"
    if tl.module[sid]:
        name += f" in {tl.module[sid]}"
    return [{"filename": FRAME_FILE, "line": step, "name": f"{name} (step {step} {phase.value})"}]


def _segments(
    segments: list[tuple[int, int, bool]], owners: dict[int, int], blocks: Blocks, tl: Timeline
) -> list[dict]:
    """The segments reserved, each with its blocks in address order: those of the storages in
    ``owners`` (block address -> sid) allocated, every gap between them one free block (the
    allocator merges free neighbours)."""
    out = []
    allocated = sorted(owners)
    k = 0
    for addr, size, small in segments:  # in address order, as the allocated blocks
        spans = []  # (address, size, owner) of each block
        at, end = addr, addr + size
        while k < len(allocated) and allocated[k] < end:
            start, sid = allocated[k], owners[allocated[k]]
            if start > at:
                spans.append((at, start - at, None))
            spans.append((start, blocks.sizes[sid], sid))
            at, k = start + blocks.sizes[sid], k + 1
        if at < end:
            spans.append((at, end - at, None))
        entries = [
            {
                "address": start,
                "size": length,
                "requested_size": tl.nbytes[sid] if sid is not None else 0,
                "state": "inactive" if sid is None else "active_allocated",
                "frames": _frames(tl, sid) if sid is not None else [],
            }
            for start, length, sid in spans
        ]
        active = sum(b["size"] for b in entries if b["state"] == "active_allocated")
        out.append(
            {
                "device": DEVICE,
                "address": addr,
                "total_size": size,
                "allocated_size": active,
                "active_size": active,
                "requested_size": sum(b["requested_size"] for b in entries),
                "stream": STREAM,
                "segment_type": "small" if small else "large",
                "segment_pool_id": (0, 0),
                "is_expandable": False,
                "frames": [],
                "blocks": entries,
            }
        )
    return out


def memory_snapshot(ledger: Ledger) -> dict[str, Any]:
    """The ledger's step as a ``torch.cuda.memory._snapshot()`` dict: segments and blocks at
    the steady-state allocated peak, and the trace of every event."""
    tl = ledger.timeline
    if tl is None:
        raise InputError("this ledger has no timeline to export", hint="estimate it again")
    if ledger.target != "cuda":
        raise InputError(
            "a CUDA memory snapshot needs a CUDA prediction",
            hint="drop --target cpu (the snapshot is the caching allocator's view)",
        )
    peak_event = steady_peak(replay(tl, CUDA_CACHING_ALLOCATOR)).event
    blocks = CUDA_CACHING_ALLOCATOR.blocks(tl.nbytes, tl.events, tl.on_host)
    reserving = _reserving_events(blocks)
    made = 0  # segments reserved so far
    trace: list[dict[str, Any]] = []
    for i, ev in enumerate(tl.events):
        sid = ev if ev >= 0 else ~ev
        addr, size = blocks.addresses[sid], blocks.sizes[sid]
        if addr < 0:
            continue  # no block: in host memory, or zero bytes
        if ev >= 0:
            if made < len(reserving) and reserving[made] == i:
                segment_addr, segment_size, _ = blocks.segments[made]
                trace.append(_action("segment_alloc", segment_addr, segment_size, i, []))
                made += 1
            trace.append(_action("alloc", addr, size, i, _frames(tl, sid)))
        else:
            for action in ("free_requested", "free_completed"):
                trace.append(_action(action, addr, size, i, _frames(tl, sid)))
    live = live_at(tl, peak_event, device_only=True)
    owners = {blocks.addresses[sid]: sid for sid in live if blocks.addresses[sid] >= 0}
    held = blocks.segments[: sum(1 for e in reserving if e <= peak_event)]
    return {
        "segments": _segments(held, owners, blocks, tl),
        "device_traces": [trace],
        "allocator_settings": {"expandable_segments": False, "note": "vramledger prediction"},
    }


def _reserving_events(blocks: Blocks) -> list[int]:
    """The event that reserves each segment, in order (one allocation reserves at most one)."""
    before = 0
    events = []
    for i, reserved in enumerate(blocks.reserved):
        if reserved > before:
            events.append(i)
        before = reserved
    return events


def _action(kind: str, addr: int, size: int, index: int, frames: list[dict[str, Any]]) -> dict:
    return {
        "action": kind,
        "addr": addr,
        "size": size,
        "stream": STREAM,
        "time_us": index,
        "frames": frames,
    }


def write_memory_snapshot(ledger: Ledger, path: str | Path) -> Path:
    """Pickle the snapshot as ``torch.cuda.memory._dump_snapshot`` does."""
    path = Path(path)
    try:
        with path.open("wb") as f:
            pickle.dump(memory_snapshot(ledger), f)
    except OSError as exc:
        raise InputError(f"cannot write {path}: {exc.strerror}", hint="check the path") from exc
    return path
