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

import torch

from vramledger.inputs.notes import Note, Topic

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


INT8_QUANT = "bitsandbytes::int8_vectorwise_quant"
"""LLM.int8's quantization of an activation with an outlier threshold (bitsandbytes'
``MatMul8bitLt``, on a GPU): how many columns hold outliers depends on the values, which its
fake kernel cannot know (``new_dynamic_size``)."""


INT8_MIXED_MM = "bitsandbytes::int8_mixed_scaled_mm"
"""Its product with the outlier columns taken apart, whose number its fake kernel cannot know
either."""


class CpuKernels:
    """``substitutes`` with operators found by name (their library may be imported by the
    program after the trace began): on the CPU target (``cpu``) those of
    :data:`PYTHON_CPU_KERNELS`, run as their CPU kernel under ``mode`` (the tracker, entered
    again); on any target :data:`INT8_QUANT` with a threshold, answered with no outlier
    columns (an assumption, in the notes)."""

    def __init__(self, substitutes: dict[Any, Callable[..., Any]], mode: Any, *, cpu: bool) -> None:
        self.substitutes = substitutes
        self.mode = mode
        self.cpu = cpu
        self.ran: set[str] = set()
        """The operators run as their CPU kernel (for the notes)."""
        self.no_outliers = 0
        """Calls of :data:`INT8_QUANT` answered with no outlier columns."""

    def get(self, func: Any, default: Any = None) -> Any:
        found = self.substitutes.get(func)
        if found is not None:
            return found
        name = getattr(func, "_name", "")
        if name == INT8_QUANT:
            return self._int8_quant
        if name == INT8_MIXED_MM:
            return self._int8_mixed_mm
        where = PYTHON_CPU_KERNELS.get(name) if self.cpu else None
        kernel = getattr(sys.modules.get(where[0]), where[1], None) if where else None
        if kernel is None:
            return default
        self.ran.add(func._name)
        return partial(_reentered, self.mode, kernel)

    def _int8_quant(self, func: Any, a: Any, threshold: float = 0.0) -> Any:
        if threshold == 0.0:
            return func(a, threshold)
        self.no_outliers += 1
        out, stats, _ = func(a, 0.0)
        return out, stats, a.new_empty(0, dtype=torch.int64)

    def _int8_mixed_mm(
        self, _func: Any, a: Any, ca: Any, cb: Any, *_args: Any, **_kwargs: Any
    ) -> Any:
        """Its product, and the outlier columns' slice of the activation: none (as assumed by
        :meth:`_int8_quant`)."""
        self.no_outliers += 1
        out = a.new_empty((*ca.shape[:-1], cb.shape[0]))
        return out, a.new_empty((*a.shape[:-1], 0))

    def notes(self) -> list[str]:
        out = []
        if self.ran:
            out.append(
                Note(
                    Topic.KERNELS,
                    f"{', '.join(sorted(self.ran))} ran as its Python CPU kernel (its temporaries "
                    "recorded), as a CPU run runs it",
                )
            )
        if self.no_outliers:
            out.append(
                Note(
                    Topic.VALUES,
                    f"LLM.int8's outlier columns ({INT8_QUANT}, {INT8_MIXED_MM}: "
                    f"{self.no_outliers} calls): "
                    "no outlier columns assumed (how many columns exceed the threshold depends on "
                    "values the trace does not have; each outlier column adds a half-precision "
                    "slice of the activation and the weight)",
                )
            )
        return out


def _reentered(mode: Any, kernel: Callable[..., Any], _func: Any, *args: Any, **kwargs: Any) -> Any:
    with mode:
        return kernel(*args, **kwargs)
