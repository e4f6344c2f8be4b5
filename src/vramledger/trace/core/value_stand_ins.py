"""What a program reads of a fake tensor's values: the real value where it is known, else a
stand-in, and where each stand-in was used.

A program's fake tensors have shapes, not values. ``loss.item()``, ``float(loss)``,
``grad_norm.tolist()``, ``f"{loss:.3f}"`` and ``print(loss)`` still have to return something:

- a value computed only from the batch and constants is known (``trace/core/values.py``) and is
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
from torch.utils._pytree import tree_flatten, tree_unflatten

from vramledger.inputs.program_frames import program_location
from vramledger.trace.core.values import KnownValues

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

FROM_DATA = {torch.tensor: "torch.tensor(data)", torch.as_tensor: "torch.as_tensor(data)"}
"""Factories that read the values of the tensors in their data (``torch.tensor([f0, f1])``
of 0-d tensors: torchtune's Llama-3.1 scaled RoPE builds its frequency table this way, on the
device, from tensors computed from ``arange``)."""


class ValueStandIns:
    """Answers value reads of fake tensors (module docstring); ``used`` counts the stand-ins
    by (read, program line)."""

    def __init__(self, values: KnownValues | None) -> None:
        self.values = values
        self.used: dict[tuple[str, str], int] = {}

    def handles(self, func: Any, args: tuple) -> bool:
        if func in FROM_DATA:
            return bool(args) and any(_fake_of(t) is not None for t in _data_tensors(args[0]))
        return func in READS and bool(args) and _fake_of(args[0]) is not None

    def data_of(self, func: Any, data: Any) -> tuple[Any, bool] | None:
        """``data`` of a ``torch.tensor``-like factory with each fake tensor in it replaced by
        its real value where known, else by the stand-in (the read recorded for the notes), and
        whether every value was known; None where ``data`` holds no fake tensor."""
        leaves, spec = tree_flatten(data)
        if not any(_fake_of(t) is not None for t in leaves if isinstance(t, torch.Tensor)):
            return None
        real: list[Any] = []
        known = True
        for leaf in leaves:
            fake = _fake_of(leaf) if isinstance(leaf, torch.Tensor) else None
            if fake is None:
                real.append(leaf)
            elif (
                isinstance(leaf, FakeTensor) and self.values is not None and self.values.known(fake)
            ):
                real.append(self.values.value(fake))
            else:
                known = False
                real.append(self._stand_in(FROM_DATA[func], fake, leaf.shape))
        return tree_unflatten(real, spec), known

    def _stand_in(self, read: str, t: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        where = program_location() or "(no line of the program)"
        key = (read, where)
        self.used[key] = self.used.get(key, 0) + 1
        with _disable_current_modes(), unset_fake_temporarily():
            return torch.zeros((), dtype=t.dtype).expand(shape)

    def answer(self, func: Any, args: tuple, kwargs: dict[str, Any]) -> Any:
        if func in FROM_DATA:  # a host tensor of the values (the device case: FakeCuda.factory)
            found = self.data_of(func, args[0])
            assert found is not None  # handles() said so
            with _disable_current_modes(), unset_fake_temporarily():
                return func(found[0], *args[1:], **kwargs)
        t = _fake_of(args[0])
        assert t is not None  # handles() said so
        whole = isinstance(args[0], FakeTensor) or _replicated(args[0])
        if whole and self.values is not None and self.values.known(t):
            real = self.values.value(t)
        else:
            real = self._stand_in(READS[func], t, args[0].shape)
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


def _data_tensors(data: Any) -> list[torch.Tensor]:
    """The tensors in a factory's ``data`` (nested lists and tuples)."""
    if not isinstance(data, (list, tuple)):
        return []
    return [t for t in tree_flatten(data)[0] if isinstance(t, torch.Tensor)]


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
