"""A program's model of many identical blocks, traced at a few and extended to all, as
``estimate`` does (``blocks.py``).

The program builds its model by its own code (``LlamaForCausalLM(config)``, a ``ModuleList`` of
its own blocks); when it first moves a module with one list of at least ``MIN_BLOCKS``
identical blocks to "cuda" (``Module.cuda()``, ``.to("cuda")``), the list is cut to its first
``SMALL`` blocks (:class:`ShallowModel`) and the blocks are labelled for the tracker. The program
runs on with the shallow model, then once more with ``SMALL + 1`` blocks. Extending the first
timeline to ``SMALL + 1`` blocks must give the second, event for event, or the program runs a
third time with every block (:func:`trace_program_blocks`); a program that fails with the
shallow model (it reads its depth elsewhere: ``model.blocks[i]`` for ``i`` up to its own
count) runs with every block too. The notes say which.

The program's output is shown once: the first run's up to the move, the second run's from
the move once it is verified (or the full run's). In the second run
``torch.cuda.memory_allocated()`` and the rest answer from the extended timeline at the
moment that corresponds (:class:`ExtendedCounter`), so what the program prints is the
prediction for its full model.

Not extended: a model built on the device (under ``torch.device("cuda")``, a ``device_map``),
whose blocks are on the device before any move; a model with no such list, or with two.
"""

from __future__ import annotations

import contextlib
import io
import sys
from collections.abc import Iterator
from dataclasses import replace
from typing import Any, Literal

from torch import nn

from vramledger.inputs.notes import Note, Topic
from vramledger.inputs.program import ProgramFailed, ProgramSpec
from vramledger.record.timeline import Timeline
from vramledger.trace.core.blocks import (
    HEAD,
    MIN_BLOCKS,
    SMALL,
    NotExtensible,
    extend,
    extended_counts,
    extension_note,
    find_block_stack,
    same_timeline,
)
from vramledger.trace.core.blocks import truncate as truncate_stack
from vramledger.trace.emulation.cuda_api import EmulatedGpu
from vramledger.trace.emulation.policy import DevicePolicy
from vramledger.trace.program.program_trace import ProgramTrace, trace_program
from vramledger.trace.program.program_tracker import TimelineCounter

Gate = Literal["pass", "drop", "hold"]


class OutputGate(io.TextIOBase):
    """``sys.stdout`` / ``sys.stderr`` while a run of the program goes on: its writes pass
    through, are dropped (already shown by an earlier run, or from a run that is not the
    answer) or held until :meth:`release`."""

    def __init__(self, stream: Any, state: Gate) -> None:
        super().__init__()
        self.stream = stream
        self.state: Gate = state
        self.held: list[str] = []

    def write(self, text: str) -> int:
        if self.state == "pass":
            self.stream.write(text)
        elif self.state == "hold":
            self.held.append(text)
        return len(text)

    def flush(self) -> None:
        if self.state == "pass":
            self.stream.flush()

    def isatty(self) -> bool:
        return False

    def release(self) -> None:
        self.stream.write("".join(self.held))
        self.held.clear()
        self.state = "pass"


class _Gates:
    """Both streams' gates."""

    def __init__(self, state: Gate) -> None:
        self.out = OutputGate(sys.stdout, state)
        self.err = OutputGate(sys.stderr, state)

    def set(self, state: Gate) -> None:
        self.out.state = self.err.state = state

    def release(self) -> None:
        self.out.release()
        self.err.release()

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        saved = sys.stdout, sys.stderr
        sys.stdout, sys.stderr = self.out, self.err  # type: ignore[assignment]
        try:
            yield
        finally:
            sys.stdout, sys.stderr = saved


class ShallowModel:
    """Told of each module the program moves to "cuda" (``FakeCuda.moves``): the first one
    with a list of identical blocks has it cut to ``depth`` blocks (None: kept whole), its
    blocks labelled for the tracker, and ``gates`` set to ``then``."""

    def __init__(self, depth: int | None, gates: _Gates, then: Gate) -> None:
        self.depth = depth
        self.gates = gates
        self.then: Gate = then
        self.tracker: Any = None
        """The program's tracker (set by ``trace_program``)."""
        self.length: int | None = None
        """The program's own number of blocks, once found."""
        self.blocks_id: int | None = None
        """id() of the list (no reference: the program's model is freed when it ends, as in a
        run of every block)."""
        self._moving: nn.ModuleList | None = None

    def before_move(self, module: nn.Module) -> None:
        if self.length is not None:
            return
        stack = find_block_stack(module)
        if stack is None:
            return
        self.length = stack.length
        if self.depth is not None:
            truncate_stack(module, stack, self.depth)
        self._moving = module.get_submodule(stack.fqn)
        self.blocks_id = id(self._moving)
        self.gates.set(self.then)

    def after_move(self, module: nn.Module) -> None:
        if self.depth is not None and self._moving is not None:
            self.tracker.set_blocks(list(self._moving))
        self._moving = None

    def prefix(self) -> str:
        """The list's name in the timeline's module names (from the program's first
        forward)."""
        name = self.tracker.module_names.get(self.blocks_id)
        if not name:
            raise NotExtensible("the list of blocks never ran in a forward")
        return name


class ExtendedCounter:
    """``torch.cuda.memory_allocated()`` and the rest during the ``SMALL + 1``-block run, from
    the extended timeline: the run's ``n`` events so far are the first ``n`` of
    ``extend(first, SMALL, SMALL + 1)``, each of which lies at a known place in
    ``extend(first, SMALL, depth)`` (``origins``: a middle block's event at the same block, the
    last block's at the new last)."""

    def __init__(
        self,
        live: Timeline,
        full: TimelineCounter,
        index: list[int],
    ) -> None:
        self.live = live
        self.full = full
        self.index = index
        self._reset = 0

    def _at(self) -> int:
        """Events of the full timeline up to this moment."""
        n = min(len(self.live.events), len(self.index))
        return self.index[n - 1] + 1 if n else 0

    def _now(self, series: list[int]) -> int:
        at = self._at()
        return series[at - 1] if at else 0

    def _most(self, series: list[int]) -> int:
        at, start = self._at(), min(self._reset, self._at())
        before = series[start - 1] if start else 0
        return max([before, *series[start:at]])

    def allocated(self) -> int:
        return self._now(self.full._series()[0])

    def max_allocated(self) -> int:
        return self._most(self.full._series()[0])

    def reserved(self) -> int:
        return self._now(self.full._series()[1])

    def max_reserved(self) -> int:
        return self._most(self.full._series()[1])

    def reset_peak(self) -> None:
        self._reset = self._at()


def _index(small: list[tuple[int, int]], full: list[tuple[int, int]], depth: int) -> list[int]:
    """For each event of the ``SMALL + 1``-block extension (``small`` origins), its index in the
    ``depth``-block one (``full`` origins)."""
    last = SMALL

    def key(origin: tuple[int, int]) -> tuple[int, int]:
        e, j = origin
        return (e, depth - 1) if j == last else (e, j)

    wanted = {key(o) for o in small}
    where: dict[tuple[int, int], int] = {}
    for i, o in enumerate(full):
        if o in wanted and o not in where:
            where[o] = i
    try:
        return [where[key(o)] for o in small]
    except KeyError as exc:
        raise NotExtensible(f"no place in the extended timeline for event {exc}") from None


def trace_program_blocks(spec: ProgramSpec, policy: DevicePolicy, gpu: EmulatedGpu) -> ProgramTrace:
    """Trace the program, extending its model's blocks where it has a list of identical ones
    (module docstring); else as ``trace_program``."""
    gates = _Gates("pass")
    first = ShallowModel(SMALL, gates, then="drop")
    try:
        with gates.installed():
            a = trace_program(spec, policy, gpu, moves=first)
    except ProgramFailed as failed:
        if first.length is None:
            raise
        return _every_block(spec, policy, gpu, first.length, f"with {SMALL} it raised {failed}")
    if first.length is None:
        return a  # nothing cut: that was the whole program
    length = first.length
    try:
        prefix = first.prefix()
        origins_small: list[tuple[int, int]] = []
        origins_full: list[tuple[int, int]] = []
        expected = extend(a.timeline, SMALL, SMALL + 1, prefix, origins_small)
        full = extend(a.timeline, SMALL, length, prefix, origins_full)
        index = _index(origins_small, origins_full, length)
    except NotExtensible as exc:
        return _every_block(spec, policy, gpu, length, str(exc))
    counter = TimelineCounter(full, policy.allocator)
    gates = _Gates("drop")
    second = ShallowModel(SMALL + 1, gates, then="hold")
    try:
        with gates.installed():
            b = trace_program(
                spec,
                policy,
                gpu,
                moves=second,
                counter=lambda live, _allocator: ExtendedCounter(live, counter, index),
            )
    except ProgramFailed as failed:
        return _every_block(spec, policy, gpu, length, f"with {SMALL + 1} it raised {failed}")
    if second.length != length or not same_timeline(expected, b.timeline):
        return _every_block(
            spec, policy, gpu, length, "the extended trace differs from the traced one"
        )
    gates.release()
    parameters, trainable = extended_counts(
        (a.parameters, a.trainable_parameters), (b.parameters, b.trainable_parameters), length
    )
    note = Note(
        Topic.EXTENT,
        f"{extension_note(prefix, length)}; what the program printed from torch.cuda is the "
        f"extended run's; the host tensors listed are the {SMALL + 1}-block run's",
    )
    return replace(
        b,
        timeline=full,
        parameters=parameters,
        trainable_parameters=trainable,
        notes=[*b.notes, note],
        seconds=a.seconds + b.seconds,
        extended=True,
    )


def _every_block(
    spec: ProgramSpec, policy: DevicePolicy, gpu: EmulatedGpu, length: int, why: str
) -> ProgramTrace:
    """The program once more with its whole model, output shown from the move on."""
    gates = _Gates("drop")
    with gates.installed():
        c = trace_program(spec, policy, gpu, moves=ShallowModel(None, gates, then="pass"))
    note = Note(
        Topic.EXTENT, f"traced every one of the {length} blocks of the program's model ({why})"
    )
    return replace(c, notes=[*c.notes, note])


__all__ = ["HEAD", "MIN_BLOCKS", "trace_program_blocks"]
