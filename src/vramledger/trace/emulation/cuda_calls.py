"""Where the program's tensors go under the CUDA emulation (``cuda_emulation.py``): every call
that names a CUDA device goes to a :class:`DeviceMapping` (``device_mappings.py``).

- :class:`DeviceMode`, a ``TorchFunctionMode``: a factory's ``device="cuda"``,
  ``Tensor.to("cuda")`` (or ``to(0)``), ``Tensor.cuda()``, and a device taken from an emulated
  tensor (``device=x.device``); pinning is the host's; autograd's engine (``backward``,
  ``grad``) runs under the mode, and so does a custom ``autograd.Function``'s backward
  (:func:`backward_under`);
- ``Module.to`` / ``Module.cuda`` (:func:`module_to`, :func:`module_cuda`);
- ``torch.load`` and ``safetensors.torch.load_file`` of CUDA tensors (:func:`mapped_load`,
  :func:`mapped_load_file`): read into host memory, then moved as ``.to("cuda")`` would;
- the device an emulated tensor reports (:func:`reporting`: ``FakeTensor.device``, the very
  object the mode recognises), and where the program sets the CPU as the default device
  (:func:`host_device_contexts`, for the notes).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.utils._device
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack
from torch.utils._device import _device_constructors
from torch.utils._pytree import tree_map_only

from vramledger.inputs.version import PACKAGE_DIR
from vramledger.trace.emulation.device_mappings import DeviceMapping
from vramledger.trace.program.host_stand_ins import DATA_FREE


def index_as_cuda(args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
    """``to(0)`` names CUDA device 0 (``model.to(rank)``, as PyTorch's DDP tutorial writes it);
    a CPU-only PyTorch cannot parse a bare index ("Cannot access accelerator device")."""
    if args and type(args[0]) is int:
        args = (torch.device("cuda", args[0]), *args[1:])
    if type(kwargs.get("device")) is int:
        kwargs = {**kwargs, "device": torch.device("cuda", kwargs["device"])}
    return args, kwargs


def parse_to(args: tuple, kwargs: dict[str, Any]) -> tuple[Any, Any]:
    """The device and dtype of ``Tensor.to``'s / ``Module.to``'s arguments. A ``device=``
    keyword is passed by position: under the emulation ``_parse_to(device=cuda:0)`` answers the
    CPU (seen on torch 2.13; ``_parse_to(cuda:0)`` answers CUDA), so LitGPT's
    ``wte.to(device=old.weight.device, dtype=...)`` left a new embedding on the host."""
    if "device" in kwargs and not args:
        args, kwargs = (kwargs["device"],), {k: v for k, v in kwargs.items() if k != "device"}
    device, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
    return device, dtype


def is_cuda(device: Any) -> bool:
    """``device`` names a CUDA device (a bare index does)."""
    if device is None:
        return False
    if isinstance(device, int):  # a bare index names a CUDA device
        return True
    if isinstance(device, (str, torch.device)):
        try:
            return torch.device(device).type == "cuda"
        except RuntimeError:
            return False
    return False


_TENSOR_TO = {torch.Tensor.to}
_TENSOR_CUDA = {torch.Tensor.cuda}
_TENSOR_CPU = {torch.Tensor.cpu}
_COPY = {torch.Tensor.copy_}
_PINNING = {torch.Tensor.pin_memory, torch.Tensor.is_pinned}
_BACKWARD = {torch.Tensor.backward, torch.autograd.backward, torch.autograd.grad}
"""Calls that run autograd's engine: it runs the backward under the mode stack it is called
with, and a mode's ``__torch_function__`` runs with that mode popped, so the Python a backward
runs (tensor and grad hooks: FSDP2's pre-backward unshard makes its all-gather buffers with
``device="cuda"``) would see no emulation. Also what ``torch.autograd`` names at the call (the
trace wraps ``backward`` and ``grad``, and ``handle_torch_function`` passes the name)."""


class DeviceMode(TorchFunctionMode):
    """Sends calls that name CUDA to the mapping (and value reads of its tensors to it)."""

    def __init__(self, mapping: DeviceMapping) -> None:
        super().__init__()
        self.mapping = mapping
        # an attribute, not a property: Dynamo traces this mode's __torch_function__ inside a
        # compiled region and cannot follow a property of it ("cls_source must not be None")
        self.reports_cuda = bool(getattr(mapping, "reports_cuda", False))

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if kwargs.get("pin_memory"):
            # pinned host memory is the host's, and a CPU-only PyTorch cannot pin (torchtune's
            # activation offloading: ``empty_like(x, pin_memory=True, device="cpu")``)
            kwargs = {**kwargs, "pin_memory": False}
        if func in _BACKWARD or func is torch.autograd.backward or func is torch.autograd.grad:
            with self:  # the engine's hooks run under this mode, as the forward does
                return torch.overrides.redispatch_function(func, types, args, kwargs)
        if self.reports_cuda and (host := self._to_host(func, args, kwargs)) is not None:
            return host
        if func is torch.device and len(args) == 1 and type(args[0]) is int:
            # a bare index is the accelerator's device (transformers' device_map {"": 0},
            # is_accelerator_device); a CPU-only PyTorch has none ("Cannot access accelerator
            # device when none is available")
            return torch.device("cuda", args[0])
        if func in _TENSOR_TO:
            to_args, to_kwargs = index_as_cuda(
                args[1:], {k: v for k, v in kwargs.items() if k != "copy"}
            )
            device, dtype = parse_to(to_args, to_kwargs)
            if is_cuda(device) or self._emulated(*to_args, *to_kwargs.values()):
                moved = self.mapping.move(args[0], dtype)
                # to(..., copy=True) of a tensor already there is a new tensor on the GPU too
                # (bitsandbytes' quantize_blockwise copies its shared code into each state)
                return moved.clone() if kwargs.get("copy") and moved is args[0] else moved
        elif func in _TENSOR_CUDA:
            return self.mapping.move(args[0], None)
        elif func in _PINNING:
            # pinned host memory is the host's, and a CPU-only PyTorch cannot pin: unpinned
            return args[0] if func is torch.Tensor.pin_memory else False
        elif "device" in kwargs and (is_cuda(kwargs["device"]) or self._emulated(kwargs["device"])):
            return self.mapping.factory(func, args, kwargs)
        elif (
            kwargs.get("device") is None
            and func in _device_constructors()
            and is_cuda(torch.utils._device.CURRENT_DEVICE)
        ):
            # torch.set_default_device("cuda") and `with torch.device("cuda")`: their mode sits
            # at the bottom of the stack, so it names CUDA after this one has looked
            return self.mapping.factory(func, args, kwargs)
        elif self.mapping.handles(func, args):
            return self.mapping.answer(func, args, kwargs)
        elif func in DATA_FREE and (
            (made := self.mapping.host_factory(func, args, kwargs)) is not None
        ):
            return made
        return func(*args, **kwargs)

    def _to_host(self, func: Any, args: tuple, kwargs: dict[str, Any]) -> Any:
        """Where emulated tensors report CUDA, what moves one to the host or makes a host
        tensor from one is host memory (``FakeCuda.to_host`` / ``host_like``), and a copy
        between a host stand-in and an emulated tensor allocates nothing; None for every other
        call."""
        mapping: Any = self.mapping
        if func in _COPY:
            dst, src = args[0], args[1]
            if (
                isinstance(dst, FakeTensor)
                and isinstance(src, FakeTensor)
                and dst.fake_mode is not src.fake_mode
            ):
                return dst  # a copy between host and device: nothing allocated
            return None
        if not args or not mapping.emulated(args[0]):
            return None
        if func in _TENSOR_CPU:
            return mapping.to_host(args[0], None)
        if func in _TENSOR_TO:
            to_args, to_kwargs = index_as_cuda(
                args[1:], {k: v for k, v in kwargs.items() if k != "copy"}
            )
            device, dtype = parse_to(to_args, to_kwargs)
            if device is not None and torch.device(device).type == "cpu":
                return mapping.to_host(args[0], dtype)
            return None
        device = kwargs.get("device")
        if (
            device is not None
            and not isinstance(func, torch._ops.OpOverload)  # an operator inside a trace's kernel
            and not is_cuda(device)
            and torch.device(device).type == "cpu"
        ):
            return mapping.host_like(func, args, kwargs)
        return None

    def _emulated(self, *devices: Any) -> bool:
        """A device argument is the very object an emulated tensor reported
        (``x.device``): CUDA in the program's GPU run (:meth:`FakeCuda.reported_device`)."""
        reported = self.mapping.reported_device()
        if reported is None:
            return False
        return any(d is reported[1] for d in devices)


def backward_under(mode: TorchFunctionMode, apply: Callable[..., Any]) -> Callable[..., Any]:
    """``BackwardCFunction.apply`` (how autograd's engine calls a custom
    ``autograd.Function``'s ``backward``) with ``mode`` active: the engine runs it with no
    ``TorchFunctionMode`` on the stack (measured on torch 2.13: the forward sees the program's
    modes, the backward an empty stack), so without this ``torch.empty(n, device="cuda")`` or
    ``device=x.device`` in a backward would miss the emulation."""
    return _under(mode, apply)


def saved_tensors_hooks_under(
    mode: TorchFunctionMode, init: Callable[..., None]
) -> Callable[..., None]:
    """``saved_tensors_hooks.__init__`` whose pack and unpack hooks run with ``mode`` active:
    autograd calls them from inside the operator that saves (or the backward that reads) a
    tensor, where a ``TorchFunctionMode``'s own ``__torch_function__`` has popped it, so
    torchtune's activation offloading (``empty_like(x, pin_memory=True, device="cpu")`` in
    pack, ``.to("cuda")`` in unpack) would see no emulation."""

    def hooked(hooks: Any, pack: Callable[..., Any], unpack: Callable[..., Any]) -> None:
        init(hooks, _under(mode, pack), _under(mode, unpack))

    return hooked


def _under(mode: TorchFunctionMode, hook: Callable[..., Any]) -> Callable[..., Any]:
    def under(*args: Any) -> Any:
        if any(m is mode for m in _get_current_function_mode_stack()):
            return hook(*args)
        with mode:
            return hook(*args)

    return under


def mapped_load(load: Callable[..., Any], mapping: DeviceMapping) -> Callable[..., Any]:
    """``torch.load`` whose CUDA tensors (saved on a GPU, or mapped there with
    ``map_location``) are read into host memory and then moved by ``mapping``, as a CUDA-less
    PyTorch cannot restore a CUDA storage."""

    def mapped(f: Any, map_location: Any = None, *args: Any, **kwargs: Any) -> Any:
        on_cuda: set[int] = set()

        def restore(storage: Any, location: str) -> Any:
            target = location
            if isinstance(map_location, dict):
                target = map_location.get(location, location)
            elif isinstance(map_location, (str, torch.device)):
                target = str(map_location)
            if is_cuda(target) or (map_location is None and location.startswith("cuda")):
                on_cuda.add(storage.data_ptr())
            return storage

        if callable(map_location):
            return load(f, map_location, *args, **kwargs)
        loaded = load(f, restore, *args, **kwargs)

        def move(t: torch.Tensor) -> torch.Tensor:
            if t.untyped_storage().data_ptr() not in on_cuda:
                return t
            moved = mapping.move(t, None)
            return nn.Parameter(moved, t.requires_grad) if isinstance(t, nn.Parameter) else moved

        return tree_map_only(torch.Tensor, move, loaded) if on_cuda else loaded

    return mapped


def mapped_load_file(load_file: Callable[..., Any], mapping: DeviceMapping) -> Callable[..., Any]:
    """``safetensors.torch.load_file`` whose ``device="cuda"`` tensors are read into host
    memory and moved by ``mapping``."""

    def mapped_load_file(filename: Any, device: Any = "cpu") -> dict[str, torch.Tensor]:
        if not is_cuda(device):
            return load_file(filename, device=device)
        return {k: mapping.move(v, None) for k, v in load_file(filename).items()}

    return mapped_load_file


_FAKE_DEVICE = FakeTensor.__dict__["device"]


_TORCH_ROOT = os.path.dirname(torch.__file__)
_VRAMLEDGER_ROOT = str(PACKAGE_DIR)
TRUE_DEVICE_READERS = (
    *(
        os.path.join(_TORCH_ROOT, *part)
        for part in (
            ("_subclasses", ""),
            ("_prims_common", ""),
            ("_prims", ""),
            ("_refs", ""),
            ("_decomp", ""),
            ("_meta_registrations.py",),
            ("_dynamo", ""),
            ("_inductor", ""),
            ("_functorch", ""),
            ("_higher_order_ops", ""),
            ("_library", ""),
            ("fx", ""),
            ("_ops.py",),
            ("_tensor.py",),
            ("utils", "_python_dispatch.py"),
            ("utils", "_pytree.py"),
        )
    ),
    os.path.join(_VRAMLEDGER_ROOT, ""),
)
"""Code that is told an emulated tensor's real device (the CPU: a fake CPU tensor) where the
program is told CUDA (:func:`reporting`): PyTorch's fake-tensor machinery, reference
implementations and decompositions, which derive their outputs' devices from their inputs' (a
CUDA device there makes a fake CUDA tensor, and autograd on it aborts a CPU-only PyTorch), its
compiler (it compiles for the CPU here), and vramledger itself."""


_FAKE_DISPATCH = os.path.join(_TORCH_ROOT, "_subclasses", "fake_tensor.py")
FAKE_DISPATCH_DEPTH = 40
"""How far up the stack a fake tensor's dispatch is looked for (a custom operator's fake kernel
runs a few frames below it: ``torch/_library``'s wrappers)."""


def _reader_told_truth(depth: int = 2) -> bool:
    """The code asking (``depth`` frames up: past the property) is one of
    :data:`TRUE_DEVICE_READERS`, or runs inside a fake tensor's dispatch: a library's fake
    kernel for its custom operator (bitsandbytes' ``quantize_4bit`` makes its outputs with
    ``device=A.device``) makes fake tensors, whose device must be the real one."""
    frame = sys._getframe(depth)
    if frame.f_code.co_filename.startswith(TRUE_DEVICE_READERS):
        return True
    for _ in range(FAKE_DISPATCH_DEPTH):
        frame = frame.f_back
        if frame is None:
            return False
        if frame.f_code.co_filename == _FAKE_DISPATCH:
            return True
    return False


def reporting(mode: FakeTensorMode, device: torch.device) -> property:
    """``FakeTensor.device`` answering ``device`` (the same object each time) for ``mode``'s
    CPU tensors, and as before for every other fake tensor (a ``torch.compile`` inside the
    program has its own mode) and inside a fake kernel (``meta``). A CUDA ``device`` is
    answered to the program and the libraries it calls, the real one to
    :data:`TRUE_DEVICE_READERS`."""
    cuda = device.type == "cuda"

    def reported(t: FakeTensor) -> torch.device:
        own = _FAKE_DEVICE.fget(t)
        if own.type == "cpu" and t.fake_mode is mode and not (cuda and _reader_told_truth()):
            return device
        return own

    return property(reported, _FAKE_DEVICE.fset)


def reporting_cuda(mode: FakeTensorMode, device: torch.device) -> dict[str, Any]:
    """``is_cuda``, ``is_cpu`` and ``get_device()`` of ``mode``'s CPU tensors as a CUDA tensor
    on ``device`` answers them (the CUDA target: they are the emulated GPU's, and library code
    that branches on them takes its GPU path), to all but :data:`TRUE_DEVICE_READERS`; every
    other tensor answers as before."""
    base = torch._C.TensorBase

    def ours(t: Any) -> bool:
        return (
            t.fake_mode is mode
            and _FAKE_DEVICE.fget(t).type == "cpu"
            and not _reader_told_truth(3)  # past ours() and the property
        )

    def flag(name: str, cuda_value: bool) -> property:
        original = base.__dict__[name]
        return property(lambda t: cuda_value if ours(t) else original.__get__(t))

    get_device = base.get_device

    def get_device_of(t: Any) -> int:
        return (device.index or 0) if ours(t) else get_device(t)

    return {
        "is_cuda": flag("is_cuda", True),
        "is_cpu": flag("is_cpu", False),
        "get_device": get_device_of,
    }


def wrapper_subclasses_on_host(make: Callable[..., Any]) -> staticmethod:
    """``Tensor._make_wrapper_subclass`` whose ``device`` is the CPU where it names CUDA: a
    library's tensor subclass wraps emulated tensors and takes its device from them (torchao's
    ``NF4Tensor``: ``device=quantized_data.device``), which the program is told is CUDA, and a
    wrapper made on a CUDA device makes a CPU-only PyTorch refuse every operator on it. The
    wrapper's own device is then the CPU, as its inner tensors' really is."""

    def made(cls: Any, *args: Any, **kwargs: Any) -> Any:
        if is_cuda(kwargs.get("device")):
            kwargs = {**kwargs, "device": torch.device("cpu")}
        return make(cls, *args, **kwargs)

    return staticmethod(made)


_TORCH_DIR = os.path.join(os.path.dirname(torch.__file__), "")
"""PyTorch's own files: a ``with torch.device(...)`` there is PyTorch's, not the program's."""


def host_device_contexts(seen: dict[str, None]) -> Callable[..., None]:
    """``DeviceContext.__init__`` (``with torch.device(d):``, called from C++ with the program's
    frame next) that records where the program set the CPU as the default device. An emulated
    tensor's device is the CPU object (:class:`FakeCuda`), and a device rebuilt from it
    (``with torch.device(x.device):``, torchtitan's RoPE table) is a plain CPU device: the
    tensors made inside are host memory here, GPU memory in the program's GPU run. The two are
    not told apart, so the notes name each place."""
    init = torch.utils._device.DeviceContext.__init__

    def recording(context: Any, device: Any) -> None:
        init(context, device)
        if context.device.type == "cpu":
            frame = sys._getframe(1)
            if not frame.f_code.co_filename.startswith(_TORCH_DIR):
                seen[f"{frame.f_code.co_filename}:{frame.f_lineno}"] = None

    return recording


def module_to(mapping: DeviceMapping, original: Callable[..., nn.Module]) -> Callable[..., Any]:
    """``nn.Module.to`` (``original``) whose moves to CUDA go to ``mapping``."""
    reported = mapping.reported_device()

    def to(module: nn.Module, *args: Any, **kwargs: Any) -> nn.Module:
        args, kwargs = index_as_cuda(args, kwargs)
        device, dtype = parse_to(args, kwargs)
        # the device an emulated tensor reported names the GPU (peft moves a LoRA
        # adapter to its base layer's weight.device)
        emulated = reported is not None and any(a is reported[1] for a in (*args, *kwargs.values()))
        if (
            getattr(mapping, "reports_cuda", False)
            and device is not None
            and torch.device(device).type == "cpu"
        ):
            mapping.module_to_host(module, dtype)  # Lightning's teardown: model.cpu()
            return module
        if not is_cuda(device) and not emulated:
            return original(module, *args, **kwargs)
        mapping.module(module, dtype)
        return module

    return to


def module_cpu(mapping: DeviceMapping, original: Callable[..., nn.Module]) -> Callable[..., Any]:
    """``nn.Module.cpu``: where emulated tensors report CUDA, ``mapping`` moves the module's
    emulated tensors to the host."""

    def cpu(module: nn.Module) -> nn.Module:
        if getattr(mapping, "reports_cuda", False):
            mapping.module_to_host(module, None)
            return module
        return original(module)

    return cpu


def module_cuda(mapping: DeviceMapping) -> Callable[..., Any]:
    """``nn.Module.cuda``: ``mapping`` moves the module."""

    def cuda(module: nn.Module, device: Any = None) -> nn.Module:
        mapping.module(module, None)
        return module

    return cuda


def one_device_data_parallel(original: Callable[..., Any]) -> Callable[..., Any]:
    """``nn.DataParallel.forward`` on the one emulated GPU: what DataParallel does with a
    single device (``device_ids == [0]``): its inputs scattered to it (a copy of a host input,
    the tensor itself for one already there: ``.to("cuda")``), then the module itself; no
    replica. Its own check that the module's parameters are on ``cuda:0`` is left out (under
    ``--target cpu`` and ``--measure`` they report the CPU) and its scatter calls
    ``torch._C._scatter``, which a CPU-only PyTorch lacks. Several device ids (no GPU model
    here has them) run DataParallel's own code."""

    def forward(self: nn.DataParallel, *inputs: Any, **kwargs: Any) -> Any:
        if len(self.device_ids) != 1:
            return original(self, *inputs, **kwargs)
        moved = tree_map_only(torch.Tensor, lambda t: t.to("cuda"), (inputs, kwargs))
        return self.module(*moved[0], **moved[1])

    return forward
