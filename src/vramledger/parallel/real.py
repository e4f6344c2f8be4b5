"""Real data-parallel runs: wrap a real model with the real engine of a strategy, in a process
group that torchrun (or a test) started — gloo on CPU, NCCL on GPUs.

=============  ==============================================================================
ddp            ``DistributedDataParallel``
zero1-torch    ``DistributedDataParallel`` + ``ZeroRedundancyOptimizer`` over the optimizer class
zero3, fsdp    ``fully_shard`` (FSDP2) on the units the estimate shards (``fsdp_units.py``: each
               block of the largest stack of identical blocks, or the named units) and the root
zero1, zero2   DeepSpeed's own engine (``deepspeed_engine.py``), built by the same code as the
               estimate's: :func:`measure_deepspeed` (``vramledger measure`` does not build it)
=============  ==============================================================================
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..categories import Category, Phase
from ..errors import InputError
from ..ledger import Ledger
from ..optimizers import OptimizerChoice
from ..spec import TrainingSpec
from ..trace.tracker import TrackerObserver
from ..training import NullObserver
from .strategy import DDP_STRATEGIES, DEEPSPEED_STRATEGIES


def check_world(spec: TrainingSpec) -> None:
    if not dist.is_initialized():
        raise InputError(
            f"measuring {spec.strategy} on {spec.world_size} ranks needs a process group",
            hint=f"launch with torchrun --nproc-per-node {spec.world_size} -m vramledger.cli measure ...",
        )
    if dist.get_world_size() != spec.world_size:
        raise InputError(
            f"--world-size {spec.world_size} but the process group has {dist.get_world_size()} ranks"
        )
    if spec.precision.endswith("-mixed") and spec.strategy == "zero1-torch":
        raise InputError(
            "measuring zero1-torch with master weights is not supported", hint="use fsdp, or fp32"
        )


def wrap_real(model: nn.Module, spec: TrainingSpec, precision_name: str) -> nn.Module:
    from .mesh import apply_inner_parallelism, build_mesh, uses_mesh

    if uses_mesh(spec):  # tensor / context / expert parallel (and FSDP2 over data parallel)
        if spec.strategy in DDP_STRATEGIES and spec.dp_degree * spec.cp > 1:
            raise InputError(
                "measuring DDP over a tensor/context/expert-parallel model is not supported",
                hint="measure it with --strategy fsdp over the data-parallel ranks",
            )
        device = "cuda" if next(model.parameters()).is_cuda else "cpu"
        return apply_inner_parallelism(model, build_mesh(spec, device), spec, [], precision_name)
    if spec.strategy in DDP_STRATEGIES:
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model)
    if spec.strategy in ("zero3", "fsdp"):
        from torch.distributed.device_mesh import init_device_mesh

        from .fsdp_units import apply_fully_shard

        device = "cuda" if next(model.parameters()).is_cuda else "cpu"
        mesh = init_device_mesh(device, (spec.world_size,))
        apply_fully_shard(model, spec, mesh, precision_name)  # as the estimate wraps it
        return model
    return model


def in_step_context(run: Any, model: nn.Module) -> Any:
    """The run, its steps inside what the parallelized model needs around them (loss parallel,
    context parallel: ``mesh.step_context``), as in the estimate."""
    from .mesh import applied
    from .mesh import in_step_context as wrapped

    return wrapped(run, model) if applied(model).words else run


def real_optimizer(choice: OptimizerChoice, spec: TrainingSpec) -> OptimizerChoice:
    """zero1-torch: the user's optimizer inside a ZeroRedundancyOptimizer."""
    if spec.strategy != "zero1-torch":
        return choice
    from torch.distributed.optim import ZeroRedundancyOptimizer

    def build(params: list[torch.Tensor], c: OptimizerChoice) -> Any:
        return ZeroRedundancyOptimizer(params, optimizer_class=c.cls, **c.kwargs)

    return choice.with_builder(build, "measured")


def gather_peaks(value: dict[str, Any]) -> list[dict[str, Any]]:
    """Every rank's result, on every rank (rank 0 reports them)."""
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
"""Environment variables torchrun sets for each process it launches."""


def launched_by_torchrun() -> bool:
    import os

    return all(name in os.environ for name in TORCHRUN_ENV)


@contextlib.contextmanager
def torchrun_group(device: str) -> Iterator[int | None]:
    """The process group of a torchrun launch (gloo on CPU, NCCL on CUDA), made here if the
    launcher did not make it; yields the world size, or None outside torchrun."""
    if not launched_by_torchrun() or dist.is_initialized():
        yield dist.get_world_size() if dist.is_initialized() else None
        return
    dist.init_process_group("nccl" if device == "cuda" else "gloo")
    try:
        yield dist.get_world_size()
    finally:
        shut_down_group()


def shut_down_group() -> None:
    """Destroy the process group once every rank is done with it and the engines that used it
    are gone: a gloo group torn down under a live engine can abort the process."""
    import gc

    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


def allocator_counter(cuda: bool) -> tuple[Callable[[], None], Callable[[], int]]:
    """The allocator's own count of a run from here on: ``(start, end)`` — ``start()`` resets
    the peak, ``end()`` is the peak since then above what is live now. CPU: every thread's
    allocations (``cpu_allocator_count``, installed here); CUDA: ``max_memory_allocated``. What
    earlier work left for the garbage collector is collected first, so it is not freed (and
    counted) inside the run."""
    from .. import cpu_allocator_count

    gc.collect()
    if not cuda:
        cpu_allocator_count.install()
    base = torch.cuda.memory_allocated() if cuda else cpu_allocator_count.live()

    def start() -> None:
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        else:
            cpu_allocator_count.reset_peak()

    def end() -> int:
        if cuda:
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated() - base
        return cpu_allocator_count.peak() - base

    return start, end


@dataclass(frozen=True, kw_only=True)
class DeepSpeedMeasurement:
    """One rank's real run of DeepSpeed's engine."""

    ledger: Ledger
    """From the storage tracker (the estimate's categories and phases)."""
    counted_step_peaks: dict[int, int]
    """Per step, the peak of the CPU allocator's own count (every thread; ``cpu_allocator_count``;
    on CUDA ``max_memory_allocated``), counted from the start of the run."""
    counted_phase_peaks: dict[tuple[int, str], int]
    """The same per (step, phase)."""

    @property
    def counted_peak_bytes(self) -> int:
        """Steady-state peak (steps >= 2) of the allocator's count."""
        return max(v for k, v in self.counted_step_peaks.items() if k >= 2)


def measure_deepspeed(spec: TrainingSpec, device: str = "cpu") -> DeepSpeedMeasurement:
    """Run ``spec`` (``zero1``/``zero2``) for real with DeepSpeed's engine as this rank of the
    process group, twice: a plain run (no dispatch mode, no tensor subclass active: the
    tracker changes what autograd allocates, ``trace/plain_autograd.py``) counted by the
    allocator, then a tracked run of the same step for the ledger's categories.

    On CPU the allocator count is ``cpu_allocator_count`` (installed here, so it counts from
    before the model is built); DeepSpeed's shared-memory collectives, which serve only its
    ``inference_all_reduce``, are not compiled. ``LOCAL_RANK`` must be set (torchrun sets it).
    """

    from ..recipe import module_names, resolve
    from ..trace.tracker import StorageTracker
    from .deepspeed import apply_deepspeed
    from .deepspeed_runtime import real_deepspeed

    spec, _ = apply_deepspeed(spec)
    if spec.strategy not in DEEPSPEED_STRATEGIES:
        raise InputError(f"measure_deepspeed runs zero1 or zero2, not {spec.strategy}")
    if not dist.is_initialized() or dist.get_world_size() != spec.world_size:
        raise InputError(f"measure_deepspeed needs a process group of {spec.world_size} ranks")
    cuda = device == "cuda"
    count_start, count_end = allocator_counter(cuda)
    counted: dict[tuple[int, str], int] = {}
    recipe = resolve(spec)
    torch_device = torch.device(device)
    with real_deepspeed(skip_shared_memory_ops=not cuda):
        plain = _PlainCountingObserver(count_start, count_end, counted)
        _deepspeed_steps(spec, recipe, torch_device, plain, None)
        plain.close()
        gc.collect()
        tracker: Any = None

        def tracked_observer(model: nn.Module) -> TrackerObserver:
            nonlocal tracker
            tracker = StorageTracker(
                module_names=module_names(model), device_type=torch_device.type
            )
            return TrackerObserver(tracker)

        notes, counts = _deepspeed_steps(spec, recipe, torch_device, None, tracked_observer)
    return rank_measurement(tracker.close(), counted, spec, device, counts, ["measured", *notes])


def _deepspeed_steps(
    spec: TrainingSpec,
    recipe: Any,
    torch_device: torch.device,
    observer: Any,
    make_observer: Callable[[nn.Module], TrackerObserver] | None,
) -> tuple[list[str], tuple[int, int]]:
    """Build the model and DeepSpeed's run (same seed each time) and run ``spec.steps`` steps:
    plainly with ``observer``, or under the tracker ``make_observer(model)`` makes."""
    from ..recipe import count_parameters
    from .deepspeed_engine import build_run

    torch.manual_seed(spec.seed)
    model = recipe.build_model(torch_device)
    counts = count_parameters(model)
    if make_observer is not None:
        observer = make_observer(model)
    batch = recipe.make_batch(torch_device)
    mode = observer.tracker if make_observer is not None else contextlib.nullcontext()
    with mode:
        run, notes = build_run(
            model=model,
            batch=batch,
            loss_fn=recipe.loss_fn,
            optimizer=recipe.optimizer,
            precision=recipe.precision,
            spec=spec,
            observer=observer,
            fake=False,
        )
        for step in range(1, spec.steps + 1):
            run.step(step, observer)
    return notes, counts


def rank_measurement(
    timeline: Any,
    counted: dict[tuple[int, str], int],
    spec: TrainingSpec,
    device: str,
    counts: tuple[int, int],
    notes: list[str],
) -> DeepSpeedMeasurement:
    """One rank's real run as a measurement: its tracked timeline as a ledger, and the
    allocator's counted peaks per (step, phase) folded per step."""
    from ..ledger import build_ledger
    from ..predict import policy_for
    from ..version import __version__

    ledger = build_ledger(
        timeline,
        target=device,
        allocator=policy_for(device).allocator,
        parameters=counts[0],
        trainable_parameters=counts[1],
        optimizer_state_bytes=timeline.live_at_end(Category.OPTIMIZER_STATE),
        optimizer_state_method="measured",
        spec=spec.summary(),
        notes=notes,
        version=__version__,
    )
    steps: dict[int, int] = {}
    for (step, _), peak in counted.items():
        steps[step] = max(steps.get(step, 0), peak)
    return DeepSpeedMeasurement(
        ledger=ledger, counted_step_peaks=steps, counted_phase_peaks=counted
    )


class _PhasePeaks:
    """The allocator's peak of each (step, phase): ``start()`` resets the counter when a phase
    opens, ``end()`` reads its peak when the next opens or the run closes."""

    def __init__(self, start: Any, end: Any, out: dict[tuple[int, str], int]):
        self._start, self._end, self._out = start, end, out
        self._open: tuple[int, str] | None = None

    def open(self, step: int, phase: Phase) -> None:
        self.close()
        self._open = (step, phase.value)
        self._start()

    def close(self) -> None:
        if self._open is not None:
            key = self._open
            self._out[key] = max(self._out.get(key, 0), self._end())
            self._open = None


class _PlainCountingObserver(NullObserver):
    """Reads the allocator's peak of each (step, phase) and nothing else: no tracker, no
    dispatch mode (the plain run's observer)."""

    def __init__(self, start: Any, end: Any, out: dict[tuple[int, str], int]):
        self._peaks = _PhasePeaks(start, end, out)

    def phase(self, step: int, phase: Phase) -> None:
        self._peaks.open(step, phase)

    def close(self) -> None:
        self._peaks.close()
