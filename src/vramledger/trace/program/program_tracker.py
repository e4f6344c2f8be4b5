"""The tracker of a user's program (``program_trace.py``), and the memory counter its
``torch.cuda`` calls read. :class:`ProgramTracker` is the storage tracker (``tracker.py``) that
tells the program's emulated tensors from its real host ones: it records operators on fake
tensors (the emulated GPU's) and leaves the program's own CPU work (its data pipeline) real and
unrecorded. :class:`TimelineCounter` answers ``torch.cuda.memory_allocated`` and the like from
the timeline recorded so far, replayed through the target's allocator model.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import (
    FakeTensor,
    FakeTensorMode,
)
from torch.utils._python_dispatch import is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves, tree_map_only
from torch.utils.weak import WeakIdKeyDictionary

from vramledger.record.allocator import AllocatorModel
from vramledger.record.event_totals import EventTotals, sizes_in
from vramledger.record.timeline import Timeline
from vramledger.trace.core.tracker import StorageTracker
from vramledger.trace.program.host_stand_ins import HostStandIns, meta_of

TRACE_DEVICE = torch.device("cpu")
_DEVICE_COPIES = frozenset({torch.ops.aten._to_copy.default})
"""``Tensor.to("cuda")`` of a real tensor: a copy the tracker records as the operator's output
(``device_mappings.FakeCuda.move``), not a real tensor met on the device."""


_HOST_TO_DEVICE = frozenset({torch.ops.aten.copy_.default})
"""Writes into an emulated tensor whose source may be a host tensor (``param.copy_(cpu)``):
the source is not adopted as device memory."""

_WRAP_COLLECTIVE = "_c10d_functional::_wrap_tensor_autograd"
"""A functional collective's result wrapped as an ``AsyncCollectiveTensor`` outside a tracing
mode (``_maybe_wrap_tensor`` in torch/distributed/_functional_collectives.py, where the operator
is registered; the trace's fake
mode is not an active dispatch mode, so the eager path runs). The wrapper holds the result's own
storage; the fake mode would propagate a known result's constant through the real kernel and
fail on the wrapper it returns ("fake_tensor must be a FakeTensor with a constant"), so the
result itself is returned, as the wrapper's ``wait_tensor`` would (torchtitan's
``dist_sum_tensor`` of the batch's token count)."""


def _fake_call(args: tuple[Any, ...], kwargs: dict[str, Any] | None, host: FakeTensorMode) -> bool:
    """The call takes a fake tensor or runs under a FakeTensorMode (but ``host``'s: modules'
    tensors made without data on the host, ``host_stand_ins.py``)."""
    active = torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE)
    if active is not None and active is not host:
        return True
    return any(_fake_leaf(a, host) for a in tree_leaves((args, kwargs)))


def _fake_leaf(t: Any, host: FakeTensorMode) -> bool:
    """A fake tensor (not ``host``'s), or a tensor subclass over one: a DTensor over an emulated
    local tensor (``torch.nn.init.trunc_normal_``'s ``if not mask.any()`` on a sharded
    parameter) runs its own dispatch first, and its local operators come back through the
    tracker (``tracker.StorageTracker``) to be recorded and have their values answered."""
    if isinstance(t, FakeTensor):
        return t.fake_mode is not host
    if not isinstance(t, torch.Tensor) or not is_traceable_wrapper_subclass(t):
        return False
    names, _ = t.__tensor_flatten__()
    return any(_fake_leaf(getattr(t, name), host) for name in names)


def _on_trace_device(kwargs: dict[str, Any] | None) -> dict[str, Any] | None:
    """A factory that names CUDA and reaches the fake mode without passing the emulation's
    function mode (``cuda_calls.DeviceMode``), made on the trace's device as the emulation
    makes every "cuda" tensor. DTensor's sharding propagation does this: it rebuilds each
    argument as ``torch.empty_strided(..., device=mesh.device_type)`` under the fake mode from
    inside DTensor's own ``__torch_function__`` handling, where no function mode is active
    (``_rebuild_tensor_from_dtensor_meta`` in torch/distributed/tensor/_op_schema.py); on a
    mesh of device type "cuda" (torchtitan's, made where ``torch.cuda.is_available()``) the
    known-value run of that factory would ask a CPU-only PyTorch for a CUDA kernel."""
    if not kwargs or "device" not in kwargs:
        return kwargs
    device = kwargs["device"]
    if isinstance(device, (str, torch.device)) and torch.device(device).type == "cuda":
        return {**kwargs, "device": TRACE_DEVICE}
    return kwargs


def emulated(t: Any, mode: FakeTensorMode) -> bool:
    """A fake tensor of ``mode`` (not a host stand-in, ``host_stand_ins.py``), or a tensor
    subclass over such (FSDP2's sharded DTensor parameters and gradients)."""
    if isinstance(t, FakeTensor):
        return t.fake_mode is mode
    if not isinstance(t, torch.Tensor) or not is_traceable_wrapper_subclass(t):
        return False
    names, _ = t.__tensor_flatten__()
    # DTensor's flatten names its device mesh too (an opaque object, not a tensor)
    inner = [x for x in (getattr(t, name) for name in names) if isinstance(x, torch.Tensor)]
    return bool(inner) and all(emulated(x, mode) for x in inner)


class ProgramTracker(StorageTracker):
    """The storage tracker, recording fake tensors only: operators that neither take a fake
    tensor nor run under a FakeTensorMode (the program's real CPU work) run untouched.

    A real tensor that meets a fake one in an operator was made on the device in the program's
    GPU run: emulated tensors report the CPU as their device, so ``torch.arange(t,
    device=x.device)`` makes a real CPU tensor here, where on the GPU it makes a CUDA tensor
    (a CUDA operator refuses CPU tensors but 0-d ones). Its fake twin, the one ``mode`` converts
    it to, is recorded from that first use for as long as the real tensor lives (autograd
    keeps what it saves: the real tensor, as a CUDA run keeps its CUDA tensor).

    A Python number that autograd keeps as a tensor (``(alpha / rank) * lora_b(x)``: the 8-byte
    ``other`` that ``MulBackward0`` saves, ``trace/core/wrapped_numbers.py``) is a real CPU tensor
    here as in any run: on a GPU host memory, which the device's allocator never sees; with
    ``host_numbers`` (the CPU target) it is recorded, as the CPU allocator counts it. Found on
    torchtune's ``LoRALinear``: 12 adapted layers, 96 bytes alive at the backward peak, which
    ``--target cpu`` missed."""

    def __init__(
        self, mode: FakeTensorMode, host: HostStandIns, *, host_numbers: bool, **kwargs: Any
    ) -> None:
        super().__init__(**kwargs)
        self._mode = mode
        self._host = host
        self._twins: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._host_numbers = host_numbers
        self._seeing_numbers = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not _fake_call(args, kwargs, self._host.mode):
            return func(*args, **(kwargs or {}))
        kwargs = _on_trace_device(kwargs)
        if getattr(func, "_name", None) == _WRAP_COLLECTIVE and not args[0].requires_grad:
            return args[0]
        if func in _HOST_TO_DEVICE and self._emulated(args[0]):
            # an emulated tensor written from a host one (``load_state_dict`` of a CPU state
            # dict into a model on the GPU): the host side is host memory, not adopted
            return super().__torch_dispatch__(func, types, self._host_source(args), kwargs)
        if func not in _DEVICE_COPIES:
            leaves = tree_leaves((args, kwargs))
            if self.adopt(leaves):  # a host stand-in met on the device: its twin, as for a real one
                args, kwargs = tree_map_only(
                    FakeTensor,
                    lambda t: self._twins[t] if self._host.owns(t) else t,
                    (args, kwargs),
                )
        return super().__torch_dispatch__(func, types, args, kwargs)

    def _emulated(self, t: Any) -> bool:
        return isinstance(t, FakeTensor) and t.fake_mode is self._mode

    def _host_source(self, args: tuple[Any, ...]) -> tuple[Any, ...]:
        """``copy_``'s arguments with a host stand-in source replaced by an unrecorded twin of
        the trace's mode (a real source is taken by the fake mode as it is)."""
        src = args[1]
        if self._host.owns(src):
            src = self._mode.fake_tensor_converter.from_meta_and_device(
                self._mode, meta_of(src), TRACE_DEVICE
            )
        return (args[0], src, *args[2:])

    def adopt(self, leaves: list[Any]) -> bool:
        """Record the fake twin of each real CPU tensor (but 0-d ones) and of each host stand-in
        among ``leaves``, from now on and for as long as it lives: tensors the program's GPU run
        holds on the device. True if a host stand-in was among them (the caller swaps in its
        twin).

        Besides an operator's arguments (above), a compiled backward's inputs come here
        (``trace/compile/compiled.py``): autograd materializes the gradients of a compiled region's
        unused outputs (the zero tangents of a model's logits and KV cache when only its loss is
        differentiated) with ``at::zeros`` on the output's device, the CPU for an emulated
        tensor, so they are real; Inductor's generated code may never pass them to an operator
        that dispatches, and on a GPU they are device memory from that moment."""
        hosted = False
        for t in leaves:
            if (
                type(t) in (torch.Tensor, nn.Parameter)
                and t.dim() > 0
                and t.device.type == "cpu"
                and t not in self._twins
            ):
                self._twins[t] = twin = self._mode.from_tensor(t)
                self._see(twin)
            elif self._host.owns(t):
                hosted = True
                if t not in self._twins:
                    self._twins[t] = twin = self._mode.fake_tensor_converter.from_meta_and_device(
                        self._mode, meta_of(t), TRACE_DEVICE
                    )
                    self._see(twin)
        return hosted

    @property
    def module_names(self) -> dict[int, str]:
        """id(module) -> name, filled in as the program's modules first run."""
        return self._module_names

    def _see_wrapped_numbers(self) -> None:
        if not self._host_numbers:
            self._wrapped_out = None
            return
        self._seeing_numbers = True
        try:
            super()._see_wrapped_numbers()
        finally:
            self._seeing_numbers = False

    def _see(self, t: torch.Tensor, index: int = 0) -> list[int]:
        real = not isinstance(t, FakeTensor) and not is_traceable_wrapper_subclass(t)
        if real and not self._seeing_numbers:
            return []  # a real tensor: the program's CPU work, not the device's
        return super()._see(t, index)


class TimelineCounter:
    """``torch.cuda.memory_allocated()`` and the rest, from the timeline recorded so far: each
    storage's bytes as ``allocator`` hands them out (the CUDA caching allocator's blocks and
    segments), host-resident storages left out, as the ledger's replay counts them."""

    def __init__(self, timeline: Timeline, allocator: AllocatorModel) -> None:
        self.timeline = timeline
        self.allocator = allocator
        self._reset = 0
        self._cache: tuple[int, list[int], list[int]] | None = None

    def _series(self) -> tuple[list[int], list[int]]:
        """Allocated and reserved bytes after each event."""
        tl = self.timeline
        if self._cache is not None and self._cache[0] == len(tl.events):
            return self._cache[1], self._cache[2]
        sizes, reserved = self.allocator.block_sizes(tl.nbytes, tl.events, tl.on_host)
        allocated = EventTotals(tl).held(sizes_in(sizes, tl.on_host, host=False))
        if not reserved:
            reserved = allocated
        self._cache = (len(tl.events), allocated, reserved)
        return allocated, reserved

    def _since_reset(self, series: list[int]) -> int:
        start = min(self._reset, len(series))
        before = series[start - 1] if start > 0 else 0
        return max([before, *series[start:]])

    def allocated(self) -> int:
        series = self._series()[0]
        return series[-1] if series else 0

    def max_allocated(self) -> int:
        return self._since_reset(self._series()[0])

    def reserved(self) -> int:
        series = self._series()[1]
        return series[-1] if series else 0

    def max_reserved(self) -> int:
        return self._since_reset(self._series()[1])

    def reset_peak(self) -> None:
        self._reset = len(self.timeline.events)
