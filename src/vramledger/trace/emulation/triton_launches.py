"""Triton kernels a program launches on the emulated GPU: not run, counted.

Where the program is told its tensors are CUDA tensors (``device_mappings.FakeCuda.reports_cuda``)
and Triton is installed (it is, beside every CUDA build of PyTorch), libraries take their
Triton paths: a kernel ``fn[grid](*args)`` on fake tensors, which Triton cannot compile or launch
without a GPU. A Triton kernel writes into tensors its caller allocated through PyTorch (those
allocations are recorded as any other); the kernel itself allocates nothing from PyTorch's
allocator. So a launch with a fake tensor among its arguments does nothing here and is counted
by kernel name for the notes; an autotuner picks its first configuration without timing any
(timing would launch them).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from types import ModuleType
from typing import Any

from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._pytree import tree_leaves

from vramledger.inputs.import_hooks import when_imported

JIT_MODULE = "triton.runtime.jit"
AUTOTUNER_MODULE = "triton.runtime.autotuner"


def _fake_among(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    return any(isinstance(a, FakeTensor) for a in tree_leaves((list(args), kwargs)))


class TritonLaunches:
    """Triton launches on fake tensors skipped and counted (module docstring)."""

    def __init__(self) -> None:
        self.launched: dict[str, int] = {}
        self._stack = contextlib.ExitStack()

    def _patch_jit(self, module: ModuleType) -> None:
        cls = module.JITFunction
        run = cls.run
        launched = self.launched

        def skipped(kernel: Any, *args: Any, grid: Any, warmup: Any, **kwargs: Any) -> Any:
            if not _fake_among(args, kwargs):
                return run(kernel, *args, grid=grid, warmup=warmup, **kwargs)
            name = getattr(kernel, "__name__", None) or repr(kernel)
            launched[name] = launched.get(name, 0) + 1
            return None

        cls.run = skipped
        self._stack.callback(setattr, cls, "run", run)

    def _patch_autotuner(self, module: ModuleType) -> None:
        cls = module.Autotuner
        bench = cls._bench

        def untimed(tuner: Any, *args: Any, config: Any, **kwargs: Any) -> Any:
            if not _fake_among(args, kwargs):
                return bench(tuner, *args, config=config, **kwargs)
            return 0.0  # every configuration alike: the first is taken

        cls._bench = untimed
        self._stack.callback(setattr, cls, "_bench", bench)

    @contextlib.contextmanager
    def installed(self) -> Iterator[TritonLaunches]:
        with (
            self._stack,
            when_imported(JIT_MODULE, self._patch_jit),
            when_imported(AUTOTUNER_MODULE, self._patch_autotuner),
        ):
            yield self

    def note(self) -> str | None:
        if not self.launched:
            return None
        kernels = ", ".join(f"{n} ×{c}" for n, c in sorted(self.launched.items()))
        return (
            f"Triton kernels the program launched on the emulated GPU (not run; a kernel "
            f"allocates nothing from PyTorch's allocator, its buffers are the caller's): {kernels}"
        )
