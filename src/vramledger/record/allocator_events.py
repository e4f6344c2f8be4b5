"""Reading the CPU allocator through ``torch.profiler`` memory events.

With ``profile_memory=True`` the profiler records every allocation and free the c10 CPU
allocator makes on the profiled thread, as ``[memory]`` events with a signed byte count.
c10's ``ProfiledCPUMemoryReporter`` (c10/core/CPUAllocator.cpp) reports a free whenever the
block's address is in its size table, and that table keeps every block allocated under *any*
profiling session until the block is freed while profiling: a block allocated in an earlier
session (an earlier ``measure()``, a scratch probe) that dies inside this one — the cyclic
garbage collector freeing an earlier run's model — is reported as a negative event, and a plain
running sum of the events drops below the bytes this session holds. ``memory_events`` therefore
pairs frees with this session's own allocations by address and drops the rest. Kineto prints a
line to stderr whenever a profiler starts or stops; ``recording()`` keeps those lines out of the
user's terminal.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator

from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):  # no real stderr (e.g. captured): nothing to hide
        yield
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


@contextlib.contextmanager
def recording() -> Iterator[profile]:
    """Profile CPU memory events of the block (Kineto's start/stop chatter silenced)."""
    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    with _quiet_stderr():
        prof.start()
    try:
        yield prof
    finally:
        with _quiet_stderr():
            prof.stop()


def memory_events(prof: profile) -> list[tuple[int, int]]:
    """(timestamp ns, signed bytes) of the CPU blocks allocated in this session and of their
    frees, in time order. Frees of blocks allocated before the session are not this session's
    (see the module docstring) and are left out."""
    raw: list[tuple[int, int, int]] = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        stack.extend(node.children)
        if node.tag == _EventType.Allocation and node.extra_fields.device.type == "cpu":
            raw.append((node.start_time_ns, node.extra_fields.ptr, node.extra_fields.alloc_size))
    raw.sort(key=lambda e: e[0])
    live: dict[int, int] = {}
    events: list[tuple[int, int]] = []
    for ts, ptr, size in raw:
        if size > 0:
            live[ptr] = size
            events.append((ts, size))
        elif ptr in live:
            events.append((ts, -live.pop(ptr)))
    return events


def ranges(prof: profile, prefix: str) -> dict[str, tuple[int, int]]:
    """Start and end (ns) of every ``record_function`` range whose name starts with ``prefix``."""
    return {
        ev.name(): (ev.start_ns(), ev.end_ns())
        for ev in prof.profiler.kineto_results.events()
        if ev.name().startswith(prefix)
    }


def peak_of(events: list[tuple[int, int]]) -> int:
    """Largest running sum of the events (bytes above what was live when recording began)."""
    live = peak = 0
    for _, delta in events:
        live += delta
        peak = max(peak, live)
    return peak
