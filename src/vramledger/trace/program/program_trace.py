"""Trace the user's own program: it runs unchanged (``program.py``), CUDA is emulated
(``cuda_emulation.py``) and what it puts on "cuda" is fake, recorded by the same storage
tracker, device policy and value store as ``trace/core/fake.py``'s step.

The program's own CPU work (its data pipeline) stays real and unrecorded: the tracker here
records fake tensors only (:class:`ProgramTracker`). Phases come from the program itself:

- a forward begins when a module is called with none running (outside a backward: a module
  run inside backward is activation checkpointing's recomputation, which the tracker knows);
- a backward begins at ``torch.autograd.backward`` / ``torch.autograd.grad``
  (``loss.backward()`` calls the first);
- the optimizer phase begins at each ``optimizer.step()`` (``torch.optim``'s global hooks); the
  optimizer's parameters and gradients are tagged there, its state when it returns. Tensors
  the step makes without naming a device (torch.optim's ``state["step"]`` counters) are fake
  too: the FakeTensorMode is active for the step, as in ``trace/core/fake.py``;
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
import os
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from vramledger.inputs.adapters import logical_numel
from vramledger.inputs.bnb_weights import EmulatedQuantization
from vramledger.inputs.categories import Category, Phase
from vramledger.inputs.checkpoint_shapes import weights_without_data
from vramledger.inputs.errors import TraceError
from vramledger.inputs.notes import Note, Topic, tagged
from vramledger.inputs.offline_hub import offline_hub
from vramledger.inputs.program import (
    ProgramFailed,
    ProgramRun,
    ProgramSpec,
    children_note,
    launch,
    skipped_saves_note,
)
from vramledger.inputs.training import grad_category, param_category
from vramledger.record.allocator import AllocatorModel
from vramledger.record.timeline import Timeline
from vramledger.trace.core.cpu_kernels import CpuKernels
from vramledger.trace.core.hf_compat import hf_known_values_once_imported
from vramledger.trace.core.trace_errors import FAKE_LIMITS
from vramledger.trace.core.tracker import StorageTracker, TrackerObserver
from vramledger.trace.core.value_stand_ins import ValueStandIns
from vramledger.trace.core.values import KnownValues
from vramledger.trace.emulation.cuda_api import EmulatedGpu, MemoryCounter
from vramledger.trace.emulation.cuda_emulation import CudaEmulation, cuda_default_foreach
from vramledger.trace.emulation.device_mappings import FakeCuda
from vramledger.trace.emulation.paged_states import PagedStates
from vramledger.trace.emulation.policy import DevicePolicy
from vramledger.trace.emulation.triton_launches import TritonLaunches
from vramledger.trace.program.host_stand_ins import HostStandIns
from vramledger.trace.program.host_tensors import HostTensor, HostTensors
from vramledger.trace.program.program_tracker import ProgramTracker, TimelineCounter, emulated
from vramledger.trace.session import Traced, trace_session, tracker_notes, tracker_options


@dataclass(frozen=True, kw_only=True)
class ProgramTrace(Traced):
    """What tracing a program gives: its timeline, how it ran, and what was noted."""

    run: ProgramRun
    host_tensors: list[HostTensor] = field(default_factory=list)
    """The host tensors the program kept after its last step (``host_tensors.py``)."""
    unified_memory_bytes: int = 0
    """Paged optimizer states in CUDA unified memory, outside the allocator's count
    (``paged_states.py``)."""
    trained_on_host_bytes: int = 0
    """Bytes of the parameters the program trained on the host, where it trained none on the
    emulated GPU and ran no forward or backward there (:func:`_trained_on_host`)."""


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
        host_tensors: HostTensors,
    ) -> None:
        self.emulated = lambda t: emulated(t, mode)
        self.host_tensors = host_tensors
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
        self.host_trained: dict[int, int] = {}
        """id -> bytes of every host tensor (not emulated) an optimizer steps that requires
        gradients: a program that trains on the CPU (it chose its device otherwise than by
        asking for "cuda")."""

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
        self._tag_stepped(optimizer)
        self.tracker.set_phase(step, Phase.OPTIMIZER)
        self.mode.__enter__()
        self.in_step = True

    def closure(self, optimizer: Any, closure: Callable[[], Any]) -> Callable[[], Any]:
        """``optimizer.step(closure)``'s closure (Lightning's automatic optimization runs the
        training step's forward and backward in it) run as the program's own code: outside
        the step's fake mode (a ``torch.tensor`` it makes is a host tensor, as in a real run:
        Lightning's ``self.log`` deep-copies one), with its forward and backward phases; the
        gradients it made are tagged when it returns."""

        def run() -> Any:
            step = self.completed + 1
            self.leave_step()
            try:
                return closure()
            finally:
                self._tag_stepped(optimizer)
                self.tracker.set_phase(step, Phase.OPTIMIZER)
                self.mode.__enter__()
                self.in_step = True

        return run

    def _tag_stepped(self, optimizer: Any) -> None:
        stepped = [p for g in optimizer.param_groups for p in g["params"]]
        # torchtune's recipes give the optimizer every parameter, the frozen ones too
        self.trainable.update(
            (id(p), getattr(p, STANDS_FOR, p.numel()))
            for p in stepped
            if self.emulated(p) and p.requires_grad
        )
        self.host_trained.update(
            (id(p), p.untyped_storage().nbytes())
            for p in stepped
            if isinstance(p, torch.Tensor) and not self.emulated(p) and p.requires_grad
        )
        params = [p for p in stepped if not hasattr(p, STANDS_FOR)]
        self.register([p for p in params if self.emulated(p)], Category.PARAMETERS)
        self.register([p.grad for p in params if self.emulated(p.grad)], Category.GRADIENTS)

    def before_step_in_backward(self, optimizer: Any, step: int) -> None:
        self._tag_stepped(optimizer)
        self.tracker.set_phase(step, Phase.OPTIMIZER)
        self.mode.__enter__()
        self.in_step = True

    def after_step_in_backward(self, optimizer: Any, step: int) -> None:
        self.leave_step()
        self.observer.optimizer_stepped(optimizer)
        self.tracker.set_phase(step, Phase.BACKWARD)

    def after_step(self, optimizer: Any, step: int) -> None:
        """Step ``step`` ended: its ``optimizer.step()`` returned, or (``optimizer`` None) the
        backward whose gradient hooks stepped one optimizer per parameter ended."""
        self.leave_step()
        self.host_tensors.after_step(step)
        if optimizer is not None:
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
            # a step raised inside a backward's hook: autograd's engine restored the dispatch
            # mode stack as it was around the hook, the mode is gone already
            if torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is self.mode:
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
    tracker = _tracker(mode, host, values, policy, world)
    # custom operators found by name: as a CPU run runs them, and LLM.int8's outliers
    cpu_kernels = CpuKernels(tracker._substitutes, tracker, cpu=policy.name == "cpu")
    tracker._substitutes = cpu_kernels
    observer = TrackerObserver(tracker, policy.host_resident)
    # several ranks run one after another in this process: what one rank's frames reach on the
    # host is not told apart from the others' (torchtitan's two ranks listed 24.7 MB of
    # full-size fp32 weights that neither real process holds), so only one rank's are listed
    host_tensors = HostTensors(host.mode, values.storages, spec.max_steps, listed=world is None)
    phases = _Phases(tracker, observer, mode, spec.max_steps, tracker.module_names, host_tensors)
    stand_ins = ValueStandIns(values)
    quantization = EmulatedQuantization(phases.register, cuda_target=policy.name == "cuda")
    fake_cuda = FakeCuda(
        mode,
        phases.register,
        stand_ins,
        host,
        moves,
        parameter_move=quantization.move,
        # the GPU's code paths where a GPU run is predicted; a CPU run's where a CPU run is,
        # and on several ranks, whose engines run on the fake process group as on gloo
        reports_cuda=policy.name == "cuda",
    )
    emulation = CudaEmulation(gpu, counter(tracker.timeline, policy.allocator), fake_cuda)
    paged = PagedStates(mode)
    triton = TritonLaunches()
    if moves is not None:
        moves.tracker = tracker
    notes: list[str] = []
    foreach = cuda_default_foreach() if policy.name == "cuda" else contextlib.nullcontext([])
    try:
        with (
            _warnings_kept(),
            # the session every trace runs in (trace/session.py): the program's
            # torch.compile'd modules and functions run as Inductor runs them
            trace_session(policy, tracker, notes),
            phases.hooks(),
            emulation,
            foreach as decided,
            weights_without_data() as shapes,
            offline_hub() as hub,
            hf_known_values_once_imported(values) as phases.on_forward,
            quantization,
            paged.installed() if fake_cuda.reports_cuda else contextlib.nullcontext(),
            triton.installed() if fake_cuda.reports_cuda else contextlib.nullcontext(),
            world.entered(fake_cuda.device, phases.register, phases.replaced)
            if world is not None
            else contextlib.nullcontext(),
        ):
            run = launch(spec, phases)
    except ProgramFailed as failed:
        _raise_refusal(failed, hub)
        raise
    timeline = _last_step_with_tail(tracker.close(), run.steps)
    notes += _notes(
        run,
        emulation=emulation,
        world=world,
        shapes=shapes,
        host=host,
        quantization=quantization,
        stand_ins=stand_ins,
        values=values,
        tracker=tracker,
        policy=policy,
        decided=bool(decided),
    )
    if (kept := host_tensors.note()) is not None:
        notes.append(Note(Topic.PROGRAM, kept))
    notes += cpu_kernels.notes()
    if fake_cuda.reports_cuda:
        notes.append(Note(Topic.KERNELS, _gpu_paths_note(tracker, paged, triton)))
    if (unified := paged.note()) is not None:
        notes.append(Note(Topic.PROGRAM, unified))
    if (launched := triton.note()) is not None:
        notes.append(Note(Topic.KERNELS, launched))
    return ProgramTrace(
        host_tensors=host_tensors.found,
        unified_memory_bytes=paged.nbytes,
        timeline=timeline,
        run=run,
        parameters=sum(phases.parameters.values()),
        trainable_parameters=sum(phases.trainable.values()),
        trained_on_host_bytes=_trained_on_host(phases, timeline),
        notes=list(dict.fromkeys(policy.notes() + notes)),
        seconds=time.perf_counter() - start,
    )


@contextlib.contextmanager
def _warnings_kept() -> Iterator[None]:
    """The program's warnings filters and environment variables, restored after its run (a
    program's ``os.environ["OMP_NUM_THREADS"] = "1"`` would reach the next trace, and real
    processes spawned later); one of fake tensors' own warnings is silenced:
    Tensor.__deepcopy__ asks a fake tensor for its data pointer (``copy.deepcopy(model)``)."""
    environment = dict(os.environ)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
            yield
    finally:
        if dict(os.environ) != environment:
            os.environ.clear()
            os.environ.update(environment)


def _tracker(
    mode: FakeTensorMode,
    host: HostStandIns,
    values: KnownValues,
    policy: DevicePolicy,
    world: ProgramWorld | None,
) -> ProgramTracker:
    """The tracker of a program's run on ``mode``'s fake tensors under ``policy``."""
    return ProgramTracker(
        mode,
        host,
        host_numbers=policy.name == "cpu",
        **tracker_options(
            policy,
            values,
            op_categories=world.op_categories if world is not None else None,
            resize_category=world.resize_category if world is not None else None,
        ),
    )


def _trained_on_host(phases: _Phases, timeline: Timeline) -> int:
    """Bytes of the parameters the optimizers stepped on the host, when none they stepped was on
    the emulated GPU and no device memory was allocated in a forward or backward: the program
    trained on the CPU, and the answer is not its training's (a program that picks its device
    by some other test than ``torch.cuda``'s). 0 otherwise (offloaded optimizer states step host
    copies of parameters whose forward and backward ran on the device)."""
    if phases.trainable or not phases.host_trained:
        return 0
    computed = (Phase.FORWARD, Phase.BACKWARD)
    on_device = (
        not host and phase in computed
        for (_step, phase), host in zip(timeline.origin, timeline.on_host, strict=True)
    )
    return 0 if any(on_device) else sum(phases.host_trained.values())


def _gpu_paths_note(tracker: StorageTracker, paged: PagedStates, triton: TritonLaunches) -> str:
    """What the program was told of its device, and the GPU-only paths the trace saw it take
    (the optimizer's implementation, the attention kernel and compiled regions have notes of
    their own)."""
    taken = [f"{name} ×{calls}" for name, calls in sorted(tracker.higher_order_calls.items())]
    if paged.nbytes:
        taken.append("bitsandbytes' paged (unified-memory) optimizer states")
    if triton.launched:
        taken.append(f"{sum(triton.launched.values())} Triton kernel launches")
    return (
        "GPU code paths: the program and its libraries were told their tensors are CUDA "
        "tensors (device cuda:0, is_cuda) and torch.cuda.is_available() is True, at import "
        "too (but bitsandbytes' import, which would load CUDA code); "
        + (
            f"GPU-only paths it took: {', '.join(taken)}"
            if taken
            else "it took no GPU-only path that the trace records on its own"
        )
    )


def _last_step_with_tail(timeline: Timeline, steps: int) -> Timeline:
    """``timeline`` with what runs after the last of ``steps`` optimizer steps (evaluation,
    logging) as the last step's tail: its own step would have no forward and backward to
    report."""
    if steps:
        timeline.marks = [m for m in timeline.marks if m[1] <= steps]
    return timeline


def _raise_refusal(failed: ProgramFailed, hub: Any) -> None:
    """Raise what the program's exception means, when it is not the program's own: a download
    refused offline, or an operator that needs a value fake tensors do not have."""
    if (refused := hub.refusal(failed.exception)) is not None:
        raise refused from None
    if isinstance(failed.exception, FAKE_LIMITS):
        exc = failed.exception
        raise TraceError(
            f"the program needs a value computed from parameters ({type(exc).__name__}: "
            f"{str(exc).strip().splitlines()[0] if str(exc).strip() else ''}), which fake "
            f"tensors do not have",
            hint="run it for real with `vramledger run --measure` (on CPU)",
        ) from exc


def _notes(
    run: ProgramRun,
    *,
    decided: bool,
    emulation: CudaEmulation,
    world: ProgramWorld | None,
    shapes: Any,
    host: HostStandIns,
    quantization: EmulatedQuantization,
    stand_ins: ValueStandIns,
    values: KnownValues,
    tracker: ProgramTracker,
    policy: DevicePolicy,
) -> list[str]:
    """What the trace of a program assumed and did, for the notes."""
    notes: list[str] = []
    if decided:
        notes.append(
            Note(
                Topic.KERNELS,
                "torch.optim optimizers: foreach implementation (CUDA's default for CUDA tensors)",
            )
        )
    if emulation.autocasts:
        notes.append(
            Note(
                Topic.PROGRAM,
                f"the program ran torch.autocast('cuda') to {' and '.join(emulation.autocasts)} "
                f"(as CPU autocast over the emulated tensors, with {policy.name}'s operator "
                "lists)",
            )
        )
    if emulation.host_device_contexts:
        notes.append(
            Note(
                Topic.PROGRAM,
                "the program set the CPU as the default device (with torch.device(...)) at "
                f"{', '.join(emulation.host_device_contexts)}: tensors made there are host "
                "memory here; where that device was taken from a GPU tensor "
                "(torch.device(x.device)), the GPU run makes them on the GPU and this "
                "prediction does not count them",
            )
        )
    notes += tagged(world.notes() if world is not None else [], Topic.ENGINE)
    notes += tagged(shapes.notes(), Topic.INPUTS)
    if (built := host.note()) is not None:
        notes.append(Note(Topic.PROGRAM, built))
    if (quantized := quantization.note()) is not None:
        notes.append(Note(Topic.MODEL, quantized))
    notes += tagged(stand_ins.notes(), Topic.VALUES)
    if values.routed_ops:
        notes.append(
            Note(
                Topic.VALUES,
                f"{', '.join(sorted(values.routed_ops))} over values computed from parameters "
                "answered with the balanced routing (row r picks (r·k + j) mod n, "
                "trace/core/values.py)",
            )
        )
    if run.skipped_saves:
        notes.append(Note(Topic.PROGRAM, skipped_saves_note(run.skipped_saves)))
    if run.children:
        notes.insert(0, Note(Topic.PROGRAM, children_note(run.children)))
    return notes + tracker_notes(tracker)
