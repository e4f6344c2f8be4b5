"""A CUDA GPU that is not there: ``torch.cuda`` answers as the GPU named, and what the program
puts on "cuda" goes where a :class:`DeviceMapping` says.

While :class:`CudaEmulation` is active:

- ``torch.cuda.is_available()`` is True, ``device_count()`` the node's GPUs (1, or torchrun's
  ``--nproc-per-node``); False and 0 to PyTorch's compiler and to a package that would load
  native CUDA code while it is imported (``cuda_api._told_no_gpu``),
  ``get_device_properties(0)``,
  ``get_device_name()`` and ``get_device_capability()`` describe the GPU (``gpus.py``);
  ``current_device()`` (what ``set_device()`` set), ``synchronize()``, ``empty_cache()`` and
  ``manual_seed*()`` do what they do on one GPU with nothing to wait for;
  ``torch.distributed.is_nccl_available()`` is True and ``torch.cuda.nccl.version()`` names
  the NCCL a CUDA build ships (the functions: ``cuda_api.py``);
- ``memory_allocated()``, ``max_memory_allocated()``, ``memory_reserved()``,
  ``max_memory_reserved()``, ``memory_stats()``, ``reset_peak_memory_stats()`` and
  ``mem_get_info()`` answer from a :class:`MemoryCounter` at the moment they are called (the
  trace's live count, ``trace/program/program_trace.py``; a real CPU run's allocator count,
  ``measure/program.py``);
- every call that names a CUDA device (``device="cuda"`` of a factory, ``Tensor.to("cuda")``,
  ``Tensor.cuda()``, ``Module.to``/``Module.cuda``) goes to the mapping
  (``device_mappings.py``): ``FakeCuda``
  makes fake tensors (CPU device: a CPU-only PyTorch aborts on autograd with fake CUDA
  tensors; the CUDA target's decisions are the device policy's), ``CpuForCuda`` makes
  real CPU tensors. Tensors made without naming CUDA stay real CPU tensors, but for a device
  taken from an emulated tensor (``device=x.device``: :attr:`FakeCuda.device`, the very object
  ``FakeTensor.device`` answers), which names the GPU in the program's GPU run. The same holds
  inside a custom ``autograd.Function``'s backward (``BackwardCFunction.apply``), where
  autograd runs Python with no ``TorchFunctionMode`` active (the calls: ``cuda_calls.py``);
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
from collections.abc import Callable, Iterator
from typing import Any
from unittest import mock

import torch
import torch.utils._device
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.autograd.function import BackwardCFunction

from vramledger.inputs.checkpoint_shapes import SYNCHRONOUS_LOADING
from vramledger.trace.emulation.cuda_api import (
    EmulatedGpu,
    MemoryCounter,
    accelerator_functions,
    cuda_functions,
    nothing,
)
from vramledger.trace.emulation.cuda_calls import (
    DeviceMode,
    backward_under,
    host_device_contexts,
    mapped_load,
    mapped_load_file,
    module_cpu,
    module_cuda,
    module_to,
    one_device_data_parallel,
    reporting,
    reporting_cuda,
    saved_tensors_hooks_under,
    wrapper_subclasses_on_host,
)
from vramledger.trace.emulation.device_mappings import DeviceMapping

NCCL_VERSION = (2, 27, 3)
"""What ``torch.cuda.nccl.version()`` answers: a recent NCCL (``nvidia-nccl-cu12`` 2.27.3, the
pin of PyTorch 2.8's CUDA wheels; the pinned 2.13's own is not visible from its CPU wheel); no
memory depends on it. torchtune's ``verify_bf16_support`` asks for NCCL >= 2.10 before
it allows bf16 on a GPU (``training/precision.py``)."""

CUDA_MODULES = ("torch.cuda", "torch.cuda.memory")
"""Where ``torch.cuda``'s functions are looked up (``torch.cuda.memory_allocated`` is
``torch.cuda.memory.memory_allocated``)."""


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
        in order (notes: :func:`cuda_calls.host_device_contexts`)."""
        self._stack = contextlib.ExitStack()

    def _patch(self, owner: Any, name: str, value: Any) -> None:
        """``owner.name = value`` until the emulation exits (restored, or deleted where it was
        inherited or absent)."""
        self._stack.enter_context(mock.patch.object(owner, name, value, create=True))

    def __enter__(self) -> CudaEmulation:
        import torch.cuda.memory
        import torch.cuda.nccl

        # the emulation is a thread-local mode: transformers' loading threads would reach the
        # real (absent) CUDA backend (`tensor.to(device=0)` in a worker under --measure)
        self._stack.enter_context(mock.patch.dict(os.environ, {SYNCHRONOUS_LOADING: "1"}))
        cuda = cuda_functions(self.gpu, self.counter)
        for module_name in CUDA_MODULES:
            module = sys.modules[module_name]
            for name, function in cuda.items():
                if module_name == "torch.cuda" or hasattr(module, name):
                    self._patch(module, name, function)
        # one object under both names, as in torch (torch.accelerator re-exports .memory's)
        accelerator = accelerator_functions(cuda)
        for module in (torch.accelerator, torch.accelerator.memory):
            for name, function in accelerator.items():
                if hasattr(module, name):
                    self._patch(module, name, function)
        # a CUDA build has NCCL; a CPU-only one has neither it nor torch._C._nccl_version
        self._patch(torch.distributed, "is_nccl_available", lambda: True)
        self._patch(sys.modules["torch.cuda.nccl"], "version", lambda: NCCL_VERSION)
        nvtx = torch.cuda.nvtx
        for name in ("range_push", "range_pop", "mark", "range_start", "range_end"):
            self._patch(nvtx, name, nothing())
        self._patch(nvtx, "range", lambda *_a, **_k: contextlib.nullcontext())
        mapping = self.mapping
        reported = mapping.reported_device()
        self._patch(nn.Module, "to", module_to(mapping, nn.Module.to))
        self._patch(nn.Module, "cuda", module_cuda(mapping))
        self._patch(nn.Module, "cpu", module_cpu(mapping, nn.Module.cpu))
        forward = nn.DataParallel.forward
        self._patch(nn.DataParallel, "forward", one_device_data_parallel(forward))
        self._patch(torch, "load", mapped_load(torch.load, mapping))
        try:
            import safetensors.torch as safetensors_torch
        except ImportError:
            safetensors_torch = None
        if safetensors_torch is not None:
            self._patch(
                safetensors_torch,
                "load_file",
                mapped_load_file(safetensors_torch.load_file, mapping),
            )
        self._patch(
            torch.amp.autocast_mode.autocast,
            "__init__",
            _cuda_autocast_on_cpu(torch.amp.autocast_mode.autocast.__init__, self.autocasts),
        )
        if reported is not None:
            self._patch(FakeTensor, "device", reporting(*reported))
            if reported[1].type == "cuda":
                for name, value in reporting_cuda(*reported).items():
                    self._patch(FakeTensor, name, value)
                # on torch.Tensor, ahead of TensorBase's (an immutable type) in every subclass
                make = torch._C.TensorBase._make_wrapper_subclass
                self._patch(
                    torch.Tensor, "_make_wrapper_subclass", wrapper_subclasses_on_host(make)
                )
            self._patch(
                torch.utils._device.DeviceContext,
                "__init__",
                host_device_contexts(self.host_device_contexts),
            )
        device_mode = DeviceMode(mapping)
        self._patch(
            BackwardCFunction, "apply", backward_under(device_mode, BackwardCFunction.apply)
        )
        hooks = torch.autograd.graph.saved_tensors_hooks
        self._patch(hooks, "__init__", saved_tensors_hooks_under(device_mode, hooks.__init__))
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
