"""Per-parameter optimizer steps that repeat: traced once per argument layout, replayed after.

torchao's low-bit Adam steps each parameter with its own call of ``single_param_adam``
(``torchao/optim/adam.py``), which it compiles (``torch.compile(fullgraph=True,
dynamic=False)``); the trace runs it as Inductor does (``compiled.py``: Inductor's generated
wrapper on the fake inputs), or eagerly where Inductor cannot compile it here, and a model's
blocks repeat the same few parameter shapes. What such a call allocates depends only on its arguments' layout
(the shapes, strides, dtypes and subclass structure of the parameter, its gradient and its
states, and the scalar hyper-parameters): no value decides a size. So the first call of each
layout runs and its events are recorded (``StorageTracker.recording``: only if they are
self-contained, every storage it makes freed before it returns); a later call of the same layout
appends the same events again, labelled with its own block (``StorageTracker.replay``), instead
of running. The timeline is the one running every call makes (``tests/test_blocks.py`` checks it
against traces without the memo); the parameters' fake values are not updated, which nothing
reads.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from ..units import format_bytes
from .compiled import REGIONS, RegionLog, RegionNotModelled, call_figures
from .tracker import Recording, StorageTracker

TORCHAO_COMPILE = {"fullgraph": True, "dynamic": False}
"""How torchao compiles its step: ``torch.compile(single_param_adam, fullgraph=True,
dynamic=False)`` in ``_AdamBase.step`` (``torchao/optim/adam.py``)."""
STEP_FUNCTIONS = (("torchao.optim.adam", "single_param_adam", TORCHAO_COMPILE),)
"""Module-level per-parameter step functions the optimizers call by name at each step (so a
patched module attribute is what they call), with the ``torch.compile`` options they are
compiled with."""


def layout(value: Any) -> Any:
    """What of an argument can change what a step allocates: a tensor's type, shape, strides,
    offset, dtype and device, and a wrapper subclass's own layout and inner tensors'; other
    values as they are."""
    if isinstance(value, torch.Tensor):
        own = (
            type(value).__name__,
            tuple(value.shape),
            tuple(value.stride()),
            value.dtype,
            value.device.type,
        )
        if is_traceable_wrapper_subclass(value):
            attrs, ctx = value.__tensor_flatten__()
            return (*own, repr(ctx), tuple(layout(getattr(value, a)) for a in attrs))
        return (*own, value.storage_offset())
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(layout(v) for v in value))
    return (type(value).__name__, value)


@contextlib.contextmanager
def repeated_steps(
    tracker: StorageTracker, notes: list[str] | None = None, target: str = "cpu"
) -> Iterator[None]:
    """Within this context, calls of ``STEP_FUNCTIONS`` run compiled as Inductor runs them
    (``compiled.py``), and a layout already seen replays its recorded events instead of
    running. What the compiled regions did is added to ``notes`` (for ``target``)."""
    patched: list[tuple[Any, str, Any]] = []
    log = RegionLog()
    for module_name, name, options in STEP_FUNCTIONS:
        try:
            module = importlib.import_module(module_name)
        except ImportError:  # pragma: no cover - torchao not installed
            continue
        original = getattr(module, name, None)
        if original is None:  # pragma: no cover - other torchao versions
            continue
        patched.append((module, name, original))
        region = f"{module_name}.{name}"
        setattr(module, name, _memoised(original, tracker, region, options, log))
    try:
        yield
    finally:
        for module, name, original in patched:
            setattr(module, name, original)
        if notes is not None:
            notes.extend(n for n in log.notes(target) if n not in notes)


def _memoised(
    step: Any, tracker: StorageTracker, region: str, options: dict[str, Any], log: RegionLog
) -> Any:
    known: dict[Any, Recording | None] = {}

    def call(*args: Any, **kwargs: Any) -> Any:
        parameter = args[0] if args else None
        block = tracker.block_of(parameter)
        signature = (layout(args), layout(tuple(sorted(kwargs.items()))), torch.is_grad_enabled())
        key = (block is None, signature)
        if key in known and known[key] is not None:
            tracker.replay(known[key], block)
            return None
        start = tracker.position()
        try:
            out = REGIONS.run(
                region, step, args, kwargs, signature=signature, log=log, options=options
            )
        except RegionNotModelled as exc:
            out = step(*args, **kwargs)
            if region not in log.eager:
                eager, outputs = call_figures(tracker.timeline, start)
                log.eager[region] = (
                    f"{exc}; its first call's temporaries peak at {format_bytes(eager)} "
                    f"eagerly, {format_bytes(outputs)} counting its outputs only"
                )
        if out is None and key not in known:
            known[key] = tracker.recording(start, block)
        return out

    return call
