"""``torch.cuda``'s functions as an emulated GPU answers them (``cuda_emulation.py`` puts them
in place): the GPU described (:class:`EmulatedGpu`: ``get_device_properties(0)``,
``get_device_name()``, ``get_device_capability()``), its memory counted by a
:class:`MemoryCounter` (``memory_allocated()``, ``memory_stats()``, ``mem_get_info()``, ...),
and one device with nothing to wait for (``current_device()``, ``synchronize()``, events,
streams, seeds).
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Protocol

import torch


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


_IMPORTING = "<frozen importlib._bootstrap>"

NATIVE_CUDA_AT_IMPORT = frozenset({"bitsandbytes", "deepspeed"})
"""Packages that load native CUDA code when ``torch.cuda.is_available()`` is True while they
are imported, which a CPU-only PyTorch cannot: bitsandbytes picks its CUDA library then
(``bitsandbytes/cextension.py``), DeepSpeed its CUDA accelerator (whose fused Adam it then
builds with the CUDA toolkit: "CUDA_HOME environment variable is not set"). They are told the
truth, no GPU, during their import; every other package sees the GPU at import as at run time
(torchtune decides at import whether FlexAttention is supported, ``_SUPPORTS_FLEX_ATTENTION``
in ``torchtune/modules/attention_utils.py``)."""

TORCH_COMPILER_FILES = tuple(
    os.path.join(os.path.dirname(torch.__file__), *part)
    for part in (("_inductor", ""), ("_dynamo", ""), ("utils", "_triton.py"))
)
"""PyTorch's compiler asks which devices it can generate code for (``has_triton``: Triton, for
an available CUDA device): it compiles for the tensors' real device, the CPU, and is told the
truth. Told of a GPU it reaches for Triton's CUDA driver (``libcuda.so cannot found``) wherever
Triton is installed, as with every CUDA build of PyTorch."""


def _told_no_gpu() -> bool:
    """Whether the caller of ``torch.cuda.is_available()`` is told the truth, no GPU: PyTorch's
    compiler (:data:`TORCH_COMPILER_FILES`), and a package of :data:`NATIVE_CUDA_AT_IMPORT`
    while it is imported. The program's own code and every other library see the GPU."""
    frame = sys._getframe(2)  # the caller of torch.cuda.is_available()
    caller = frame.f_code.co_filename if frame is not None else ""
    if caller.startswith(TORCH_COMPILER_FILES):
        return True
    package = _site_package(caller)
    if package not in NATIVE_CUDA_AT_IMPORT:
        return False
    while frame is not None:
        if frame.f_code.co_filename == _IMPORTING:
            return True
        frame = frame.f_back
    return False


def _site_package(filename: str) -> str | None:
    """The top-level package an installed file belongs to (``.../site-packages/bitsandbytes/
    cextension.py`` -> ``bitsandbytes``), or None."""
    for root in ("site-packages", "dist-packages"):
        _, found, rest = filename.partition(f"{os.sep}{root}{os.sep}")
        if found:
            return rest.split(os.sep, 1)[0].removesuffix(".py")
    return None


def _device_index(device: Any) -> int:
    """``set_device``'s argument (an index, ``"cuda:1"``, ``torch.device("cuda", 1)``) as an
    index."""
    if isinstance(device, int):
        return device
    index = torch.device(device).index
    return 0 if index is None else index


def nothing() -> Callable[..., None]:
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

    def is_capturing(self) -> bool:
        """No CUDA graph is captured (``Optimizer._accelerator_graph_capture_health_check``
        asks ``torch.accelerator.current_stream()``)."""
        return False

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


def cuda_functions(gpu: EmulatedGpu, counter: MemoryCounter) -> dict[str, Callable[..., Any]]:
    """``torch.cuda``'s functions by name, answering as ``gpu`` would, memory from
    ``counter``."""
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
        "is_available": lambda: not _told_no_gpu(),
        "is_initialized": lambda: True,
        "device_count": lambda: 0 if _told_no_gpu() else gpu.device_count,
        "current_device": lambda: current[0],
        "set_device": lambda device: current.__setitem__(0, _device_index(device)),
        "get_device_properties": lambda *_a, **_k: properties,
        "get_device_name": lambda *_a, **_k: gpu.name,
        "get_device_capability": lambda *_a, **_k: (gpu.major, gpu.minor),
        "is_bf16_supported": lambda *_a, **_k: gpu.major >= 8,
        "synchronize": nothing(),
        "empty_cache": nothing(),
        "init": nothing(),
        "_lazy_init": nothing(),
        "manual_seed": nothing(),
        "manual_seed_all": nothing(),
        "seed": nothing(),
        "seed_all": nothing(),
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
        "set_rng_state": nothing(),
        "set_rng_state_all": nothing(),
        "set_per_process_memory_fraction": nothing(),
        "reset_accumulated_memory_stats": nothing(),
        "ipc_collect": nothing(),
        "device": _DeviceScope,
        "device_of": _DeviceScope,
    }


def accelerator_functions(cuda: dict[str, Callable[..., Any]]) -> dict[str, Callable[..., Any]]:
    """``torch.accelerator``'s functions by name (and ``torch.accelerator.memory``'s), answering
    as a CUDA build with the emulated GPU does, from ``cuda`` (:func:`cuda_functions`).

    A CPU-only PyTorch has no accelerator (``torch._C._accelerator_getAccelerator()`` is None),
    so a program that picks its device with ``torch.accelerator.current_accelerator()`` (PyTorch's
    own examples, accelerate 1.16) would train on the CPU, unseen by the trace."""

    def current_accelerator(check_available: bool = False) -> torch.device | None:
        if check_available and not cuda["is_available"]():
            return None
        return torch.device("cuda")

    def alias(name: str) -> Callable[..., Any]:
        """A function of its own calling ``torch.cuda``'s ``name``: Dynamo keeps one handler per
        function object and refuses one object under two names."""
        function = cuda[name]
        return lambda *args, **kwargs: function(*args, **kwargs)

    return {
        "current_accelerator": current_accelerator,
        # as torch.cuda's: the caller's file decides (_told_no_gpu reads the caller's frame)
        "is_available": lambda: not _told_no_gpu(),
        "device_count": lambda: 0 if _told_no_gpu() else cuda["device_count"](),
        "current_device_index": alias("current_device"),
        "current_device_idx": alias("current_device"),
        "set_device_index": alias("set_device"),
        "set_device_idx": alias("set_device"),
        "device_index": _DeviceScope,
        "synchronize": nothing(),
        "empty_cache": nothing(),
        "empty_host_cache": nothing(),
        "current_stream": alias("current_stream"),
        "set_stream": nothing(),
        **{
            name: alias(name)
            for name in (
                "memory_allocated",
                "max_memory_allocated",
                "memory_reserved",
                "max_memory_reserved",
                "memory_stats",
                "reset_peak_memory_stats",
                "reset_accumulated_memory_stats",
            )
        },
        "get_memory_info": alias("mem_get_info"),
    }
