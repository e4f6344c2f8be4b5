"""``estimate``: the peak memory of a training step, predicted by tracing it on fake tensors."""

from __future__ import annotations

from typing import Any

from .ledger import Ledger, build_ledger
from .spec import TrainingSpec
from .trace.cuda_policy import CudaPolicy
from .trace.fake import trace
from .trace.policy import CpuPolicy, DevicePolicy
from .version import __version__


def policy_for(target: str) -> DevicePolicy:
    return CudaPolicy() if target == "cuda" else CpuPolicy()


def as_spec(spec: TrainingSpec | None, fields: dict[str, Any]) -> TrainingSpec:
    if spec is None:
        return TrainingSpec(**fields)
    if fields:
        from dataclasses import replace

        return replace(spec, **fields)
    return spec


def estimate(spec: TrainingSpec | None = None, /, **fields: Any) -> Ledger:
    """Predict the peak memory of ``spec``'s training step on its target device.

    ``estimate(TrainingSpec(model="config.json", ...))`` or ``estimate(model=..., ...)``.
    """
    spec = as_spec(spec, fields)
    policy = policy_for(spec.target)
    result = trace(spec, policy)
    return build_ledger(
        result.timeline,
        target=spec.target,
        allocator=policy.allocator,
        parameters=result.parameters,
        trainable_parameters=result.trainable_parameters,
        optimizer_state_bytes=result.optimizer_state_bytes,
        optimizer_state_method=result.optimizer_state_method,
        spec=spec.summary(),
        notes=result.notes,
        seconds=result.seconds,
        version=__version__,
    )
