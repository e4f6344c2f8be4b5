"""Allocator models: from the bytes tensors ask for to the bytes an allocator hands out.

``torch.cuda.max_memory_allocated()`` counts allocator *blocks*, not tensor bytes, and
``memory_reserved()`` counts the segments the allocator took from the driver. The CUDA
caching allocator (c10/cuda/CUDACachingAllocator.cpp, default settings, one stream) is
simulated here event by event over the Timeline:

- every request is rounded up to a multiple of ``CUDA_MIN_BLOCK`` (512 B) (``round_size``);
- requests up to ``SMALL_SIZE`` (1 MiB) come from the small pool, larger ones from the large
  pool; pools never share blocks;
- a request takes the best-fitting cached free block of its pool (smallest large enough,
  lowest address on ties); if none, a new segment is allocated: ``SMALL_BUFFER`` (2 MiB) for
  small requests, ``LARGE_BUFFER`` (20 MiB) below ``MIN_LARGE_ALLOC`` (10 MiB), else the
  request rounded up to ``ROUND_LARGE`` (2 MiB) (``get_allocation_size``);
- the block is split only if what remains is at least 512 B (small pool) or more than 1 MiB
  (large pool) (``should_split``); otherwise the whole block is handed out and counted;
- a freed block merges with free neighbours in its segment; segments are never returned
  (no ``empty_cache``).

The CPU allocator (``c10::DefaultCPUAllocator``) reports the requested size unrounded.
Known limitations: several streams, ``expandable_segments``, ``max_split_size_mb``,
``roundup_power2_divisions`` and out-of-memory retries (which free cached segments) are not
modelled; nor is the CUDA context, which is not an allocation.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

CUDA_MIN_BLOCK = 512
"""``kMinBlockSize``: all sizes are rounded to multiples of 512 bytes."""
SMALL_SIZE = 1024**2
"""``kSmallSize``: largest request served by the small pool (1 MiB)."""
SMALL_BUFFER = 2 * 1024**2
"""``kSmallBuffer``: segment size of the small pool (2 MiB)."""
LARGE_BUFFER = 20 * 1024**2
"""``kLargeBuffer`` / ``large_segment_size``: segment for large requests under 10 MiB (20 MiB)."""
MIN_LARGE_ALLOC = 10 * 1024**2
"""``kMinLargeAlloc``: from this size a request gets a segment of its own (10 MiB)."""
ROUND_LARGE = 2 * 1024**2
"""``kRoundLarge``: such segments are rounded up to multiples of 2 MiB."""


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@dataclass(eq=False, slots=True)
class Block:
    addr: int
    size: int
    small: bool
    """Belongs to the small pool (its segment is a small-pool segment)."""
    free: bool = True
    prev: Block | None = None
    next: Block | None = None


_ADDRESS_BITS = 48
"""A free block's sort key is ``size << _ADDRESS_BITS | address``: one int orders like
(size, address) (smallest fitting, then lowest address) and compares far faster than a tuple.
Addresses are the sum of the segments reserved so far, far below 2**48 (256 TiB)."""
_ADDRESS_MASK = (1 << _ADDRESS_BITS) - 1


@dataclass
class _Pool:
    free: list[int] = field(default_factory=list)
    """Free blocks' keys (``size << _ADDRESS_BITS | address``), sorted."""
    by_addr: dict[int, Block] = field(default_factory=dict)

    def insert(self, block: Block) -> None:
        bisect.insort(self.free, block.size << _ADDRESS_BITS | block.addr)
        self.by_addr[block.addr] = block

    def remove(self, block: Block) -> None:
        free = self.free
        del free[bisect.bisect_left(free, block.size << _ADDRESS_BITS | block.addr)]
        del self.by_addr[block.addr]

    def take_best_fit(self, size: int) -> Block | None:
        """The smallest free block of at least ``size`` bytes (lowest address on ties), taken
        out of the pool."""
        free = self.free
        i = bisect.bisect_left(free, size << _ADDRESS_BITS)
        if i == len(free):
            return None
        key = free.pop(i)
        return self.by_addr.pop(key & _ADDRESS_MASK)


class CudaCachingAllocatorSim:
    """Allocated and reserved bytes of a sequence of allocations and frees."""

    def __init__(self) -> None:
        self.small, self.large = _Pool(), _Pool()
        self.allocated = 0
        self.reserved = 0
        self._next_addr = 0
        self.segments: list[tuple[int, int, bool]] = []
        """(address, size, small pool) of every segment taken from the device, in order."""

    def malloc(self, nbytes: int) -> Block:
        size = max(CUDA_MIN_BLOCK, round_up(nbytes, CUDA_MIN_BLOCK))
        small = size <= SMALL_SIZE
        pool = self.small if small else self.large
        block = pool.take_best_fit(size)
        if block is None:
            if small:
                segment = SMALL_BUFFER
            elif size < MIN_LARGE_ALLOC:
                segment = LARGE_BUFFER
            else:
                segment = round_up(size, ROUND_LARGE)
            if self._next_addr + segment > _ADDRESS_MASK:
                raise ValueError("more than 256 TiB reserved: beyond the simulation's addresses")
            block = Block(self._next_addr, segment, small)
            self.segments.append((block.addr, segment, small))
            self._next_addr += segment
            self.reserved += segment
        remaining = block.size - size
        if (remaining >= CUDA_MIN_BLOCK) if small else (remaining > SMALL_SIZE):
            after = block.next
            rest = Block(block.addr + size, remaining, small, True, block, after)
            if after is not None:
                after.prev = rest
            block.next = rest
            block.size = size
            pool.insert(rest)
        block.free = False
        self.allocated += block.size
        return block

    def free(self, block: Block) -> None:
        pool = self.small if block.small else self.large
        self.allocated -= block.size
        block.free = True
        before = block.prev
        if before is not None and before.free:
            pool.remove(before)
            _absorb(before, block)
            block = before
        after = block.next
        if after is not None and after.free:
            pool.remove(after)
            _absorb(block, after)
        pool.insert(block)


def _absorb(left: Block, right: Block) -> None:
    """Merge ``right`` into its free neighbour ``left`` (its segment's list loses ``right``)."""
    left.size += right.size
    left.next = beyond = right.next
    if beyond is not None:
        beyond.prev = left


@dataclass(frozen=True, kw_only=True)
class Blocks:
    """What an allocator hands out for a timeline's storages, event by event."""

    sizes: list[int]
    """Bytes of each storage's block (its requested bytes where the allocator does not round)."""
    reserved: list[int]
    """Bytes reserved after each event (empty when the allocator reserves nothing beyond what
    it allocates)."""
    addresses: list[int]
    """Address of each storage's block; -1 for none (host memory, zero bytes, an allocator that
    is not simulated)."""
    segments: list[tuple[int, int, bool]]
    """(address, size, small pool) of each segment reserved, in order; each is reserved by the
    first event after which ``reserved`` grows by its size."""


@dataclass(frozen=True, kw_only=True)
class AllocatorModel:
    name: str
    simulate_cuda: bool = False

    def block_sizes(
        self, nbytes: list[int], events: list[int], on_host: list[bool]
    ) -> tuple[list[int], list[int]]:
        """Per storage, the bytes the allocator hands out for it; and the reserved bytes after
        each event (empty when the allocator reserves nothing beyond what it allocates)."""
        blocks = self.blocks(nbytes, events, on_host)
        return blocks.sizes, blocks.reserved

    def blocks(self, nbytes: list[int], events: list[int], on_host: list[bool]) -> Blocks:
        """The allocator's blocks for the storages of ``events`` (``nbytes`` requested each,
        those ``on_host`` left out), simulated event by event."""
        if not self.simulate_cuda:
            return Blocks(
                sizes=list(nbytes), reserved=[], addresses=[-1] * len(nbytes), segments=[]
            )
        sim = CudaCachingAllocatorSim()
        malloc, free = sim.malloc, sim.free
        sizes = [0] * len(nbytes)
        addresses = [-1] * len(nbytes)
        blocks: dict[int, Block] = {}
        reserved: list[int] = []
        append = reserved.append
        for ev in events:
            if ev >= 0:
                n = nbytes[ev]
                if n > 0 and not on_host[ev]:  # zero-byte requests allocate nothing
                    block = blocks[ev] = malloc(n)
                    sizes[ev], addresses[ev] = block.size, block.addr
            else:
                block = blocks.pop(~ev, None)
                if block is not None:
                    free(block)
            append(sim.reserved)
        return Blocks(sizes=sizes, reserved=reserved, addresses=addresses, segments=sim.segments)


CPU_ALLOCATOR = AllocatorModel(name="cpu")
CUDA_CACHING_ALLOCATOR = AllocatorModel(name="cuda-caching", simulate_cuda=True)
