"""Run the real training step on fake tensors: the model is built on the meta device (no
initialisation, no memory), its parameters become fake CPU tensors, and the step runs under
``FakeTensorMode`` with the storage tracker and the target's device policy.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch import nn
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensorMode,
    UnsupportedOperatorException,
)

from ..errors import TraceError, VramledgerError
from ..recipe import count_parameters, module_names, resolve
from ..spec import TrainingSpec
from ..timeline import Timeline
from ..training import assemble, optimizer_state_tensors
from .fake_corrections import CORRECTIONS
from .hf_compat import ordinary_batches
from .policy import DevicePolicy
from .tracker import StorageTracker, TrackerObserver

TRACE_DEVICE = torch.device("cpu")
"""Fake tensors carry the CPU device: CPU-only PyTorch cannot run autograd on fake CUDA tensors
(``InputMetadata`` asks for a CUDA device guard and the process aborts)."""


@dataclass(frozen=True, kw_only=True)
class TraceResult:
    timeline: Timeline
    model_name: str
    parameters: int
    trainable_parameters: int
    optimizer_state_bytes: int
    seconds: float
    notes: list[str] = field(default_factory=list)


def fakeify(model: nn.Module, mode: FakeTensorMode, device: torch.device) -> None:
    """Replace meta parameters and buffers by fake tensors on ``device``, keeping ties."""
    converter = mode.fake_tensor_converter
    memo: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is None:
                continue
            if id(p) not in memo:
                fake = converter.from_meta_and_device(mode, p.detach(), device)
                memo[id(p)] = nn.Parameter(fake, requires_grad=p.requires_grad)
            module._parameters[name] = memo[id(p)]
        for name, b in module._buffers.items():
            if b is None:
                continue
            if id(b) not in memo:
                memo[id(b)] = converter.from_meta_and_device(mode, b, device)
            module._buffers[name] = memo[id(b)]


def trace(spec: TrainingSpec, policy: DevicePolicy) -> TraceResult:
    """Run ``spec.steps`` training steps on fake tensors under ``policy``; return the Timeline."""
    start = time.perf_counter()
    recipe = resolve(spec)
    model = recipe.build_model("meta")
    parameters, trainable = count_parameters(model)
    names = module_names(model)

    mode = FakeTensorMode(allow_non_fake_inputs=False)
    fakeify(model, mode, TRACE_DEVICE)
    tracker = StorageTracker(
        module_names=names,
        op_observer=policy.op_observer(),
        corrections=CORRECTIONS,
        answer_optimizer_scalars=True,
    )
    observer = TrackerObserver(tracker, policy.host_resident)
    notes: list[str] = []
    with mode, policy.context(), ordinary_batches(notes), tracker:
        try:
            batch = recipe.make_inputs(TRACE_DEVICE, recipe.shape)
            run = assemble(
                model=model,
                batch=batch,
                loss_fn=recipe.loss_fn,
                optimizer=policy.optimizer(recipe.optimizer),
                precision=recipe.precision,
                device=TRACE_DEVICE,
                grad_accum=spec.grad_accum,
                observer=observer,
            )
            run.run(spec.steps, observer)
        except VramledgerError:
            raise
        except Exception as exc:
            raise trace_error(exc, tracker) from exc
        state_bytes = _state_bytes(run.optimizer)
    timeline = tracker.close()
    if tracker.scalars_answered:
        notes.append(
            f"optimizer.step() read {tracker.scalars_answered} scalar values with .item(); fake "
            "tensors have none, so 1 was used (scalars never change memory)"
        )
    return TraceResult(
        timeline=timeline,
        model_name=recipe.source.name,
        parameters=parameters,
        trainable_parameters=trainable,
        optimizer_state_bytes=state_bytes,
        seconds=time.perf_counter() - start,
        notes=policy.notes() + notes,
    )


def _state_bytes(optimizer: torch.optim.Optimizer) -> int:
    from .tracker import storages_of

    seen: dict[int, int] = {}
    for t in optimizer_state_tensors(optimizer):
        for st in storages_of(t):
            seen[st._cdata] = st.nbytes()
    return sum(seen.values())


_FAKE_LIMITS = (
    UnsupportedOperatorException,
    DataDependentOutputException,
    DynamicOutputShapeException,
)


def trace_error(exc: Exception, tracker: StorageTracker) -> TraceError:
    """Say which operator failed in which module, and what to do instead."""
    where = tracker.module_of(exc) or "the training step"
    hint = "use --target cpu with real tensors via `vramledger measure`, or pass --debug for the traceback"
    if isinstance(exc, _FAKE_LIMITS):
        op = getattr(exc, "func", None)
        why = {
            UnsupportedOperatorException: "has no fake-tensor implementation",
            DataDependentOutputException: "needs tensor values, which fake tensors do not have",
            DynamicOutputShapeException: "has an output shape that depends on tensor values",
        }[type(exc)]
        return TraceError(f"operator {op} {why} (in module {where})", hint=hint)
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    if (
        "data-dependent" in text
        or "Data dependent" in text
        or "GuardOnDataDependent" in type(exc).__name__
    ):
        return TraceError(f"data-dependent control flow in module {where}: {text}", hint=hint)
    return TraceError(f"{type(exc).__name__} in module {where}: {text}", hint=hint)
