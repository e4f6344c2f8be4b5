"""bitsandbytes' paged optimizer states on the emulated GPU: CUDA unified memory, outside
PyTorch's allocator.

A paged optimizer (``PagedAdamW8bit``, ``PagedAdamW``, ... the optimizer of torchtune's
``llama3_2/1B_full_single_device`` config) keeps the states of every tensor of at least 1e5
elements (``Optimizer8bit.get_state_buffer``) in memory from ``cudaMallocManaged``
(``bitsandbytes.functional.get_paged``): the driver keeps it on the GPU while there is room and
pages it to host memory when there is not. PyTorch's caching allocator never hands it out, so
``torch.cuda.max_memory_allocated()`` and ``memory_reserved()`` of a real run do not count it,
and neither does this prediction's peak. A CPU-only bitsandbytes has no ``get_paged`` (and a
CPU tensor gets the non-paged fallback, as ``--target cpu`` predicts).

While the program runs on the emulated GPU, ``get_paged`` gives a fake tensor of the trace's
mode made outside the tracker (so no allocation is recorded; the optimizer's kernels update it in
place), and the bytes are added up for the notes and ``unified_memory_bytes``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from math import prod
from types import ModuleType
from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes

from vramledger.inputs.import_hooks import when_imported
from vramledger.trace.core.tracker import mark_outside_allocator

MODULE = "bitsandbytes.functional"


class PagedStates:
    """Stands in for bitsandbytes' ``get_paged`` on the emulated GPU (module docstring)."""

    def __init__(self, mode: Any) -> None:
        self.mode = mode
        self.nbytes = 0
        """Bytes of unified memory the program's paged optimizers asked for."""
        self._stack = contextlib.ExitStack()
        self._made: set[int] = set()
        """``id`` of each stand-in (they live as long as the optimizer's state)."""

    def _get_paged(
        self, *shape: int, dtype: torch.dtype = torch.float32, device: Any = None
    ) -> Any:
        self.nbytes += dtype.itemsize * prod(shape)
        with _disable_current_modes(), self.mode:  # the trace's fake mode alone: unrecorded
            made = torch.zeros(shape, dtype=dtype, device="cpu")
        mark_outside_allocator(made)
        self._made.add(id(made))
        return made

    def _fill(self, fill: Any) -> Any:
        """``bitsandbytes.functional.fill`` (a CUDA kernel on paged memory): a stand-in is made
        zero-filled, and ``fill(buff, 0)`` is all bitsandbytes asks of one."""

        def filled(a: Any, value: Any, *args: Any, **kwargs: Any) -> None:
            if id(a) in self._made:
                a.fill_(value)
                return
            fill(a, value, *args, **kwargs)

        return filled

    def _patch(self, module: ModuleType) -> None:
        for name, value in (("get_paged", self._get_paged), ("fill", self._fill(module.fill))):
            self._stack.callback(setattr, module, name, getattr(module, name))
            setattr(module, name, value)

    @contextlib.contextmanager
    def installed(self) -> Iterator[PagedStates]:
        with self._stack, when_imported(MODULE, self._patch):
            yield self

    def note(self) -> str | None:
        if not self.nbytes:
            return None
        return (
            f"paged optimizer states: {self.nbytes:,} bytes in CUDA unified memory "
            "(bitsandbytes' get_paged, cudaMallocManaged: outside PyTorch's caching allocator, "
            "so neither in this peak nor in torch.cuda.max_memory_allocated(); on the GPU while "
            "it has room, paged to host memory when not)"
        )
