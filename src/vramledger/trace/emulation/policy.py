"""Device policies: the decisions a target device makes that a trace must reproduce.

Tracing always runs on fake *CPU* tensors (a CPU-only PyTorch cannot run autograd on fake CUDA
tensors). Where CUDA decides differently from the CPU — the optimizer's default
implementation, autocast's operator lists, the attention kernel, allocator rounding, library
workspaces — a policy applies CUDA's decision during the trace (``cuda_policy.py``). The CPU
policy runs what PyTorch runs on CPU tensors and adds the scratch CPU kernels allocate inside
themselves (``cpu_scratch.py``).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import torch

from vramledger.inputs.host_cpu import CPU_KERNEL_VARIABLES
from vramledger.inputs.optimizers import OptimizerChoice
from vramledger.record.allocator import CPU_ALLOCATOR, AllocatorModel
from vramledger.trace.core.cpu_scratch import CpuScratchProbe, ScratchCache
from vramledger.trace.core.tracker import OpObserver


class DevicePolicy:
    """The interface, with neutral defaults: change nothing."""

    name = "none"
    allocator: AllocatorModel = CPU_ALLOCATOR

    def optimizer(self, choice: OptimizerChoice) -> OptimizerChoice:
        """The optimizer as the target would build it from the user's arguments."""
        return choice

    @contextlib.contextmanager
    def context(self) -> Iterator[None]:
        """Active around the whole traced step."""
        yield

    def op_observer(self) -> OpObserver | None:
        """Called after each traced operator (see ``tracker.OpObserver``)."""
        return None

    def host_resident(self, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
        """Tensors the target keeps in host memory rather than on the device."""
        return []

    def notes(self) -> list[str]:
        """What this policy changed, for the report."""
        return []

    def conditions(self) -> list[Any]:
        """What of this process, beside the spec, changes the traces under this policy (a
        trace cache's key, ``core/cache.py``): nothing but the target by default."""
        return []


class CpuPolicy(DevicePolicy):
    name = "cpu"

    def __init__(self, scratch_cache: ScratchCache | None = None) -> None:
        self._probe = CpuScratchProbe(scratch_cache)

    def op_observer(self) -> OpObserver | None:
        return self._probe

    def notes(self) -> list[str]:
        return self._probe.notes()

    def conditions(self) -> list[Any]:
        """The CPU kernels' scratch is measured in this process (``core/cpu_scratch.py``): it
        depends on the intra-op thread count and the instruction sets the kernels may use."""
        return [
            torch.get_num_threads(),
            torch.backends.cpu.get_cpu_capability(),
            *(os.environ.get(name) for name in CPU_KERNEL_VARIABLES),
        ]
