"""Modules the program builds hold no data: the large tensors a module's constructor makes on the
host (its parameters and buffers, before the program moves them to "cuda") are fake tensors of a
mode of their own, which the trace does not record.

A program builds its model on the CPU and then moves it: ``LlamaForCausalLM(config).cuda()``.
Built for real, a Llama-3-70B-shaped model needs 280 GB of host memory and minutes of random
initialisation before the move turns every parameter into a fake tensor anyway (its values are
never kept: ``device_mappings.FakeCuda.module``). So while the program runs under ``run``, a
data-free constructor (``torch.empty``, ``zeros``, ``randn`` ...: :data:`DATA_FREE`) called in
an ``nn.Module``'s ``__init__`` (anywhere below it on the call stack) with no device or the CPU
gives a *host stand-in* when its output has at least :data:`HOST_STAND_IN_MIN_BYTES`: a fake
tensor of :attr:`HostStandIns.mode`, reporting the CPU as its device. Initialisers run on it
without data (``nn.init.kaiming_uniform_``), ``Module.to(dtype)`` converts it, and a move to
"cuda" makes it an emulated tensor like any other.

What stays real: every tensor made outside a module's constructor (the data pipeline: tokenizers,
datasets, DataLoader workers, batches and what is computed from them), tensors made from data
(``torch.tensor``, ``as_tensor``) or from constants whose values a constructor may read
(``arange``, ``linspace``), and small outputs (a constructor's ``.item()`` of a scale, a table
of frequencies). Host stand-ins are host memory: the trace records none of their operators
(``program_tracker.ProgramTracker``); one that meets an emulated tensor in an operator (a module's
unregistered tensor attribute used on the device) is recorded from that use, as a real host
tensor is. Its values read as the stand-in zero (``value_stand_ins.py``). ``--measure`` builds
for real: its mapping (``device_mappings.CpuForCuda``) makes no stand-ins.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.utils._device
from torch import nn
from torch._prims_common import is_non_overlapping_and_dense_or_false
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily
from torch.utils._python_dispatch import _disable_current_modes

HOST_STAND_IN_MIN_BYTES = 1024**2
"""Outputs of a constructor this large or larger are made without data. A Llama-3-70B-shaped
model's smallest weights (its norms, 8,192 fp32 values: 32 KiB) stay real, 5 MiB in all; every
matrix (256 MiB and up in fp32) is a stand-in. Tiny models (the tests' programs) are built
for real, exactly as before."""

DATA_FREE = frozenset(
    {
        torch.empty,
        torch.empty_strided,
        torch.empty_permuted,
        torch.zeros,
        torch.ones,
        torch.full,
        torch.rand,
        torch.randn,
        torch.randint,
        torch.randperm,
        torch.eye,
    }
)
"""Constructors whose values no constructor reads back for its shape decisions: uninitialised,
constant or random (the initialisers fill them in place)."""

_MODULE_INITS: dict[Any, bool] = {}
"""Code object -> it is the ``__init__`` of an ``nn.Module`` subclass (a function's code belongs
to one class, so the answer is cached)."""


def _is_module_init(frame: Any) -> bool:
    code = frame.f_code
    if code.co_name != "__init__" or code.co_argcount < 1:
        return False
    owner: Any = frame.f_globals
    path = getattr(code, "co_qualname", "").split(".")[:-1]
    if path and "<locals>" not in path:
        for part in path:
            owner = owner.get(part) if isinstance(owner, dict) else getattr(owner, part, None)
        if isinstance(owner, type):
            return issubclass(owner, nn.Module)
    # a class defined in a function: its instance, read once for this code object
    return isinstance(frame.f_locals.get(code.co_varnames[0]), nn.Module)


def constructing_module(depth: int = 2) -> bool:
    """An ``nn.Module``'s ``__init__`` is on the call stack (above the caller's caller)."""
    frame = sys._getframe(depth)
    while frame is not None:
        code = frame.f_code
        known = _MODULE_INITS.get(code)
        if known is None:
            known = _MODULE_INITS[code] = _is_module_init(frame)
        if known:
            return True
        frame = frame.f_back
    return False


def _host_device(device: Any) -> bool:
    if device is None:
        current = torch.utils._device.CURRENT_DEVICE
        return current is None or torch.device(current).type == "cpu"
    try:
        return torch.device(device).type == "cpu"
    except (RuntimeError, TypeError):
        return False


def meta_of(t: torch.Tensor) -> torch.Tensor:
    """``t.detach().to("meta")``; for a fake tensor (a host stand-in) the same layout, made
    outside every mode (no operator recorded): its strides where it is dense, else
    contiguous."""
    if not isinstance(t, FakeTensor):
        return t.detach().to("meta")
    with _disable_current_modes(), unset_fake_temporarily():
        if is_non_overlapping_and_dense_or_false(t):
            return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
        return torch.empty(t.shape, dtype=t.dtype, device="meta")


class HostStandIns:
    """Makes the host stand-ins (module docstring) and tells them apart."""

    def __init__(self) -> None:
        self.mode = FakeTensorMode(allow_non_fake_inputs=True)
        self.made_bytes = 0
        """Bytes of host memory the stand-ins took the place of (for the notes)."""

    def owns(self, t: Any) -> bool:
        return isinstance(t, FakeTensor) and t.fake_mode is self.mode

    def factory(self, func: Any, args: tuple, kwargs: dict[str, Any]) -> torch.Tensor | None:
        """A stand-in for ``func(*args, **kwargs)`` where it applies, else None (make it for
        real)."""
        if func not in DATA_FREE or not _host_device(kwargs.get("device")):
            return None
        if kwargs.get("out") is not None or not constructing_module(depth=3):
            return None
        with self.mode:
            out = func(*args, **kwargs)
        if not isinstance(out, torch.Tensor) or out.nbytes < HOST_STAND_IN_MIN_BYTES:
            return None
        self.made_bytes += out.nbytes
        return out

    def note(self) -> str | None:
        if not self.made_bytes:
            return None
        return (
            f"the program's modules were built without data: {self.made_bytes:,} bytes of "
            "tensors their constructors made on the host are shapes only (parameters and "
            "buffers; values are never needed)"
        )
