"""Optimizers that cannot run on fake tensors, and what stands in for them in a trace.

- **bitsandbytes** optimizers read tensor values when built and run fused kernels that fake
  tensors cannot execute. Their state layout comes from the library itself: the stand-in builds
  the real optimizer on *meta* copies of the parameters and calls its own ``init_state`` for each
  one (8-bit ``state1``/``state2`` codes, per-256-element ``absmax`` scales, the shared 256-entry
  ``qmap`` tables, fp32 states for tensors under ``min_8bit_size`` (4096) elements, LAMB's
  ``unorm_vec`` ...). In the trace it allocates exactly those tensors at its first step and
  updates them in place, as the library's kernels do (no step temporaries). Paged variants keep
  states of tensors with at least ``BNB_PAGED_MIN_NUMEL`` elements in CUDA unified memory,
  outside PyTorch's allocator: reported as host bytes.
- **torchao's CPUOffloadOptimizer** needs a CUDA device. Its stand-in follows its code
  (torchao/optim/cpu_offload.py): parameters of at least ``minimal_size`` (4096) elements get a
  host copy and a host gradient buffer; the base optimizer (AdamW, fused, by default) steps the
  host copies, the rest stay on the device; a post-accumulate-grad hook copies each gradient to
  the host and, with ``offload_gradients``, frees the device one.
"""

from __future__ import annotations

from typing import Any

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily

from vramledger.inputs.categories import Category
from vramledger.inputs.errors import InputError
from vramledger.inputs.notes import Note, Topic
from vramledger.inputs.optimizers import OptimizerChoice
from vramledger.inputs.sources import tensor_leaves
from vramledger.inputs.training import optimizer_state_tensors

BNB_PAGED_MIN_NUMEL = 100_000
"""``get_state_buffer``: paged optimizers page states of tensors with at least 1e5 elements."""
OFFLOAD_MINIMAL_SIZE = 4096
"""``CPUOffloadOptimizer(minimal_size=4096)``: smaller tensors stay on the device."""

BNB_METHOD = (
    "bitsandbytes' own init_state on meta copies of the parameters (its kernels cannot run on "
    "fake tensors); states updated in place"
)
OFFLOAD_METHOD = "layout of torchao's CPUOffloadOptimizer (it needs a CUDA device to run)"
TORCHAO_NOTE = Note(
    Topic.KERNELS,
    "torchao compiles its per-parameter optimizer step (torch.compile in torchao/optim/adam.py); "
    "state bytes exact, step temporaries as the compiled step makes them (see the compiled "
    "regions note)",
)


class BitsAndBytesStandIn(torch.optim.Optimizer):
    def __init__(self, params: list[torch.Tensor], choice: OptimizerChoice, target: str) -> None:
        super().__init__(params, defaults={})
        self._layouts: list[list[tuple[str, tuple[int, ...], torch.dtype, int | None, bool]]] = []
        self._shared: dict[int, torch.Tensor] = {}
        self.paged: list[torch.Tensor] = []
        with unset_fake_temporarily():
            metas = [torch.empty(p.shape, dtype=p.dtype, device="meta") for p in params]
            real = choice.cls(metas, **choice.kwargs)
            is_paged = bool(getattr(real, "is_paged", False))
            if hasattr(real, "fill_qmap"):  # shared quantization tables, made once, on meta
                real.fill_qmap()
                real.name2qmap = {k: v.to("meta") for k, v in real.name2qmap.items()}
            order = []
            for gi, group in enumerate(real.param_groups):
                for pi, meta in enumerate(group["params"]):
                    real.is_paged = False
                    real.init_state(group, meta, gi, pi)
                    real.is_paged = is_paged
                    order.append(meta)
            # Tensors the optimizer also holds outside per-parameter state (the qmap tables in
            # name2qmap) are shared by every parameter's state.
            elsewhere = _tensor_ids({k: v for k, v in vars(real).items() if k != "state"})
            for meta in order:
                paged = is_paged and target == "cuda" and meta.numel() >= BNB_PAGED_MIN_NUMEL
                entries = []
                for key, value in real.state[meta].items():
                    if isinstance(value, torch.Tensor):
                        shared = id(value) if id(value) in elsewhere else None
                        is_paged_state = paged and key.startswith("state")
                        entries.append(
                            (key, tuple(value.shape), value.dtype, shared, is_paged_state)
                        )
                self._layouts.append(entries)
        self._params = params

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for p, layout in zip(self._params, self._layouts, strict=True):
            if p.grad is None or p in self.state:
                continue
            state = self.state[p]
            state["step"] = 0
            for key, shape, dtype, shared, paged in layout:
                if shared is not None:
                    if shared not in self._shared:
                        self._shared[shared] = torch.zeros(shape, dtype=dtype, device=p.device)
                    state[key] = self._shared[shared]
                else:
                    state[key] = torch.zeros(shape, dtype=dtype, device=p.device)
                    if paged:
                        self.paged.append(state[key])

    def host_tensors(self) -> list[torch.Tensor]:
        return list(self.paged)


class CpuOffloadStandIn(torch.optim.Optimizer):
    def __init__(self, params: list[torch.Tensor], choice: OptimizerChoice) -> None:
        super().__init__(params, defaults={})
        kwargs = dict(choice.kwargs)
        base = kwargs.pop("optimizer_class", torch.optim.AdamW)
        self.offload_gradients = kwargs.pop("offload_gradients", False)
        minimal = kwargs.pop("minimal_size", OFFLOAD_MINIMAL_SIZE)
        if base is torch.optim.AdamW and "fused" not in kwargs:
            kwargs["fused"] = True
        self.host_of: dict[torch.Tensor, torch.Tensor] = {}
        self.host_optimizers: dict[torch.Tensor, torch.optim.Optimizer] = {}
        if any(not p.requires_grad for p in params):
            raise InputError(
                "cpu-offload optimizers keep their own host copies of the parameters; they do not "
                "combine with master weights",
                hint="use --precision fp32, bf16-true or an autocast mode",
            )
        retained = []
        for p in params:
            if p.numel() < minimal:
                retained.append(p)
                continue
            host = torch.empty_like(p)
            host.grad = torch.empty_like(host)
            with torch.no_grad():
                host.copy_(p.detach())
            self.host_of[p] = host
            p.register_post_accumulate_grad_hook(self._to_host)
            self.host_optimizers[p] = base([host], **kwargs)
        self.device_optimizer = base(retained, **kwargs) if retained else None
        self._queue: list[torch.Tensor] = []

    def _to_host(self, p: torch.Tensor) -> None:
        with torch.no_grad():
            self.host_of[p].grad.copy_(p.grad)
        self._queue.append(p)
        if self.offload_gradients:
            p.grad = None

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        if self.device_optimizer is not None:
            self.device_optimizer.step()
        for p in dict.fromkeys(self._queue):
            self.host_optimizers[p].step()
            p.copy_(self.host_of[p])
        self._queue.clear()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.host_of:
            p.grad = None
        if self.device_optimizer is not None:
            self.device_optimizer.zero_grad(set_to_none=set_to_none)

    def memory_roles(self) -> dict[Category, list[torch.Tensor]]:
        """What its tensors are: host copies are fp32 master weights, host buffers gradients."""
        state = [t for opt in self._optimizers() for t in optimizer_state_tensors(opt)]
        return {
            Category.OPTIMIZER_STATE: state,
            Category.MASTER_WEIGHTS: list(self.host_of.values()),
            Category.GRADIENTS: [h.grad for h in self.host_of.values()],
        }

    def host_tensors(self) -> list[torch.Tensor]:
        out: list[torch.Tensor] = []
        for host in self.host_of.values():
            out += [host, host.grad]
        for opt in self.host_optimizers.values():
            out += optimizer_state_tensors(opt)
        return out

    def _optimizers(self) -> list[torch.optim.Optimizer]:
        device = [self.device_optimizer] if self.device_optimizer is not None else []
        return device + list(self.host_optimizers.values())


def stand_in(choice: OptimizerChoice, target: str) -> OptimizerChoice:
    """The choice as a fake trace must build it."""
    if choice.package == "bitsandbytes":
        return choice.with_builder(
            lambda params, c: BitsAndBytesStandIn(params, c, target), BNB_METHOD
        )
    if choice.package == "torchao" and choice.cls.__name__ == "CPUOffloadOptimizer":
        if target != "cuda":
            raise InputError("CPU offload needs a CUDA target", hint="use --target cuda")
        return choice.with_builder(CpuOffloadStandIn, OFFLOAD_METHOD)
    return choice


def _tensor_ids(obj: Any) -> set[int]:
    return {id(t) for t in tensor_leaves(obj)}


TORCHAO_CACHED_TABLES = (
    ("torchao.optim.subclass_8bit", ("get_qmap_signed", "get_qmap_unsigned")),
    ("torchao.optim.subclass_4bit", ("get_qmap_signed", "get_qmap_unsigned")),
)
"""torchao builds its quantization tables once per process (``functools.lru_cache``) the first
time an optimizer state is made: a first trace would count the building and later ones not."""


def warm_library_caches(choice: OptimizerChoice) -> None:
    """Build a library's once-per-process tables before any trace, as a process that has
    already made one optimizer would have them: every trace then sees the same steps."""
    if choice.package != "torchao":
        return
    import importlib

    for module_name, functions in TORCHAO_CACHED_TABLES:
        try:
            module = importlib.import_module(module_name)
        except ImportError:  # pragma: no cover - other torchao versions
            continue
        for name in functions:
            function = getattr(module, name, None)
            if function is not None:
                function()
