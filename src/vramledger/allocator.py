"""Allocator models: from the bytes tensors ask for to the bytes an allocator hands out.

``torch.cuda.max_memory_allocated()`` counts allocator blocks, and the CUDA caching allocator
rounds every request up to a multiple of 512 bytes (``kMinBlockSize``). The CPU allocator
(``c10::DefaultCPUAllocator``) reports the requested size to the profiler unrounded.
Known limitations: reserved-but-unallocated memory (fragmentation, cached segments) and the
CUDA context are not allocations and are not modelled here.
"""

from __future__ import annotations

from dataclasses import dataclass

CUDA_MIN_BLOCK = 512
"""``kMinBlockSize`` in c10/cuda/CUDACachingAllocator.cpp: all sizes are rounded to multiples of
512 bytes (``round_size``)."""


@dataclass(frozen=True, kw_only=True)
class AllocatorModel:
    name: str
    block: int
    """Requests are rounded up to a multiple of this many bytes (1 = no rounding)."""

    def block_bytes(self, nbytes: int) -> int:
        if nbytes <= 0:
            return 0
        return -(-nbytes // self.block) * self.block


CPU_ALLOCATOR = AllocatorModel(name="cpu", block=1)
CUDA_CACHING_ALLOCATOR = AllocatorModel(name="cuda-caching", block=CUDA_MIN_BLOCK)
