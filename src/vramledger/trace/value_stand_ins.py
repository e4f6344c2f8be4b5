"""What a program reads of a fake tensor's values: the real value where it is known, else a
stand-in, and where each stand-in was used.

A program's fake tensors have shapes, not values. ``loss.item()``, ``float(loss)``,
``grad_norm.tolist()``, ``f"{loss:.3f}"`` and ``print(loss)`` still have to return something:

- a value computed only from the batch and constants is known (``trace/values.py``) and is
  returned as it is;
- any other value (the loss, a gradient norm: computed from parameters) reads as zero
  (``STAND_IN``: 0.0, 0 or False by dtype), and the read is listed with the program's line
  (``program_frames.program_location``) for the notes. Control flow that depends on it takes the
  branch zero takes, which the same note names.
"""

from __future__ import annotations

from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily
from torch.utils._python_dispatch import _disable_current_modes, is_traceable_wrapper_subclass

from ..program_frames import program_location
from .values import KnownValues

STAND_IN = 0
"""Every unknown value reads as zero (0.0, 0, False)."""

READS = {
    torch.Tensor.item: "Tensor.item()",
    torch.Tensor.tolist: "Tensor.tolist()",
    torch.Tensor.__float__: "float(tensor)",
    torch.Tensor.__int__: "int(tensor)",
    torch.Tensor.__bool__: "bool(tensor)",
    torch.Tensor.__index__: "a tensor as an index",
    torch.Tensor.__format__: "format(tensor)",
    torch.Tensor.__repr__: "print(tensor)",
    torch.Tensor.numpy: "Tensor.numpy()",
}
"""Tensor methods that read values, and how the notes name them."""


class ValueStandIns:
    """Answers value reads of fake tensors (module docstring); ``used`` counts the stand-ins
    by (read, program line)."""

    def __init__(self, values: KnownValues | None) -> None:
        self.values = values
        self.used: dict[tuple[str, str], int] = {}

    def handles(self, func: Any, args: tuple) -> bool:
        return func in READS and bool(args) and _fake_of(args[0]) is not None

    def answer(self, func: Any, args: tuple, kwargs: dict[str, Any]) -> Any:
        t = _fake_of(args[0])
        assert t is not None  # handles() said so
        whole = isinstance(args[0], FakeTensor) or _replicated(args[0])
        if whole and self.values is not None and self.values.known(t):
            real = self.values.value(t)
        else:
            where = program_location() or "(no line of the program)"
            key = (READS[func], where)
            self.used[key] = self.used.get(key, 0) + 1
            with _disable_current_modes(), unset_fake_temporarily():
                real = torch.zeros((), dtype=t.dtype).expand(args[0].shape)
        with _disable_current_modes(), unset_fake_temporarily(), torch._C.DisableTorchFunction():
            return func(real, *args[1:], **kwargs)

    def notes(self) -> list[str]:
        return [
            f"{read} of a value computed from parameters returned a stand-in "
            f"({STAND_IN}) at {where}"
            + (f" ({count} times)" if count > 1 else "")
            + " (code that branches on it took zero's branch)"
            for (read, where), count in self.used.items()
        ]


def _fake_of(t: Any) -> FakeTensor | None:
    """``t`` itself if fake, or the fake local tensor of a DTensor over one (a sharded
    parameter's ``bool(mask.any())`` in ``nn.init.trunc_normal_``, which torchtitan runs on its
    FSDP2-sharded parameters): read as the local tensor's value, with no collective."""
    if isinstance(t, FakeTensor):
        return t
    local = getattr(t, "_local_tensor", None)
    return local if isinstance(local, FakeTensor) and is_traceable_wrapper_subclass(t) else None


def _replicated(t: Any) -> bool:
    """A DTensor whose every placement is ``Replicate``: its local tensor is its whole value
    (a sharded or partial one's is not: it reads as the stand-in)."""
    placements = getattr(t, "placements", ())
    return bool(placements) and all(p.is_replicate() for p in placements)
