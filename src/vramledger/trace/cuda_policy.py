"""What CUDA decides differently from the CPU, applied to a trace on fake CPU tensors.

Each decision is named with its source in PyTorch 2.13:

- **Optimizer implementation.** ``torch.optim`` picks the multi-tensor (``foreach``)
  implementation by default when every parameter is a CUDA tensor, the for-loop one on CPU
  (``_default_to_fused_or_foreach`` in ``torch/optim/optimizer.py``). The trace passes
  ``foreach=True`` unless the user chose ``foreach`` or ``fused``.
- **Step counters on the host.** Non-capturable, non-fused torch.optim optimizers keep
  ``state["step"]`` as a CPU scalar even for CUDA parameters (``_init_group`` in ``adam.py``:
  "Deliberately host `step` on CPU if both capturable and fused are off"); reported as host
  bytes, not device bytes.
- **Autocast operator lists** (``autocast_cuda.py``).
- **Attention kernel choice and what it keeps** (``sdpa_cuda.py``).
- **cuBLAS workspace.** The first cuBLAS call of each thread allocates a workspace through the
  caching allocator, kept for the life of the process (``getNewWorkspace`` in
  aten/src/ATen/cuda/CublasHandlePool.cpp; default ``:4096:8`` = 32 MiB on Hopper, else
  ``:4096:2:16:8`` = 8 MiB + 128 KiB). Handles are per thread and backward runs on the autograd
  engine's CUDA device thread, so a training step holds two. cuBLASLt shares it
  (``TORCH_CUBLASLT_UNIFIED_WORKSPACE`` on by default).
- **Allocator rounding**: the CUDA caching allocator's 512-byte blocks (``allocator.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from ..allocator import CUDA_CACHING_ALLOCATOR, AllocatorModel
from ..categories import Category, Phase
from ..optimizers import OptimizerChoice
from .autocast_cuda import CudaAutocast
from .policy import DevicePolicy
from .sdpa_cuda import BACKWARD_WORKSPACE, HOST_OUTPUTS, CudaSdpa
from .tracker import OpObserver, StorageTracker

aten = torch.ops.aten

CUBLAS_WORKSPACE_HOPPER = 4096 * 1024 * 8
"""``:4096:8`` — the default for compute capability 9.x and newer (32 MiB)."""
CUBLAS_WORKSPACE_DEFAULT = 4096 * 1024 * 2 + 16 * 1024 * 8
"""``:4096:2:16:8`` — the default before Hopper (8 MiB + 128 KiB)."""
CUBLAS_OPS = frozenset(
    {
        aten.mm.default,
        aten.addmm.default,
        aten.bmm.default,
        aten.baddbmm.default,
        aten.addbmm.default,
        aten.mv.default,
        aten.addmv.default,
        aten.dot.default,
        aten.vdot.default,
        aten._addmm_activation.default,
    }
)
"""Operators whose CUDA kernels call cuBLAS/cuBLASLt (``at::cuda::blas``)."""


class CudaPolicy(DevicePolicy):
    name = "cuda"
    allocator: AllocatorModel = CUDA_CACHING_ALLOCATOR

    def __init__(self, *, compute_capability: tuple[int, int] = (9, 0)) -> None:
        self.compute_capability = compute_capability
        self._notes: list[str] = [
            f"CUDA behaviour emulated for compute capability {compute_capability[0]}.{compute_capability[1]}"
        ]

    @property
    def cublas_workspace_bytes(self) -> int:
        return (
            CUBLAS_WORKSPACE_HOPPER if self.compute_capability[0] >= 9 else CUBLAS_WORKSPACE_DEFAULT
        )

    def optimizer(self, choice: OptimizerChoice) -> OptimizerChoice:
        user_chose = "foreach" in choice.kwargs or choice.kwargs.get("fused")
        if choice.accepts("foreach") and not user_chose:
            self._notes.append(f"{choice.cls.__name__}: foreach implementation (CUDA's default)")
            return choice.with_defaults(foreach=True)
        return choice

    @contextlib.contextmanager
    def context(self) -> Iterator[None]:
        with CudaAutocast(), CudaSdpa():
            yield

    def op_observer(self) -> OpObserver:
        threads_with_workspace: set[str] = set()
        workspace = self.cublas_workspace_bytes

        def observe(
            func: Any,
            args: tuple[Any, ...],
            kwargs: dict[str, Any],
            out: Any,
            tracker: StorageTracker,
        ) -> None:
            if func in CUBLAS_OPS:
                thread = "autograd" if tracker.phase is Phase.BACKWARD else "main"
                if thread not in threads_with_workspace:
                    threads_with_workspace.add(thread)
                    tracker.add_synthetic(
                        workspace, f"cuBLAS workspace ({thread} thread)", Category.WORKSPACE
                    )
            scratch = BACKWARD_WORKSPACE.get(func)
            if scratch is not None:
                for label, nbytes in scratch(args):
                    tracker.add_transient(nbytes, label)
            host = HOST_OUTPUTS.get(func)
            if host is not None:
                tracker.mark_host(out[i] for i in host if isinstance(out[i], torch.Tensor))

        return observe

    def host_resident(self, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
        if not type(optimizer).__module__.startswith("torch.optim"):
            return []
        out = []
        for group in optimizer.param_groups:
            if group.get("capturable") or group.get("fused"):
                continue
            for p in group["params"]:
                step = optimizer.state.get(p, {}).get("step")
                if isinstance(step, torch.Tensor) and step.dim() == 0:
                    out.append(step)
        return out

    def notes(self) -> list[str]:
        return list(dict.fromkeys(self._notes))
