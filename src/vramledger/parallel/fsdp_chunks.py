"""FSDP2's parameter chunks on fake tensors, made only when read.

``fully_shard`` splits each parameter into one chunk per rank of the shard mesh and keeps this
rank's (``FSDPParam._init_sharded_param``: ``_chunk_with_empty(param, world, dim)[rank]``, and
chunk 0 for the padded size). On a fake tensor every chunk is a fake-tensor view made through
``FakeTensorMode``: a Llama-3-70B trace over 64 ranks made 2,500 of them, 0.3 s of a 2.5 s
estimate (``benchmarks/estimate_phases.py``), for two that are read. While ``lazy_chunks`` is
active, ``_chunk_with_empty`` of a fake tensor returns :class:`LazyChunks`, a sequence of the
same chunks each made when indexed, by the view ``torch.chunk`` makes (``narrow``: ATen's
``chunk`` is ``split`` by ``ceil(size / chunks)``, and ``split`` narrows); real tensors get
FSDP2's own function. Nothing is recorded while parameters are sharded (the storage tracker
starts after), and the chunks' sizes, strides and offsets are ``torch.chunk``'s
(``tests/test_fsdp_chunks.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any, overload

import torch
from torch._subclasses.fake_tensor import FakeTensor

from vramledger.trace.core.patched_functions import patched_functions

CHUNK_FUNCTION = ("torch.distributed.fsdp._fully_shard._fsdp_param", "_chunk_with_empty")
"""FSDP2's chunking helper, looked up by name in the module that calls it (torch 2.13)."""


class LazyChunks(Sequence[torch.Tensor]):
    """``_chunk_with_empty(tensor, num_chunks, dim)``: ``torch.chunk``'s chunks, then empty
    tensors up to ``num_chunks``, each made when read."""

    def __init__(self, tensor: torch.Tensor, num_chunks: int, dim: int) -> None:
        self._tensor = tensor
        self._num_chunks = num_chunks
        self._dim = dim
        self._size = tensor.size(dim)
        self._step = -(-self._size // num_chunks)
        self._made = -(-self._size // self._step)
        """How many chunks ``torch.chunk`` makes (fewer than asked when the size is small)."""

    def __len__(self) -> int:
        return self._num_chunks

    @overload
    def __getitem__(self, index: int) -> torch.Tensor: ...

    @overload
    def __getitem__(self, index: slice) -> list[torch.Tensor]: ...

    def __getitem__(self, index: int | slice) -> torch.Tensor | list[torch.Tensor]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(self._num_chunks))]
        if index < 0:
            index += self._num_chunks
        if not 0 <= index < self._num_chunks:
            raise IndexError(f"chunk {index} of {self._num_chunks}")
        if index >= self._made:
            return self[0].new_empty(0)
        start = index * self._step
        return self._tensor.narrow(self._dim, start, min(self._step, self._size - start))


@contextlib.contextmanager
def lazy_chunks() -> Iterator[None]:
    """While active, FSDP2 chunks fake parameters with :class:`LazyChunks`."""

    def wrap(_module: str, _name: str, original: Any) -> Any:
        def chunk_with_empty(tensor: torch.Tensor, num_chunks: int, dim: int) -> Any:
            if not isinstance(tensor, FakeTensor) or tensor.size(dim) == 0:
                return original(tensor, num_chunks, dim)
            return LazyChunks(tensor, num_chunks, dim)

        return chunk_with_empty

    with patched_functions([CHUNK_FUNCTION], wrap):
        yield
