"""Operators whose CPU kernel is written in Python with torch operators, run as that kernel when
the trace predicts a CPU run (``--target cpu``).

A custom operator's fake implementation makes its outputs and nothing else; where the CPU kernel
is a Python function of torch operators, a real CPU run allocates every temporary that function
makes. bitsandbytes' 8-bit optimizer update on the CPU (``bitsandbytes/backends/cpu/ops.py``,
``_optimizer_update_8bit_blockwise_cpu``) dequantizes both states to float32, makes float32
copies of the gradient and the parameter, updates them and quantizes the states back: about 28
bytes per parameter at its peak, where the CUDA kernel (fused, in place) makes none. Measured on
torchtune's ``llama3_2/1B_full_single_device`` (``PagedAdamW8bit``, one per parameter) on a
16.4 M-parameter tied embedding: the fake implementation left the CPU run's peak 213 MB (43 %)
above the prediction.

:class:`CpuKernels` is the tracker's table of substitutes (``tracker.StorageTracker``'s
``substitutes``) with these operators added by name (their library may be imported by the
program after the trace began); each runs its CPU kernel on the fake tensors with the tracker
active again, so the kernel's own operators are recorded.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from functools import partial
from typing import Any

PYTHON_CPU_KERNELS = {
    "bitsandbytes::optimizer_update_8bit_blockwise": (
        "bitsandbytes.backends.cpu.ops",
        "_optimizer_update_8bit_blockwise_cpu",
    ),
    "bitsandbytes::optimizer_update_32bit": (
        "bitsandbytes.backends.cpu.ops",
        "_optimizer_update_32bit_cpu",
    ),
}
"""Operator -> (module, function) of its Python CPU kernel (bitsandbytes 0.45-0.50: the kernels
``register_kernel(..., "cpu")`` registers)."""


class CpuKernels:
    """``substitutes`` with the operators of :data:`PYTHON_CPU_KERNELS` run as their CPU kernel
    under ``mode`` (the tracker, entered again)."""

    def __init__(self, substitutes: dict[Any, Callable[..., Any]], mode: Any) -> None:
        self.substitutes = substitutes
        self.mode = mode
        self.ran: set[str] = set()
        """The operators run as their CPU kernel (for the notes)."""

    def get(self, func: Any, default: Any = None) -> Any:
        found = self.substitutes.get(func)
        if found is not None:
            return found
        where = PYTHON_CPU_KERNELS.get(getattr(func, "_name", ""))
        kernel = getattr(sys.modules.get(where[0]), where[1], None) if where else None
        if kernel is None:
            return default
        self.ran.add(func._name)
        return partial(_reentered, self.mode, kernel)

    def note(self) -> str | None:
        if not self.ran:
            return None
        return (
            f"{', '.join(sorted(self.ran))} ran as its Python CPU kernel (its temporaries "
            "recorded), as a CPU run runs it"
        )


def _reentered(mode: Any, kernel: Callable[..., Any], _func: Any, *args: Any, **kwargs: Any) -> Any:
    with mode:
        return kernel(*args, **kwargs)
