"""What CUDA decides differently from the CPU, applied to a trace on fake CPU tensors.

Each decision is named with its source in PyTorch:

- **Optimizer implementation.** ``torch.optim`` picks the multi-tensor (``foreach``)
  implementation by default when every parameter is a CUDA tensor, the for-loop one on CPU
  (``_default_to_fused_or_foreach`` in ``torch/optim/optimizer.py``). The trace passes
  ``foreach=True`` unless the user chose ``foreach`` or ``fused``.
- **Step counters on the host.** Non-capturable, non-fused torch.optim optimizers keep
  ``state["step"]`` as a CPU scalar even for CUDA parameters (``torch.tensor(0.0,
  dtype=_get_scalar_dtype())`` in ``adam.py`` / ``adamw.py`` ``_init_group``); they are
  reported as host bytes, not device bytes.
- **Autocast operator lists** (``autocast_cuda.py``).
- **Allocator rounding**: the CUDA caching allocator's 512-byte blocks (``allocator.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from ..allocator import CUDA_CACHING_ALLOCATOR, AllocatorModel
from ..optimizers import OptimizerChoice
from .autocast_cuda import CudaAutocast
from .policy import DevicePolicy


class CudaPolicy(DevicePolicy):
    name = "cuda"
    allocator: AllocatorModel = CUDA_CACHING_ALLOCATOR

    def __init__(self) -> None:
        self._notes: list[str] = []

    def optimizer(self, choice: OptimizerChoice) -> OptimizerChoice:
        user_chose = "foreach" in choice.kwargs or choice.kwargs.get("fused")
        if choice.accepts("foreach") and not user_chose:
            self._notes.append(f"{choice.cls.__name__}: foreach implementation (CUDA's default)")
            return choice.with_defaults(foreach=True)
        return choice

    @contextlib.contextmanager
    def context(self) -> Iterator[None]:
        with CudaAutocast():
            yield

    def host_resident(self, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
        if not _is_torch_optim(optimizer):
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


def _is_torch_optim(optimizer: torch.optim.Optimizer) -> bool:
    return type(optimizer).__module__.startswith("torch.optim")
