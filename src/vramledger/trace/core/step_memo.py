"""Per-parameter optimizer steps that repeat: traced once per argument layout, replayed after.

torchao's low-bit Adam steps each parameter with its own call of ``single_param_adam``
(``torchao/optim/adam.py``), which it compiles; the trace runs each call as Inductor's
generated code (``compiled.py``, patched in under this memo), and a model's blocks repeat the
same few parameter shapes. What such a call allocates depends only on its arguments' layout
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
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from vramledger.trace.core.patched_functions import patched_functions
from vramledger.trace.core.recording import Recording
from vramledger.trace.core.tracker import StorageTracker

STEP_FUNCTIONS = (("torchao.optim.adam", "single_param_adam"),)
"""Module-level per-parameter step functions the optimizers call by name at each step (so a
patched module attribute is what they call)."""


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
def repeated_steps(tracker: StorageTracker) -> Iterator[None]:
    """Within this context, calls of ``STEP_FUNCTIONS`` with a layout already seen replay its
    recorded events instead of running."""
    with patched_functions(STEP_FUNCTIONS, lambda _m, _n, step: _memoised(step, tracker)):
        yield


def _memoised(step: Any, tracker: StorageTracker) -> Any:
    known: dict[Any, Recording | None] = {}

    def call(*args: Any, **kwargs: Any) -> Any:
        parameter = args[0] if args else None
        block = tracker.block_of(parameter)
        key = (block is None, layout(args), layout(tuple(sorted(kwargs.items()))))
        if key in known and known[key] is not None:
            tracker.replay(known[key], block)
            return None
        start = tracker.position()
        out = step(*args, **kwargs)
        if out is None and key not in known:
            known[key] = tracker.recording(start, block)
        return out

    return call
