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

from ..allocator import CUDA_CACHING_ALLOCATOR, Block, CudaCachingAllocatorSim
from ..errors import InputError
from ..ledger import Ledger, replay, steady_peak
from ..timeline import Timeline

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


def _segments(sim: CudaCachingAllocatorSim, owners: dict[int, int], tl: Timeline) -> list[dict]:
    out = []
    for addr, size, small in sim.segments:
        blocks = []
        block: Block | None = sim.heads[addr]
        while block is not None:
            sid = owners.get(block.addr) if not block.free else None
            entry = {
                "address": block.addr,
                "size": block.size,
                "requested_size": tl.nbytes[sid] if sid is not None else 0,
                "state": "inactive" if sid is None else "active_allocated",
                "frames": _frames(tl, sid) if sid is not None else [],
            }
            blocks.append(entry)
            block = block.next
        active = sum(b["size"] for b in blocks if b["state"] == "active_allocated")
        out.append(
            {
                "device": DEVICE,
                "address": addr,
                "total_size": size,
                "allocated_size": active,
                "active_size": active,
                "requested_size": sum(b["requested_size"] for b in blocks),
                "stream": STREAM,
                "segment_type": "small" if small else "large",
                "segment_pool_id": (0, 0),
                "is_expandable": False,
                "frames": [],
                "blocks": blocks,
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
    sim = CudaCachingAllocatorSim()
    blocks: dict[int, Block] = {}
    owners: dict[int, int] = {}  # block address -> sid, while allocated
    trace: list[dict[str, Any]] = []
    segments: list[dict[str, Any]] | None = None
    for i, ev in enumerate(tl.events):
        sid = ev if ev >= 0 else ~ev
        if not tl.on_host[sid] and tl.nbytes[sid] > 0:
            if ev >= 0:
                known = len(sim.segments)
                block = sim.malloc(tl.nbytes[sid])
                for addr, size, _ in sim.segments[known:]:
                    trace.append(_action("segment_alloc", addr, size, i, []))
                blocks[sid], owners[block.addr] = block, sid
                trace.append(_action("alloc", block.addr, block.size, i, _frames(tl, sid)))
            elif sid in blocks:
                block = blocks.pop(sid)
                del owners[block.addr]
                for action in ("free_requested", "free_completed"):
                    trace.append(_action(action, block.addr, block.size, i, _frames(tl, sid)))
                sim.free(block)
        if i == peak_event:
            segments = _segments(sim, owners, tl)
    return {
        "segments": segments or [],
        "device_traces": [trace],
        "allocator_settings": {"expandable_segments": False, "note": "vramledger prediction"},
    }


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
