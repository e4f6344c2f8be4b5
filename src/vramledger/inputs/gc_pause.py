"""Pausing Python's cyclic garbage collector while large acyclic structures are built.

Extending a traced timeline to 80 blocks or simulating the allocator over it creates hundreds of
thousands of tuples and list entries and no reference cycles; each allocation counts towards the
collector's threshold, so it runs hundreds of times over every live object (torch's and
transformers' included) and finds nothing. Paused, extending the 70B plan's largest timeline
takes about a quarter of the time (``benchmarks/results/README-startup.md``).
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Run the block without the cyclic collector (restored as it was, even on error)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
