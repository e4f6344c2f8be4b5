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

from ..checkpointing import checkpoint_modules, enable_hf_checkpointing
from ..errors import InputError, TraceError, VramledgerError
from ..optimizers import resolve_optimizer
from ..precision import cast_model, precision_policy
from ..sources import BatchShape, ModelSource, resolve_inputs, resolve_loss, resolve_model
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


def count_parameters(model: nn.Module) -> tuple[int, int]:
    params = list(model.parameters())  # shared (tied) parameters appear once
    return sum(p.numel() for p in params), sum(p.numel() for p in params if p.requires_grad)


def build_model(source: ModelSource, spec: TrainingSpec, device: str | torch.device) -> nn.Module:
    """Build the model on ``device`` (meta for tracing), in train mode, checkpointed and cast."""
    with torch.device(device):
        if str(device) == "meta":
            with source.skip_init():
                model = _build(source)
        else:
            model = _build(source)
    model.train()
    if spec.grad_checkpointing:
        if source.supports_hf_checkpointing:
            enable_hf_checkpointing(model)
        elif not spec.checkpoint_modules:
            raise InputError(
                "--grad-checkpointing uses the Hugging Face switch, and this model is Python code",
                hint="name the blocks to checkpoint with --checkpoint-modules CLASSNAME",
            )
    if spec.checkpoint_modules:
        checkpoint_modules(model, spec.checkpoint_modules)
    cast_model(model, precision_policy(spec.precision))
    _check_positions(model, spec)
    return model


def _build(source: ModelSource) -> nn.Module:
    try:
        return source.build()
    except VramledgerError:
        raise
    except NotImplementedError as exc:  # e.g. Tensor.item() on meta tensors in __init__
        raise TraceError(
            f"building {source.name} on the meta device failed: {str(exc).splitlines()[0]}",
            hint="its __init__ reads tensor values; use `vramledger measure` to run it for real",
        ) from exc


def _check_positions(model: nn.Module, spec: TrainingSpec) -> None:
    """Learned position tables index out of range silently on fake tensors; refuse instead."""
    for name, module in model.named_modules():
        if (
            isinstance(module, nn.Embedding)
            and ("position" in name or name.endswith("wpe"))
            and module.num_embeddings < spec.seq_len
        ):
            raise InputError(
                f"seq-len {spec.seq_len} exceeds the {module.num_embeddings} learned positions "
                f"of {name}",
                hint=f"use --seq-len {module.num_embeddings} or less",
            )


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
    source = resolve_model(spec.model, spec.task)
    make_inputs = resolve_inputs(spec.inputs, source)
    loss_fn = resolve_loss(spec.loss)
    precision = precision_policy(spec.precision)
    choice = policy.optimizer(resolve_optimizer(spec.optimizer, spec.optimizer_kwargs))
    model = build_model(source, spec, "meta")
    parameters, trainable = count_parameters(model)
    names = {id(m): (n or type(model).__name__) for n, m in model.named_modules()}

    mode = FakeTensorMode(allow_non_fake_inputs=False)
    fakeify(model, mode, TRACE_DEVICE)
    tracker = StorageTracker(
        module_names=names, op_observer=policy.op_observer(), corrections=CORRECTIONS
    )
    observer = TrackerObserver(tracker, policy.host_resident)
    shape = BatchShape(batch_size=spec.batch_size, seq_len=spec.seq_len, image_size=spec.image_size)
    notes: list[str] = []
    with mode, policy.context(), ordinary_batches(notes), tracker:
        try:
            batch = make_inputs(TRACE_DEVICE, shape)
            run = assemble(
                model=model,
                batch=batch,
                loss_fn=loss_fn,
                optimizer=choice,
                precision=precision,
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
    return TraceResult(
        timeline=timeline,
        model_name=source.name,
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
