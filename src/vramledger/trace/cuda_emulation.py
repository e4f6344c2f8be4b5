"""A CUDA GPU that is not there: ``torch.cuda`` answers as the GPU named, and what the program
puts on "cuda" goes where a :class:`DeviceMapping` says.

While :class:`CudaEmulation` is active:

- ``torch.cuda.is_available()`` is True, ``device_count()`` the node's GPUs (1, or torchrun's
  ``--nproc-per-node``; 0 to an installed package
  asking while it is imported, which would load CUDA kernels: ``_library_import``),
  ``get_device_properties(0)``,
  ``get_device_name()`` and ``get_device_capability()`` describe the GPU (``gpus.py``);
  ``current_device()`` (what ``set_device()`` set), ``synchronize()``, ``empty_cache()`` and
  ``manual_seed*()`` do what they do on one GPU with nothing to wait for;
  ``torch.distributed.is_nccl_available()`` is True and ``torch.cuda.nccl.version()`` names
  the NCCL a CUDA build ships;
- ``memory_allocated()``, ``max_memory_allocated()``, ``memory_reserved()``,
  ``max_memory_reserved()``, ``memory_stats()``, ``reset_peak_memory_stats()`` and
  ``mem_get_info()`` answer from a :class:`MemoryCounter` at the moment they are called (the
  trace's live count, ``trace/program_trace.py``; a real CPU run's allocator count,
  ``measure_program.py``);
- every call that names a CUDA device (``device="cuda"`` of a factory, ``Tensor.to("cuda")``,
  ``Tensor.cuda()``, ``Module.to``/``Module.cuda``) goes to the mapping
  (``device_mappings.py``): ``FakeCuda``
  makes fake tensors (CPU device: a CPU-only PyTorch aborts on autograd with fake CUDA
  tensors; the CUDA target's decisions are the device policy's), ``CpuForCuda`` makes
  real CPU tensors. Tensors made without naming CUDA stay real CPU tensors, but for a device
  taken from an emulated tensor (``device=x.device``: :attr:`FakeCuda.device`, the very object
  ``FakeTensor.device`` answers), which names the GPU in the program's GPU run. The same holds
  inside a custom ``autograd.Function``'s backward (``BackwardCFunction.apply``), where
  autograd runs Python with no ``TorchFunctionMode`` active;
- ``torch.load`` reads CUDA tensors (saved on a GPU, or ``map_location="cuda"``) and
  ``safetensors.torch.load_file(device="cuda")`` its tensors into host memory and moves them as
  ``.to("cuda")`` would;
- ``torch.autocast("cuda", ...)`` runs as CPU autocast over these CPU tensors (the CUDA
  policy's ``CudaAutocast`` gives it CUDA's operator lists).

Everything is restored on exit.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Protocol
from unittest import mock

import torch
import torch.utils._device
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.autograd.function import BackwardCFunction
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack
from torch.utils._device import _device_constructors
from torch.utils._pytree import tree_map_only

from .device_mappings import DeviceMapping
from .host_stand_ins import DATA_FREE

NCCL_VERSION = (2, 27, 3)
"""What ``torch.cuda.nccl.version()`` answers: a recent NCCL (``nvidia-nccl-cu12`` 2.27.3, the
pin of PyTorch 2.8's CUDA wheels; the pinned 2.13's own is not visible from its CPU wheel); no
memory depends on it. torchtune's ``verify_bf16_support`` asks for NCCL >= 2.10 before
it allows bf16 on a GPU (``training/precision.py``)."""

CUDA_MODULES = ("torch.cuda", "torch.cuda.memory")
"""Where ``torch.cuda``'s functions are looked up (``torch.cuda.memory_allocated`` is
``torch.cuda.memory.memory_allocated``)."""


@dataclass(frozen=True, kw_only=True)
class EmulatedGpu:
    """What ``torch.cuda.get_device_properties`` says."""

    name: str
    total_memory: int
    major: int
    minor: int
    device_count: int = 1
    """GPUs on the node (``torch.cuda.device_count()``): torchrun's ``--nproc-per-node``."""


class MemoryCounter(Protocol):
    """The device memory at this moment, as the CUDA caching allocator would count it."""

    def allocated(self) -> int: ...

    def max_allocated(self) -> int: ...

    def reserved(self) -> int: ...

    def max_reserved(self) -> int: ...

    def reset_peak(self) -> None: ...


def _index_as_cuda(args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
    """``to(0)`` names CUDA device 0 (``model.to(rank)``, as PyTorch's DDP tutorial writes it);
    a CPU-only PyTorch cannot parse a bare index ("Cannot access accelerator device")."""
    if args and type(args[0]) is int:
        args = (torch.device("cuda", args[0]), *args[1:])
    if type(kwargs.get("device")) is int:
        kwargs = {**kwargs, "device": torch.device("cuda", kwargs["device"])}
    return args, kwargs


def _is_cuda(device: Any) -> bool:
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
_PINNING = {torch.Tensor.pin_memory, torch.Tensor.is_pinned}
_BACKWARD = {torch.Tensor.backward, torch.autograd.backward, torch.autograd.grad}
"""Calls that run autograd's engine: it runs the backward under the mode stack it is called
with, and a mode's ``__torch_function__`` runs with that mode popped, so the Python a backward
runs (tensor and grad hooks: FSDP2's pre-backward unshard makes its all-gather buffers with
``device="cuda"``) would see no emulation. Also what ``torch.autograd`` names at the call (the
trace wraps ``backward`` and ``grad``, and ``handle_torch_function`` passes the name)."""


class _DeviceMode(TorchFunctionMode):
    """Sends calls that name CUDA to the mapping (and value reads of its tensors to it)."""

    def __init__(self, mapping: DeviceMapping) -> None:
        super().__init__()
        self.mapping = mapping

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _BACKWARD or func is torch.autograd.backward or func is torch.autograd.grad:
            with self:  # the engine's hooks run under this mode, as the forward does
                return torch.overrides.redispatch_function(func, types, args, kwargs)
        if func in _TENSOR_TO:
            to_args, to_kwargs = _index_as_cuda(
                args[1:], {k: v for k, v in kwargs.items() if k != "copy"}
            )
            device, dtype, _, _ = torch._C._nn._parse_to(*to_args, **to_kwargs)
            if _is_cuda(device) or self._emulated(*to_args, *to_kwargs.values()):
                moved = self.mapping.move(args[0], dtype)
                # to(..., copy=True) of a tensor already there is a new tensor on the GPU too
                # (bitsandbytes' quantize_blockwise copies its shared code into each state)
                return moved.clone() if kwargs.get("copy") and moved is args[0] else moved
        elif func in _TENSOR_CUDA:
            return self.mapping.move(args[0], None)
        elif func in _PINNING:
            # pinned host memory is the host's, and a CPU-only PyTorch cannot pin: unpinned
            return args[0] if func is torch.Tensor.pin_memory else False
        elif "device" in kwargs and (
            _is_cuda(kwargs["device"]) or self._emulated(kwargs["device"])
        ):
            return self.mapping.factory(func, args, kwargs)
        elif (
            kwargs.get("device") is None
            and func in _device_constructors()
            and _is_cuda(torch.utils._device.CURRENT_DEVICE)
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

    def _emulated(self, *devices: Any) -> bool:
        """A device argument is the very object an emulated tensor reported
        (``x.device``): CUDA in the program's GPU run (:meth:`FakeCuda.reported_device`)."""
        reported = self.mapping.reported_device()
        if reported is None:
            return False
        return any(d is reported[1] for d in devices)


_IMPORTING = "<frozen importlib._bootstrap>"


def _library_import() -> bool:
    """An installed package asks while it is being imported: it chooses its backend then
    (bitsandbytes loads its CUDA kernels, which a CPU-only PyTorch lacks), so it is told the
    truth, no GPU. The program's own code, and libraries at run time, see the GPU."""
    frame = sys._getframe(2)  # the caller of torch.cuda.is_available()
    caller = frame.f_code.co_filename if frame is not None else ""
    if "site-packages" not in caller and "dist-packages" not in caller:
        return False
    while frame is not None:
        if frame.f_code.co_filename == _IMPORTING:
            return True
        frame = frame.f_back
    return False


def _mapped_load(load: Callable[..., Any], mapping: DeviceMapping) -> Callable[..., Any]:
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
            if _is_cuda(target) or (map_location is None and location.startswith("cuda")):
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


def _mapped_load_file(load_file: Callable[..., Any], mapping: DeviceMapping) -> Callable[..., Any]:
    """``safetensors.torch.load_file`` whose ``device="cuda"`` tensors are read into host
    memory and moved by ``mapping``."""

    def mapped_load_file(filename: Any, device: Any = "cpu") -> dict[str, torch.Tensor]:
        if not _is_cuda(device):
            return load_file(filename, device=device)
        return {k: mapping.move(v, None) for k, v in load_file(filename).items()}

    return mapped_load_file


def _cuda_autocast_on_cpu(
    autocast_init: Callable[..., None], autocasts: dict[str, None]
) -> Callable[..., None]:
    """``torch.autocast.__init__`` that runs ``autocast("cuda")`` as CPU autocast, with CUDA's
    dtype, recording each dtype asked for in ``autocasts``."""

    def init(
        autocast: Any,
        device_type: str,
        dtype: torch.dtype | None = None,
        enabled: bool = True,
        cache_enabled: bool | None = None,
    ) -> None:
        if device_type == "cuda":
            # CUDA's own default (float16, or what torch.set_autocast_dtype("cuda") set),
            # not CPU autocast's bfloat16
            dtype = torch.get_autocast_dtype("cuda") if dtype is None else dtype
            if enabled:
                autocasts[str(dtype).removeprefix("torch.")] = None
            device_type = "cpu"
        autocast_init(autocast, device_type, dtype, enabled, cache_enabled)

    return init


def _device_index(device: Any) -> int:
    """``set_device``'s argument (an index, ``"cuda:1"``, ``torch.device("cuda", 1)``) as an
    index."""
    if isinstance(device, int):
        return device
    index = torch.device(device).index
    return 0 if index is None else index


def _nothing() -> Callable[..., None]:
    """A function that does nothing (a new one each time: torch.compile's rules refuse one
    object standing for two torch functions)."""

    def nothing(*_args: Any, **_kwargs: Any) -> None:
        return None

    return nothing


class EmulatedEvent:
    """``torch.cuda.Event``: nothing runs asynchronously, so an event is the time it was
    recorded (``elapsed_time`` in milliseconds, as CUDA's)."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, **_: Any) -> None:
        self.time: float | None = None

    def record(self, stream: Any = None) -> None:
        self.time = time.perf_counter()

    def elapsed_time(self, end: EmulatedEvent) -> float:
        return 1000.0 * ((end.time or 0.0) - (self.time or 0.0))

    def synchronize(self) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass

    def query(self) -> bool:
        return True


class _DeviceScope(contextlib.nullcontext):
    """``torch.cuda.device(i)`` / ``device_of(t)``: one device, nothing to switch."""

    def __init__(self, *_args: Any, **_kwargs: Any) -> None:
        super().__init__()


class EmulatedStream:
    """``torch.cuda.Stream``: one stream, nothing to wait for."""

    def __init__(self, *_args: Any, **_kwargs: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def wait_stream(self, stream: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: EmulatedEvent | None = None) -> EmulatedEvent:
        event = event or EmulatedEvent()
        event.record()
        return event

    def query(self) -> bool:
        return True

    def __enter__(self) -> EmulatedStream:
        return self

    def __exit__(self, *exc: Any) -> None:
        pass


def _summary(gpu: EmulatedGpu, counter: MemoryCounter) -> str:
    """``torch.cuda.memory_summary()``, the figures the counter has."""
    rows = [
        ("Allocated memory", counter.allocated(), counter.max_allocated()),
        ("Reserved memory", counter.reserved(), counter.max_reserved()),
    ]
    lines = [f"emulated {gpu.name}: {'':>14}{'Cur Usage':>16}{'Peak Usage':>16}"]
    lines += [f"{name:<30}{now:>16,}{peak:>16,}" for name, now, peak in rows]
    return "\n".join(lines)


def _memory_stats(counter: MemoryCounter) -> dict[str, int]:
    allocated, peak = counter.allocated(), counter.max_allocated()
    reserved, reserved_peak = counter.reserved(), counter.max_reserved()
    stats = {"num_alloc_retries": 0, "num_ooms": 0, "num_device_alloc": 0, "num_device_free": 0}
    for key, (now, most) in {
        "allocated_bytes": (allocated, peak),
        "active_bytes": (allocated, peak),
        "requested_bytes": (allocated, peak),
        "reserved_bytes": (reserved, reserved_peak),
    }.items():
        for pool in ("all", "large_pool", "small_pool"):
            whole = pool == "all"
            stats[f"{key}.{pool}.current"] = now if whole else 0
            stats[f"{key}.{pool}.peak"] = most if whole else 0
    return dict(sorted(stats.items()))


_FAKE_DEVICE = FakeTensor.__dict__["device"]


def _reporting(mode: FakeTensorMode, device: torch.device) -> property:
    """``FakeTensor.device`` answering ``device`` (the same object each time) for ``mode``'s
    CPU tensors, and as before for every other fake tensor (a ``torch.compile`` inside the
    program has its own mode) and inside a fake kernel (``meta``)."""

    def reported(t: FakeTensor) -> torch.device:
        own = _FAKE_DEVICE.fget(t)
        if own.type == "cpu" and t.fake_mode is mode:
            return device
        return own

    return property(reported, _FAKE_DEVICE.fset)


_TORCH_DIR = os.path.join(os.path.dirname(torch.__file__), "")
"""PyTorch's own files: a ``with torch.device(...)`` there is PyTorch's, not the program's."""


def _host_device_contexts(seen: dict[str, None]) -> Callable[..., None]:
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


def _under(mode: TorchFunctionMode, apply: Callable[..., Any]) -> Callable[..., Any]:
    """``BackwardCFunction.apply`` (how autograd's engine calls a custom
    ``autograd.Function``'s ``backward``) with ``mode`` active: the engine runs it with no
    ``TorchFunctionMode`` on the stack (measured on torch 2.13: the forward sees the program's
    modes, the backward an empty stack), so without this ``torch.empty(n, device="cuda")`` or
    ``device=x.device`` in a backward would miss the emulation."""

    def under(ctx: Any, *args: Any) -> Any:
        if any(m is mode for m in _get_current_function_mode_stack()):
            return apply(ctx, *args)
        with mode:
            return apply(ctx, *args)

    return under


class CudaEmulation:
    """``torch.cuda`` as ``gpu`` would answer, memory from ``counter``, "cuda" tensors made by
    ``mapping`` (module docstring)."""

    def __init__(self, gpu: EmulatedGpu, counter: MemoryCounter, mapping: DeviceMapping) -> None:
        self.gpu = gpu
        self.counter = counter
        self.mapping = mapping
        self.autocasts: dict[str, None] = {}
        """The dtypes the program asked ``torch.autocast("cuda")`` for, in order (notes)."""
        self.host_device_contexts: dict[str, None] = {}
        """Where the program entered ``with torch.device(...)`` on the CPU (``file:line``),
        in order (notes: :func:`_host_device_contexts`)."""
        self._stack = contextlib.ExitStack()

    def _functions(self) -> dict[str, Callable[..., Any]]:
        gpu, counter = self.gpu, self.counter
        current = [0]  # set_device's index (torchrun programs: LOCAL_RANK)
        properties = SimpleNamespace(
            name=gpu.name,
            total_memory=gpu.total_memory,
            major=gpu.major,
            minor=gpu.minor,
            multi_processor_count=1,
            is_integrated=False,
            is_multi_gpu_board=False,
            uuid="emulated",
            L2_cache_size=0,
            gcnArchName="",
        )

        return {
            "is_available": lambda: not _library_import(),
            "is_initialized": lambda: True,
            "device_count": lambda: 0 if _library_import() else gpu.device_count,
            "current_device": lambda: current[0],
            "set_device": lambda device: current.__setitem__(0, _device_index(device)),
            "get_device_properties": lambda *_a, **_k: properties,
            "get_device_name": lambda *_a, **_k: gpu.name,
            "get_device_capability": lambda *_a, **_k: (gpu.major, gpu.minor),
            "is_bf16_supported": lambda *_a, **_k: gpu.major >= 8,
            "synchronize": _nothing(),
            "empty_cache": _nothing(),
            "init": _nothing(),
            "_lazy_init": _nothing(),
            "manual_seed": _nothing(),
            "manual_seed_all": _nothing(),
            "seed": _nothing(),
            "seed_all": _nothing(),
            "memory_allocated": lambda *_a, **_k: counter.allocated(),
            "max_memory_allocated": lambda *_a, **_k: counter.max_allocated(),
            "memory_reserved": lambda *_a, **_k: counter.reserved(),
            "max_memory_reserved": lambda *_a, **_k: counter.max_reserved(),
            "memory_cached": lambda *_a, **_k: counter.reserved(),
            "max_memory_cached": lambda *_a, **_k: counter.max_reserved(),
            "reset_peak_memory_stats": lambda *_a, **_k: counter.reset_peak(),
            "reset_max_memory_allocated": lambda *_a, **_k: counter.reset_peak(),
            "reset_max_memory_cached": lambda *_a, **_k: counter.reset_peak(),
            "memory_stats": lambda *_a, **_k: _memory_stats(counter),
            "mem_get_info": lambda *_a, **_k: (
                gpu.total_memory - counter.reserved(),
                gpu.total_memory,
            ),
            "memory_summary": lambda *_a, **_k: _summary(gpu, counter),
            "utilization": lambda *_a, **_k: 0,
            "Event": EmulatedEvent,
            "Stream": EmulatedStream,
            "current_stream": lambda *_a, **_k: EmulatedStream(),
            "default_stream": lambda *_a, **_k: EmulatedStream(),
            "stream": lambda *_a, **_k: contextlib.nullcontext(),
            "get_rng_state": lambda *_a, **_k: torch.get_rng_state(),
            "get_rng_state_all": lambda: [torch.get_rng_state()],
            "set_rng_state": _nothing(),
            "set_rng_state_all": _nothing(),
            "set_per_process_memory_fraction": _nothing(),
            "reset_accumulated_memory_stats": _nothing(),
            "ipc_collect": _nothing(),
            "device": _DeviceScope,
            "device_of": _DeviceScope,
        }

    def _patch(self, owner: Any, name: str, value: Any) -> None:
        """``owner.name = value`` until the emulation exits (restored, or deleted where it was
        inherited or absent)."""
        self._stack.enter_context(mock.patch.object(owner, name, value, create=True))

    def __enter__(self) -> CudaEmulation:
        import torch.cuda.memory
        import torch.cuda.nccl

        for module_name in CUDA_MODULES:
            module = sys.modules[module_name]
            for name, function in self._functions().items():
                if module_name == "torch.cuda" or hasattr(module, name):
                    self._patch(module, name, function)
        # a CUDA build has NCCL; a CPU-only one has neither it nor torch._C._nccl_version
        self._patch(torch.distributed, "is_nccl_available", lambda: True)
        self._patch(sys.modules["torch.cuda.nccl"], "version", lambda: NCCL_VERSION)
        nvtx = torch.cuda.nvtx
        for name in ("range_push", "range_pop", "mark", "range_start", "range_end"):
            self._patch(nvtx, name, _nothing())
        self._patch(nvtx, "range", lambda *_a, **_k: contextlib.nullcontext())
        mapping = self.mapping
        module_to = nn.Module.to

        reported = mapping.reported_device()

        def to(module: nn.Module, *args: Any, **kwargs: Any) -> nn.Module:
            args, kwargs = _index_as_cuda(args, kwargs)
            device, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
            # the device an emulated tensor reported names the GPU (peft moves a LoRA
            # adapter to its base layer's weight.device)
            emulated = reported is not None and any(
                a is reported[1] for a in (*args, *kwargs.values())
            )
            if not _is_cuda(device) and not emulated:
                return module_to(module, *args, **kwargs)
            mapping.module(module, dtype)
            return module

        def cuda(module: nn.Module, device: Any = None) -> nn.Module:
            mapping.module(module, None)
            return module

        self._patch(nn.Module, "to", to)
        self._patch(nn.Module, "cuda", cuda)
        self._patch(torch, "load", _mapped_load(torch.load, mapping))
        try:
            import safetensors.torch as safetensors_torch
        except ImportError:
            safetensors_torch = None
        if safetensors_torch is not None:
            self._patch(
                safetensors_torch,
                "load_file",
                _mapped_load_file(safetensors_torch.load_file, mapping),
            )
        self._patch(
            torch.amp.autocast_mode.autocast,
            "__init__",
            _cuda_autocast_on_cpu(torch.amp.autocast_mode.autocast.__init__, self.autocasts),
        )
        if reported is not None:
            self._patch(FakeTensor, "device", _reporting(*reported))
            self._patch(
                torch.utils._device.DeviceContext,
                "__init__",
                _host_device_contexts(self.host_device_contexts),
            )
        device_mode = _DeviceMode(mapping)
        self._patch(BackwardCFunction, "apply", _under(device_mode, BackwardCFunction.apply))
        self._stack.enter_context(device_mode)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stack.close()
        self._stack = contextlib.ExitStack()


@contextlib.contextmanager
def cuda_default_foreach() -> Iterator[list[str]]:
    """``torch.optim``'s default implementation as on CUDA tensors: multi-tensor (``foreach``)
    when every parameter is a CUDA tensor (``_default_to_fused_or_foreach`` in
    ``torch/optim/optimizer.py``; fake CPU tensors would get the for-loop one). Yields the
    optimizers it decided for (their module names), for the notes."""
    decided: list[str] = []
    originals: dict[Any, Any] = {}
    for name, module in list(sys.modules.items()):
        if name.startswith("torch.optim") and hasattr(module, "_default_to_fused_or_foreach"):
            originals[module] = module._default_to_fused_or_foreach
    original = sys.modules["torch.optim.optimizer"]._default_to_fused_or_foreach

    def default(
        params: list[torch.Tensor], differentiable: bool, use_fused: bool = False
    ) -> tuple[bool, bool]:
        if (
            differentiable
            or not params
            or not all(p is None or isinstance(p, FakeTensor) for p in params)
        ):
            return original(params, differentiable, use_fused)
        fused = use_fused and all(p is None or torch.is_floating_point(p) for p in params)
        if not decided:
            decided.append("foreach")
        return fused, not fused

    for module in originals:
        module._default_to_fused_or_foreach = default
    try:
        yield decided
    finally:
        for module, function in originals.items():
            module._default_to_fused_or_foreach = function
