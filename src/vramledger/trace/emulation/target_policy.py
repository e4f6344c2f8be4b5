"""The device policy of a target: CPU's, or CUDA's decisions for a GPU's compute capability.

Every trace (``predict.estimate``, the planner's re-traces) and every measured ledger (whose
allocator model rounds like the device it ran on) takes its policy from here.
"""

from __future__ import annotations

from typing import Protocol

from vramledger.inputs.gpus import Gpu, modelled_compute_capability
from vramledger.trace.core.cpu_scratch import ScratchCache
from vramledger.trace.emulation.cuda_policy import CudaPolicy
from vramledger.trace.emulation.policy import CpuPolicy, DevicePolicy


class Target(Protocol):
    """What :func:`policy_for` reads of a spec: its target and its GPU (``TrainingSpec``)."""

    @property
    def target(self) -> str: ...

    def gpu_kind(self) -> Gpu | None: ...


def policy_for(spec: Target | str, scratch_cache: ScratchCache | None = None) -> DevicePolicy:
    """The decisions of ``spec``'s target: on CUDA those of its GPU's compute capability
    (``spec.gpu``; 9.0 when none is given, said in the notes; AMD GPUs are refused). A bare
    target name (``measure``'s real device) gets the default. ``scratch_cache``: on CPU, the
    kernel scratch already probed by the other traces of the same estimate
    (``trace/core/cpu_scratch.py``)."""
    target = spec if isinstance(spec, str) else spec.target
    if target != "cuda":
        return CpuPolicy(scratch_cache)
    gpu = None if isinstance(spec, str) else spec.gpu_kind()
    if gpu is None:
        return CudaPolicy()
    return CudaPolicy(compute_capability=modelled_compute_capability(gpu), gpu=gpu.name)
