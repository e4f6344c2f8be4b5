"""One trace session: what every fake run enters, vramledger's own step (``core/fake.py``) and the
user's program (``program/program_trace.py``) alike.

Both drivers run their code under the same environment, in the same order:

1. the target's device policy (``emulation/policy.py``: CUDA's decisions on a GPU target);
2. the conversions a fake parameter needs (``module.to(dtype)`` that changes nothing leaves it
   alone: ``core/fake_corrections.py``) and DTensor's sharding propagation kept out of the
   trace (``core/dtensor_compat.py``);
3. ``torch.compile``'d code run eagerly (``set_stance("force_eager")``) except
4. the regions ``compile/compiled.py`` models as Inductor runs them;
5. the storage tracker, built from the same options (:func:`tracker_options`).

The process's intra-op thread count is restored when the session ends: a program may set it
(Lightning's and accelerate's CPU launchers, torchtune's offload recipes do), and the CPU
kernels' scratch the next trace measures depends on it (``core/cpu_scratch.py``).

What differs is only the driver's own: the estimate's batch and Hugging Face value patches and
its attention record (``inner``, entered between 3 and 5), the program's CUDA emulation and
phase hooks (entered by it inside the session). The notes of what the tracker answered are
written once (:func:`tracker_notes`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import torch

from vramledger.inputs.notes import Note, Topic
from vramledger.record.timeline import Timeline
from vramledger.trace.compile.compiled import compiled_regions
from vramledger.trace.core.dtensor_compat import untracked_sharding_propagation
from vramledger.trace.core.fake_corrections import CORRECTIONS, SUBSTITUTES, noop_conversions
from vramledger.trace.core.tracker import StorageTracker
from vramledger.trace.core.values import KnownValues
from vramledger.trace.emulation.policy import DevicePolicy


@dataclass(frozen=True, kw_only=True)
class Traced:
    """What every trace gives, vramledger's step (``core/fake.py``'s ``TraceResult``) and a
    program (``program/program_trace.py``'s ``ProgramTrace``) alike."""

    timeline: Timeline
    """Every storage of the run, with its category, phase, module and lifetime."""
    parameters: int
    """Parameters of the model, counted once where tied; ``trainable_parameters``: those
    that train."""
    trainable_parameters: int
    seconds: float
    """Wall time of the trace."""
    notes: list[str] = field(default_factory=list)
    """What the trace assumed and did."""
    extended: bool = False
    """The timeline was extended from a few of the model's identical blocks
    (``core/blocks.py``), not traced in full."""


@contextlib.contextmanager
def trace_session(
    policy: DevicePolicy,
    tracker: StorageTracker,
    notes: list[str],
    *,
    inner: Iterable[AbstractContextManager[Any]] = (),
) -> Iterator[None]:
    """The environment of a traced run (module docstring): ``inner`` is entered inside the
    policy and the eager stance, just before the tracker."""
    with contextlib.ExitStack() as stack:
        stack.callback(torch.set_num_threads, torch.get_num_threads())
        stack.enter_context(policy.context())
        stack.enter_context(noop_conversions())
        stack.enter_context(untracked_sharding_propagation())
        stack.enter_context(torch.compiler.set_stance("force_eager"))
        for manager in inner:
            stack.enter_context(manager)
        stack.enter_context(tracker)
        stack.enter_context(compiled_regions(tracker, notes, policy.name))
        yield


def tracker_options(
    policy: DevicePolicy,
    values: KnownValues,
    *,
    op_categories: Any = None,
    resize_category: Any = None,
) -> dict[str, Any]:
    """The keyword arguments every trace's tracker takes alike: the policy's scratch probe, the
    fake kernels' corrections and substitutes, the optimizer's scalars answered, the known
    values, and the engine's categories (None: a single device's)."""
    return {
        "op_observer": policy.op_observer(),
        "corrections": CORRECTIONS,
        "substitutes": SUBSTITUTES,
        "answer_optimizer_scalars": True,
        "values": values,
        "op_categories": op_categories,
        "resize_category": resize_category,
    }


def tracker_notes(tracker: StorageTracker) -> list[str]:
    """What the tracker answered in place of values a fake tensor lacks, and the plain-run
    branches of autograd it took (``core/plain_branches.py``)."""
    notes = list(tracker.plain_branches.notes())
    if tracker.scalars_answered:
        notes.append(
            Note(
                Topic.VALUES,
                "optimizer.step() read scalar values with .item(); fake tensors have none, so "
                f"{tracker.scalar_answer} was used (scalars never change memory)",
            )
        )
    return notes
