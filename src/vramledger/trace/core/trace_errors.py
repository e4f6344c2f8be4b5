"""What a failed trace tells the user: which operator failed, in which module, and what to do
instead (one line and a hint, ``errors.TraceError``)."""

from __future__ import annotations

from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    UnsupportedOperatorException,
)

from vramledger.inputs.errors import TraceError
from vramledger.trace.core.tracker import StorageTracker

FAKE_LIMITS = (
    UnsupportedOperatorException,
    DataDependentOutputException,
    DynamicOutputShapeException,
)
"""What fake tensors cannot do: an operator with no fake kernel, or one that needs values."""


def trace_error(exc: Exception, tracker: StorageTracker, target: str = "cuda") -> TraceError:
    """Say which operator failed in which module, and what to do instead (a hint that is true for
    this run: ``--target cpu`` is suggested only to a CUDA estimate, and only where the CPU path
    could differ)."""
    where = tracker.module_of(exc) or "the training step"
    measure = "run it for real with `vramledger measure` (--debug shows the traceback)"
    hint = f"try --target cpu, or {measure}" if target == "cuda" else measure
    if isinstance(exc, FAKE_LIMITS):
        op = getattr(exc, "func", None)
        if isinstance(exc, UnsupportedOperatorException):
            return TraceError(
                f"operator {op} has no fake-tensor implementation (in module {where})", hint=hint
            )
        what = (
            "has an output shape that depends on tensor values"
            if isinstance(exc, DynamicOutputShapeException)
            else "needs tensor values"
        )
        return TraceError(
            f"operator {op} {what} (in module {where}), and these values are computed from the "
            "model's parameters, which a fake-tensor trace does not have (values computed from "
            "the batch alone are known)",
            hint=measure,
        )
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    if (
        "data-dependent" in text
        or "Data dependent" in text
        or "GuardOnDataDependent" in type(exc).__name__
    ):
        return TraceError(f"data-dependent control flow in module {where}: {text}", hint=measure)
    if "got mixed torch.Tensor and DTensor" in text and where == "the training step":
        # PyTorch's own limit, on a real run too: a foreach/fused optimizer step over a list
        # holding both the tensor plan's DTensor parameters and plain (replicated) ones
        return TraceError(
            f"the optimizer step mixes DTensor parameters (split by the tensor-parallel plan) "
            f"with plain ones (modules the plan leaves out), which PyTorch's foreach and fused "
            f"optimizer steps refuse ({text})",
            hint="shard the data-parallel axis with FSDP (--dp-shard N), make the plan cover "
            "every module, or step without foreach (--optimizer-kwargs '{\"foreach\": false}')",
        )
    return TraceError(f"{type(exc).__name__} in module {where}: {text}", hint=hint)
