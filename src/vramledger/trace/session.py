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

The main thread's stack may grow to ``GRAPH_STACK_BYTES`` (raised once, left so: see
:func:`room_for_deep_graphs`).

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
import resource
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


GRAPH_STACK_BYTES = 256 << 20
"""The main thread's stack limit a trace asks for. Every autograd node a trace reads from Python
(``torch._C._current_autograd_node()``, per backward call: ``core/backward_modules.py``,
``core/plain_branches.py``) keeps a Python object, and a node with one is freed through it:
freeing the graph then recurses one level (5 C frames) per such node where a plain run's
``deleteNode`` loops. Measured here (torch 2.13, a chain of ``sin`` nodes each read once, limit
raised in the running process as a trace raises it): the default 8 MiB overflowed (SIGSEGV)
between 40,000 and 100,000 nodes; 256 MiB freed 400,000 nodes (peak RSS 842 MB) and 1,000,000
(1.7 GB). A pipeline stage of 1,000 tiny Llama layers (35 nodes each) crashed at
8 MiB. Linux grows the main thread's stack on demand up to the soft limit, so raising it in the
running process takes effect."""


def room_for_deep_graphs() -> None:
    """Raise the soft stack limit to ``GRAPH_STACK_BYTES``, never past the hard limit and never
    lower. Left raised when the trace ends: its graphs may be freed after the session (with the
    objects that hold them), and a larger limit changes no figure."""
    soft, hard = resource.getrlimit(resource.RLIMIT_STACK)
    if soft == resource.RLIM_INFINITY:
        return
    want = GRAPH_STACK_BYTES if hard == resource.RLIM_INFINITY else min(GRAPH_STACK_BYTES, hard)
    if want > soft:
        resource.setrlimit(resource.RLIMIT_STACK, (want, hard))


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
    room_for_deep_graphs()
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
