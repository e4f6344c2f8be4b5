"""The host tensors a program keeps: real CPU memory that a CPU run's allocator counts and a GPU's
never sees (its dataset, the next batch on the host, a teacher model left on the CPU, host copies
of offloaded activations).

The trace records device memory only. A real CPU run (``run --measure``) counts every CPU
allocation, so a program that keeps a 24 MiB image tensor on the host measures 24 MiB above the
``--target cpu`` prediction, with nothing in the prediction's device ledger to say why. This
module lists them: after each of the first steps (``SCANNED_STEPS``) and the last, the CPU
tensors that the program's running frames reach (its locals and the objects they hold: a
trainer's data loader, a recipe's state dict; not modules, classes or functions, which reach
every global of the process), but those alive before the program started, one entry per storage
(views of one storage count once), with the program's name for the tensor where it has one
(``program_frames.program_name_of``), else its shape and dtype. Host stand-ins
(``host_stand_ins.py``: a module's tensors built without data) are host memory too and are
listed with their bytes. Tensors vramledger itself holds (known values, ``trace/core/values.py``)
are left out.
"""

from __future__ import annotations

import gc
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor

from vramledger.inputs.program import launch
from vramledger.inputs.program_frames import frame_locals, program_name_of

SCANNED_STEPS = 3
"""Steps after which the host is scanned, besides the last: a scan walks every object the
garbage collector tracks (~0.1 s per million objects), so not after every step."""

_LAUNCH_CODE = launch.__code__

LISTED = 8
"""Entries named in the note; the total counts every one."""


@dataclass(frozen=True, kw_only=True)
class HostTensor:
    """One host storage the program keeps."""

    name: str
    """The program's variable for it, or its shape and dtype."""
    nbytes: int

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "bytes": self.nbytes}


class HostTensors:
    """Scans the program's live host tensors (module docstring). ``host_mode``: the fake mode of
    host stand-ins; ``own``: the ``_cdata`` of the real storages vramledger holds (known
    values), read once per scan."""

    def __init__(
        self, host_mode: Any, own: Callable[[], set[int]], max_steps: int, listed: bool = True
    ) -> None:
        self.listed = listed
        """False: nothing is scanned or listed (a program run as several ranks)."""
        self.host_mode = host_mode
        self.own = own
        self.max_steps = max_steps
        self.found: list[HostTensor] = []
        """The latest scan's entries, largest first."""
        self._before: list[Any] = (
            [
                st
                for t in _live_tensors()
                if is_real_host(t, host_mode, set()) and (st := _storage(t)) is not None
            ]
            if listed
            else []
        )
        """The host storages alive before the program started (this process's, not the
        program's), held so that their addresses are not reused while it runs."""

    def after_step(self, step: int) -> None:
        if self.listed and (step <= SCANNED_STEPS or step == self.max_steps):
            self.found = self.scan()

    def scan(self) -> list[HostTensor]:
        """The host tensors the program's running frames reach now (module docstring)."""
        seen: dict[int, HostTensor] = {}
        own = self.own() | {st._cdata for st in self._before}
        for obj in _reached_tensors(_program_frames()):
            if not is_real_host(obj, self.host_mode, own):
                continue
            storage = _storage(obj)
            if storage is None:
                continue
            key = storage._cdata
            nbytes = storage.nbytes()
            name = program_name_of(obj)
            if key not in seen or (name and not seen[key].name[0].isalpha()):
                seen[key] = HostTensor(name=name or _describe(obj), nbytes=nbytes)
        return sorted(seen.values(), key=lambda h: -h.nbytes)

    @property
    def total_bytes(self) -> int:
        return sum(h.nbytes for h in self.found)

    def note(self) -> str | None:
        if not self.found:
            return None
        listed = ", ".join(f"{h.name} {h.nbytes:,} B" for h in self.found[:LISTED])
        more = len(self.found) - LISTED
        return (
            f"host tensors the program keeps (after its last step): {self.total_bytes:,} bytes "
            f"in {len(self.found)} storage{'s' if len(self.found) != 1 else ''} "
            f"({listed}{f', and {more} more' if more > 0 else ''}); host memory: a real CPU "
            "run's allocator counts it (run --measure), a GPU's does not, and this prediction "
            "leaves it out"
        )


def _storage(t: torch.Tensor) -> Any:
    """``t``'s storage, or None where it has none (a sparse tensor)."""
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None


def _program_frames() -> list[Any]:
    """The frames running now from the program's entry (``program.launch``) down: what the
    program and the libraries it called hold in their local variables."""
    frames = []
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is _LAUNCH_CODE:
            return frames
        frames.append(frame)
        frame = frame.f_back
    return []  # not inside a program run


_NOT_FOLLOWED = (types.ModuleType, type, types.FunctionType, types.BuiltinFunctionType)
"""Objects whose referents are not followed: a module or a class reaches every global of the
process (this test run's, vramledger's), a function its module's globals. A host tensor the
program keeps is reached from its frames through its own objects (a trainer, a recipe, a data
loader, a dataset, a state dict)."""


def _reached_tensors(frames: list[Any]) -> list[torch.Tensor]:
    """The tensors reachable from ``frames``' local variables (a running frame's references are
    not its referents: ``program_frames.frame_locals``) through ``gc.get_referents``, not
    through :data:`_NOT_FOLLOWED`."""
    found: list[torch.Tensor] = []
    roots = [frame_locals(f) for f in frames]
    visited: set[int] = {id(r) for r in roots}
    stack: list[Any] = list(roots)
    while stack:
        for obj in gc.get_referents(stack.pop()):
            if id(obj) in visited:
                continue
            visited.add(id(obj))
            if issubclass(type(obj), torch.Tensor):
                found.append(obj)
            if not isinstance(obj, _NOT_FOLLOWED):
                stack.append(obj)
    return found


def _live_tensors() -> list[torch.Tensor]:
    # type(), not isinstance(): a dead weakref.proxy raises on isinstance
    return [o for o in gc.get_objects() if issubclass(type(o), torch.Tensor)]


def _describe(t: torch.Tensor) -> str:
    return (
        f"({'×'.join(str(d) for d in t.shape) or 'scalar'} {str(t.dtype).removeprefix('torch.')})"
    )


def is_real_host(t: torch.Tensor, host_mode: Any, own: set[int]) -> bool:
    """``t`` is host memory of the program: a real CPU tensor (not vramledger's own), or a host
    stand-in of ``host_mode``."""
    if isinstance(t, FakeTensor):
        return t.fake_mode is host_mode
    if type(t) is not torch.Tensor and not isinstance(t, torch.nn.Parameter):
        return False  # a subclass (DTensor, a quantized weight): its inner tensors are listed
    if t.device.type != "cpu" or t.is_meta:
        return False
    storage = _storage(t)
    return storage is not None and storage._cdata not in own
