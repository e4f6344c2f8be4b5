"""Reading the CPU allocator through ``torch.profiler`` memory events.

With ``profile_memory=True`` the profiler records every allocation and free the c10 CPU
allocator makes on the profiled thread, as ``[memory]`` events with a signed byte count. Blocks
allocated before profiling started are excluded from their frees. Kineto prints a line to
stderr whenever a profiler starts or stops; ``recording()`` keeps those lines out of the
user's terminal.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator

import torch
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
    """(timestamp ns, signed bytes) of every CPU allocator event, in time order."""
    events = [
        (ev.start_ns(), ev.nbytes())
        for ev in prof.profiler.kineto_results.events()
        if ev.name() == "[memory]" and ev.device_type() == torch.autograd.DeviceType.CPU
    ]
    events.sort(key=lambda e: e[0])
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
