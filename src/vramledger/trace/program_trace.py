"""Trace the user's own program: it runs unchanged (``program.py``), CUDA is emulated
(``cuda_emulation.py``) and what it puts on "cuda" is fake, recorded by the same storage
tracker, device policy and value store as ``trace/fake.py``'s step.

The program's own CPU work (its data pipeline) stays real and unrecorded: the tracker here
records fake tensors only (:class:`ProgramTracker`). Phases come from the program itself:

- a forward begins when a module is called with none running (outside a backward: a module
  run inside backward is activation checkpointing's recomputation, which the tracker knows);
- a backward begins at ``torch.autograd.backward`` / ``torch.autograd.grad``
  (``loss.backward()`` calls the first);
- the optimizer phase begins at each ``optimizer.step()`` (``torch.optim``'s global hooks); the
  optimizer's parameters and gradients are tagged there, its state when it returns. Tensors
  the step makes without naming a device (torch.optim's ``state["step"]`` counters) are fake
  too: the FakeTensorMode is active for the step, as in ``trace/fake.py``;
- step ``k + 1`` begins when step ``k``'s ``optimizer.step()`` returns, its optimizer phase
  first (``zero_grad``, as in ``training.py``), so every step's window runs from one
  ``optimizer.step()`` to the next, whichever optimizer makes it; what runs after the last
  step (evaluation, logging) belongs to the last step.

``torch.cuda.memory_allocated()`` and the rest answer from the timeline recorded so far
(:class:`TimelineCounter`): live device bytes as the target's allocator counts them, the same
replay the ledger makes, so what the program prints is the prediction.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
    UnsupportedOperatorException,
)
from torch.utils._python_dispatch import is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves, tree_map_only
from torch.utils.weak import WeakIdKeyDictionary

from ..adapters import logical_numel
from ..allocator import AllocatorModel
from ..bnb_weights import EmulatedQuantization
from ..categories import Category, Phase
from ..checkpoint_shapes import weights_without_data
from ..errors import TraceError
from ..event_totals import EventTotals, sizes_in
from ..offline_hub import offline_hub
from ..program import ProgramFailed, ProgramRun, ProgramSpec, launch, skipped_saves_note
from ..timeline import Timeline
from ..training import grad_category, param_category
from .compiled import compiled_regions
from .cuda_emulation import (
    CudaEmulation,
    EmulatedGpu,
    FakeCuda,
    MemoryCounter,
    cuda_default_foreach,
)
from .dtensor_compat import untracked_sharding_propagation
from .fake_corrections import CORRECTIONS, SUBSTITUTES, noop_conversions
from .hf_compat import hf_known_values_once_imported
from .host_stand_ins import HostStandIns, meta_of
from .policy import DevicePolicy
from .tracker import StorageTracker, TrackerObserver
from .value_stand_ins import ValueStandIns
from .values import KnownValues

TRACE_DEVICE = torch.device("cpu")
_DEVICE_COPIES = frozenset({torch.ops.aten._to_copy.default})
"""``Tensor.to("cuda")`` of a real tensor: a copy the tracker records as the operator's output
(``cuda_emulation.FakeCuda.move``), not a real tensor met on the device."""


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
    function mode (``cuda_emulation._DeviceMode``), made on the trace's device as the emulation
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


def _emulated(t: Any, mode: FakeTensorMode) -> bool:
    """A fake tensor of ``mode`` (not a host stand-in, ``host_stand_ins.py``), or a tensor
    subclass over such (FSDP2's sharded DTensor parameters and gradients)."""
    if isinstance(t, FakeTensor):
        return t.fake_mode is mode
    if not isinstance(t, torch.Tensor) or not is_traceable_wrapper_subclass(t):
        return False
    names, _ = t.__tensor_flatten__()
    # DTensor's flatten names its device mesh too (an opaque object, not a tensor)
    inner = [x for x in (getattr(t, name) for name in names) if isinstance(x, torch.Tensor)]
    return bool(inner) and all(_emulated(x, mode) for x in inner)


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
    ``other`` that ``MulBackward0`` saves, ``trace/wrapped_numbers.py``) is a real CPU tensor
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
        if func not in _DEVICE_COPIES:
            leaves = tree_leaves((args, kwargs))
            if self.adopt(leaves):  # a host stand-in met on the device: its twin, as for a real one
                args, kwargs = tree_map_only(
                    FakeTensor,
                    lambda t: self._twins[t] if self._host.owns(t) else t,
                    (args, kwargs),
                )
        return super().__torch_dispatch__(func, types, args, kwargs)

    def adopt(self, leaves: list[Any]) -> bool:
        """Record the fake twin of each real CPU tensor (but 0-d ones) and of each host stand-in
        among ``leaves``, from now on and for as long as it lives: tensors the program's GPU run
        holds on the device. True if a host stand-in was among them (the caller swaps in its
        twin).

        Besides an operator's arguments (above), a compiled backward's inputs come here
        (``trace/compiled.py``): autograd materializes the gradients of a compiled region's
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


@dataclass(kw_only=True)
class ProgramTrace:
    """What tracing a program gives: its timeline, how it ran, and what was noted."""

    timeline: Timeline
    run: ProgramRun
    parameters: int
    trainable_parameters: int
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0
    extended: bool = False
    """The timeline was extended from a few of the model's identical blocks
    (``program_blocks.py``), not traced in full."""


_BY_KIND = {Category.PARAMETERS: param_category, Category.GRADIENTS: grad_category}
STANDS_FOR = "_vramledger_stands_for"
"""Set by a world on a tensor an optimizer steps in place of model parameters (DeepSpeed's fp32
master partition of a flat group, ``parallel/program_deepspeed.py``): the elements of the
trainable parameters it stands for, counted as trainable instead of its own. The world tags it
(master weights) and its gradient; the step does not make them parameters and gradients."""


class _Phases:
    """Tells the tracker where the program's forwards, backwards and steps begin (module
    docstring); implements ``program.StepHooks``."""

    def __init__(
        self,
        tracker: StorageTracker,
        observer: TrackerObserver,
        mode: FakeTensorMode,
        max_steps: int,
        names: dict[int, str],
    ) -> None:
        self.emulated = lambda t: _emulated(t, mode)
        self.tracker = tracker
        self.observer = observer
        self.mode = mode
        self.max_steps = max_steps
        self.names = names
        self.completed = 0
        self.depth = 0
        self.in_step = False
        self.on_forward: Callable[[], None] = lambda: None
        """Called as each outermost module call begins (before its phase is set)."""
        self.parameters: dict[int, int] = {}
        """id -> elements of every fake parameter seen (no reference kept: a reference would
        keep it alive)."""
        self.trainable: dict[int, int] = {}
        """The same, of the parameters an optimizer steps that require gradients."""

    def register(self, tensors: list[torch.Tensor], category: Category) -> None:
        tensors = [t for t in tensors if t is not None]
        if category is Category.PARAMETERS:
            # a quantized weight's state (absmax, codes) is parameter memory, not parameters
            for t in (t for t in tensors if isinstance(t, nn.Parameter)):
                self.parameters.setdefault(id(t), logical_numel(t))
        kind = _BY_KIND.get(category)
        if kind is None:
            self.tracker.track(tensors, category)
            return
        for t in tensors:  # FSDP2's DTensor shards are sharded parameters and gradients
            self.tracker.track([t], kind(t))

    def replaced(self, old: torch.Tensor, new: torch.Tensor) -> None:
        """``new`` takes ``old``'s place as a parameter (FSDP2's shard of it): counted once."""
        if self.parameters.pop(id(old), None) is not None:
            self.parameters[id(new)] = logical_numel(new)

    def forward_pre(self, module: nn.Module, _args: Any) -> None:
        if self.depth == 0:
            self.on_forward()
            if id(module) not in self.names:
                self.names.update(
                    {id(m): name or type(module).__name__ for name, m in module.named_modules()}
                )
                fake = [p for p in module.parameters() if self.emulated(p)]
                self.register(fake, Category.PARAMETERS)
                self.register([b for b in module.buffers() if self.emulated(b)], Category.BUFFERS)
            backward = torch._C._current_autograd_node() is not None
            if not backward and not self.in_step and self.tracker.phase is not Phase.FORWARD:
                self.tracker.set_phase(self.completed + 1, Phase.FORWARD)
        self.depth += 1

    def forward_post(self, _module: nn.Module, _args: Any, _out: Any) -> None:
        self.depth = max(0, self.depth - 1)

    def backward(self) -> None:
        if self.tracker.phase is not Phase.BACKWARD:
            self.tracker.set_phase(self.completed + 1, Phase.BACKWARD)

    def before_step(self, optimizer: Any, step: int) -> None:
        stepped = [p for g in optimizer.param_groups for p in g["params"]]
        # torchtune's recipes give the optimizer every parameter, the frozen ones too
        self.trainable.update(
            (id(p), getattr(p, STANDS_FOR, p.numel()))
            for p in stepped
            if self.emulated(p) and p.requires_grad
        )
        params = [p for p in stepped if not hasattr(p, STANDS_FOR)]
        self.register([p for p in params if self.emulated(p)], Category.PARAMETERS)
        self.register([p.grad for p in params if self.emulated(p.grad)], Category.GRADIENTS)
        self.tracker.set_phase(step, Phase.OPTIMIZER)
        self.mode.__enter__()
        self.in_step = True

    def after_step(self, optimizer: Any, step: int) -> None:
        self.leave_step()
        self.observer.optimizer_stepped(optimizer)
        self.completed = step
        if step < self.max_steps:
            self.tracker.set_phase(step + 1, Phase.OPTIMIZER)

    def stepped_within(self, optimizer: Any) -> None:
        """Its state is optimizer state (torchtitan's OptimizersContainer steps an AdamW per
        model part, and holds no state of its own)."""
        self.observer.optimizer_stepped(optimizer)

    def leave_step(self) -> None:
        if self.in_step:
            self.in_step = False
            self.mode.__exit__(None, None, None)

    @contextlib.contextmanager
    def hooks(self) -> Iterator[None]:
        handles = [
            nn.modules.module.register_module_forward_pre_hook(self.forward_pre),
            nn.modules.module.register_module_forward_hook(self.forward_post, always_call=True),
        ]
        backward, grad = torch.autograd.backward, torch.autograd.grad

        def patched_backward(*args: Any, **kwargs: Any) -> Any:
            self.backward()
            return backward(*args, **kwargs)

        def patched_grad(*args: Any, **kwargs: Any) -> Any:
            self.backward()
            return grad(*args, **kwargs)

        torch.autograd.backward, torch.autograd.grad = patched_backward, patched_grad
        try:
            yield
        finally:
            torch.autograd.backward, torch.autograd.grad = backward, grad
            for handle in handles:
                handle.remove()
            self.leave_step()


_FAKE_LIMITS = (
    UnsupportedOperatorException,
    DataDependentOutputException,
    DynamicOutputShapeException,
)


class ProgramWorld(Protocol):
    """The program as one rank of several (``parallel/program_world.py``): its process group,
    DDP and FSDP2 while it runs, and the categories of FSDP2's buffers."""

    op_categories: dict[str, Category]
    resize_category: Category | None

    def entered(
        self,
        device: torch.device,
        register: Callable[[list[torch.Tensor], Category], None],
        replaced: Callable[[torch.Tensor, torch.Tensor], None],
    ) -> contextlib.AbstractContextManager[None]: ...

    def notes(self) -> list[str]: ...


def trace_program(
    spec: ProgramSpec,
    policy: DevicePolicy,
    gpu: EmulatedGpu,
    world: ProgramWorld | None = None,
    *,
    moves: Any = None,
    counter: Callable[[Timeline, AllocatorModel], MemoryCounter] = TimelineCounter,
) -> ProgramTrace:
    """Run the program with CUDA emulated on fake tensors under ``policy`` (as one rank of
    ``world`` when given); return its timeline. The program's exception raises
    ``ProgramFailed``; one that fake tensors cause (an operator that needs values computed from
    parameters) raises ``TraceError``.

    ``moves``: told of each module the program moves to "cuda" and given the tracker
    (``program_blocks.ShallowModel``: the model at a few blocks); ``counter``: what
    ``torch.cuda.memory_allocated()`` and the rest answer from (default: the timeline so
    far)."""
    start = time.perf_counter()
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    values = KnownValues(mode)
    host = HostStandIns()
    tracker = ProgramTracker(
        mode,
        host,
        host_numbers=policy.name == "cpu",
        op_observer=policy.op_observer(),
        corrections=CORRECTIONS,
        substitutes=SUBSTITUTES,
        answer_optimizer_scalars=True,
        values=values,
        op_categories=world.op_categories if world is not None else None,
        resize_category=world.resize_category if world is not None else None,
    )
    observer = TrackerObserver(tracker, policy.host_resident)
    phases = _Phases(tracker, observer, mode, spec.max_steps, tracker.module_names)
    stand_ins = ValueStandIns(values)
    quantization = EmulatedQuantization(phases.register, cuda_target=policy.name == "cuda")
    fake_cuda = FakeCuda(
        mode, phases.register, stand_ins, host, moves, parameter_move=quantization.move
    )
    emulation = CudaEmulation(gpu, counter(tracker.timeline, policy.allocator), fake_cuda)
    ranks = (
        world.entered(fake_cuda.device, phases.register, phases.replaced)
        if world is not None
        else contextlib.nullcontext()
    )
    if moves is not None:
        moves.tracker = tracker
    notes: list[str] = []
    foreach = cuda_default_foreach() if policy.name == "cuda" else contextlib.nullcontext([])
    try:
        with (
            warnings.catch_warnings(),
            policy.context(),
            noop_conversions(),
            # DTensor's first propagation of an operator (torchtitan's fused AdamW on FSDP2's
            # shards at step 1) makes global-shape tensors under the step's fake mode
            untracked_sharding_propagation(),
            torch.compiler.set_stance("force_eager"),
            tracker,
            # the program's torch.compile'd modules and functions run as Inductor runs them
            compiled_regions(tracker, notes, policy.name),
            phases.hooks(),
            emulation,
            foreach as decided,
            weights_without_data() as shapes,
            offline_hub() as hub,
            hf_known_values_once_imported(values) as phases.on_forward,
            quantization,
            ranks,
        ):
            # Tensor.__deepcopy__ asks a fake tensor for its data pointer (copy.deepcopy(model))
            warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
            run = launch(spec, phases)
    except ProgramFailed as failed:
        if (refused := hub.refusal(failed.exception)) is not None:
            raise refused from None
        if isinstance(failed.exception, _FAKE_LIMITS):
            exc = failed.exception
            raise TraceError(
                f"the program needs a value computed from parameters ({type(exc).__name__}: "
                f"{str(exc).strip().splitlines()[0] if str(exc).strip() else ''}), which fake "
                f"tensors do not have",
                hint="run it for real with `vramledger run --measure` (on CPU)",
            ) from exc
        raise
    timeline = tracker.close()
    if run.steps:
        # What runs after the last optimizer step (evaluation, logging) is the last step's
        # tail: its own step would have no forward and backward to report.
        timeline.marks = [m for m in timeline.marks if m[1] <= run.steps]
    if decided:
        notes.append(
            "torch.optim optimizers: foreach implementation (CUDA's default for CUDA tensors)"
        )
    if emulation.autocasts:
        notes.append(
            f"the program ran torch.autocast('cuda') to {' and '.join(emulation.autocasts)} "
            f"(as CPU autocast over the emulated tensors, with {policy.name}'s operator lists)"
        )
    notes += world.notes() if world is not None else []
    notes += shapes.notes()
    if (built := host.note()) is not None:
        notes.append(built)
    if (quantized := quantization.note()) is not None:
        notes.append(quantized)
    notes += stand_ins.notes()
    if values.routed_ops:
        notes.append(
            f"{', '.join(sorted(values.routed_ops))} over values computed from parameters "
            "answered with the balanced routing (row r picks (r·k + j) mod n, "
            "trace/values.py)"
        )
    if run.skipped_saves:
        notes.append(skipped_saves_note(run.skipped_saves))
    if tracker.scalars_answered:
        notes.append(
            "optimizer.step() read scalar values with .item(); fake tensors have none, so "
            f"{tracker.scalar_answer} was used (scalars never change memory)"
        )
    return ProgramTrace(
        timeline=timeline,
        run=run,
        parameters=sum(phases.parameters.values()),
        trainable_parameters=sum(phases.trainable.values()),
        notes=list(dict.fromkeys(policy.notes() + notes)),
        seconds=time.perf_counter() - start,
    )
