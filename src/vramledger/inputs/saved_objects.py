"""What a program saved with ``torch.save`` and loads back in the same run.

Under ``vramledger run`` saves write nothing (``program.skipped_saves``): the tensors of a trace
are fake, and a prediction must not overwrite a user's checkpoint. A program that saves a
checkpoint and loads it back (``torch.save(state, f)``, then ``torch.load(path)``: resuming,
keeping the best model, a round trip through a buffer) found an empty or missing file. So each
save is remembered here by where it went (the file's resolved path, or the buffer object), and a
``torch.load`` of the same place is answered from it: new tensors of the saved ones' shapes,
dtypes, strides and storages (a view is a view of its storage's copy, as ``torch.load`` restores
it), on the device ``map_location`` names or the saved one's, made by the program's own factories
(so the emulation places them), holding the saved values (a fake tensor's are none; a real one's
are copied: an optimizer's ``step`` read back as uninitialised memory overflowed AdamW's bias
correction). Memory is what a real load allocates; the file on disk is left as the program left
it.
"""

from __future__ import annotations

import contextlib
import io
import os
from collections.abc import Iterator
from typing import Any
from unittest import mock

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._pytree import tree_map_only


def place_of(f: Any) -> Any:
    """Where a save went: a path's (or an open file's) resolved path; a buffer itself."""
    if isinstance(f, (str, os.PathLike)):
        return os.path.realpath(os.fspath(f))
    name = getattr(f, "name", None)
    if isinstance(name, str) and not isinstance(f, io.BytesIO):
        return os.path.realpath(name)
    return id(f)


def _device(saved: torch.device, map_location: Any) -> Any:
    """Where ``torch.load`` puts a tensor saved on ``saved``: a device or string
    ``map_location``, a dict's entry for it, else the saved device (the object itself: for an
    emulated tensor it names the emulated device)."""
    if isinstance(map_location, (str, torch.device)):
        return torch.device(map_location)
    if isinstance(map_location, dict):
        target = map_location.get(str(saved))
        return torch.device(target) if target is not None else saved
    return saved


def fresh_copy(obj: Any, map_location: Any = None) -> Any:
    """``obj`` with each tensor replaced by a new one of its layout (module docstring); tensors
    that shared a storage share the new one."""
    storages: dict[int, torch.Tensor] = {}

    def new(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        key = id(storage)
        if key not in storages:
            count = max(storage.nbytes() // t.element_size(), 1)
            storages[key] = torch.empty(
                count, dtype=t.dtype, device=_device(t.device, map_location)
            )
        made = storages[key].as_strided(t.size(), t.stride(), t.storage_offset())
        if isinstance(made, FakeTensor) or not isinstance(t, FakeTensor):
            made.copy_(t)
        else:  # a fake tensor has no values to give a real one: ones (a step count of 1)
            made.fill_(1)
        if isinstance(t, nn.Parameter):
            return nn.Parameter(made, requires_grad=t.requires_grad)
        return made.requires_grad_(t.requires_grad) if t.is_floating_point() else made

    with torch.no_grad():
        return tree_map_only(torch.Tensor, new, obj)


class SavedObjects:
    """The objects saved in this run, by :func:`place_of`."""

    def __init__(self) -> None:
        self.by_place: dict[Any, Any] = {}

    def remember(self, obj: Any, f: Any) -> None:
        self.by_place[place_of(f)] = obj

    @contextlib.contextmanager
    def loads_answered(self) -> Iterator[None]:
        """``torch.load`` of a place saved to in this run answers from it; any other load is
        ``torch.load``'s (as patched around this)."""
        load = torch.load

        def answered(f: Any, map_location: Any = None, *args: Any, **kwargs: Any) -> Any:
            place = place_of(f)
            if place in self.by_place:
                return fresh_copy(self.by_place[place], map_location)
            return load(f, map_location, *args, **kwargs)

        with mock.patch.object(torch, "load", answered):
            yield
