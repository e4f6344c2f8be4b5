"""``measure_program``: run the user's program for real on CPU and count what the CPU allocator
hands out: the truth ``run_program --target cpu`` is checked against.

The program runs unchanged (``program.py``) with no fake tensor and no dispatch mode: "cuda"
is the CPU (``device_mappings.CpuForCuda``: a factory's ``device="cuda"`` makes a real CPU
tensor, ``.to("cuda")``/``.cuda()`` of a CPU tensor is that tensor), and
``torch.cuda.memory_allocated()``, ``max_memory_allocated()`` and the rest answer from
``cpu_allocator_count`` (every CPU allocation on every thread, counted from just before the
program starts). Each step's peak is counted over the same windows a trace reports (from one
``optimizer.step()`` to the next, ``trace/program/program_trace.py``).

What differs from a GPU run, by construction: every CPU allocation of the program counts (its
data pipeline's too, which a GPU's allocator never sees), and a tensor moved to "cuda" is
counted from its creation on the host rather than from the copy.
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any

from vramledger.inputs.bnb_weights import quantizing_move, real_quantization
from vramledger.inputs.errors import VramledgerError
from vramledger.inputs.gpus import resolve_gpu
from vramledger.inputs.notes import Note, Topic, records, tagged
from vramledger.inputs.program import (
    ProgramFailed,
    ProgramRun,
    ProgramSpec,
    children_note,
    launch,
    skipped_saves_note,
)
from vramledger.inputs.torchrun_env import TorchrunRank, as_rank
from vramledger.measure import cpu_allocator_count as count
from vramledger.measure.local import run_on_local_gloo
from vramledger.parallel.dtensor_rng import host_rng_on_emulated_mesh
from vramledger.parallel.program_deepspeed import real_program_deepspeed
from vramledger.predict.program import DEFAULT_GPU, emulated_gpu, with_rank_programs
from vramledger.predict.windows import OptimizerWindow, optimizer_windows
from vramledger.trace.emulation.cuda_emulation import CudaEmulation
from vramledger.trace.emulation.device_mappings import CpuForCuda

COUNTED = "cpu_allocator_count: every CPU allocation on every thread, from the program's start"


class CountedCpu:
    """``torch.cuda``'s memory answers from the CPU allocator's count, and each step's peak.

    The allocator counter has one peak register; the program's resets and the step windows'
    both use it, so each keeps the peaks it would have lost to the other's reset."""

    def __init__(self) -> None:
        count.install()
        self.base = count.live()
        count.reset_peak()
        self._program = 0  # the program's peak since its last reset, before the register's
        self._step = 0  # this step's peak, before the register's
        self.step_peaks: dict[int, int] = {}

    def allocated(self) -> int:
        return count.live() - self.base

    def max_allocated(self) -> int:
        return max(self._program, count.peak()) - self.base

    def reserved(self) -> int:
        return self.allocated()  # the CPU allocator caches nothing

    def max_reserved(self) -> int:
        return self.max_allocated()

    def reset_peak(self) -> None:
        self._step = max(self._step, count.peak())
        self._program = 0
        count.reset_peak()

    def end_step(self, step: int) -> None:
        peak = count.peak()
        self.step_peaks[step] = max(self._step, peak) - self.base
        self._program = max(self._program, peak)
        self._step = 0
        count.reset_peak()

    # program.StepHooks
    def before_step(self, optimizer: Any, step: int) -> None:
        pass

    def after_step(self, optimizer: Any, step: int) -> None:
        self.end_step(step)

    def stepped_within(self, optimizer: Any) -> None:
        pass

    def closure(self, optimizer: Any, closure: Any) -> Any:
        return closure

    def before_step_in_backward(self, optimizer: Any, step: int) -> None:
        pass

    def after_step_in_backward(self, optimizer: Any, step: int) -> None:
        pass


@dataclass(frozen=True, kw_only=True)
class ProgramMeasurement:
    """A program's real CPU run: the allocator's peaks, per step and per optimizer."""

    program: str
    ending: str
    steps: int
    optimizers: list[str]
    windows: list[OptimizerWindow]
    peak_bytes: int
    """The most the allocator held at once over the whole program."""
    step_peaks: dict[int, int]
    method: str = COUNTED
    notes: list[str] = field(default_factory=list)
    exit_code: int = 0
    seconds: float = 0.0
    world_size: int = 1
    rank: int = 0
    """The rank this measurement describes: on several ranks, the one with the largest peak."""
    ranks: list[tuple[int, ProgramMeasurement]] = field(
        default_factory=list, repr=False, compare=False
    )
    """On several ranks, every rank's measurement, in rank order."""

    def to_dict(self) -> dict[str, Any]:
        ranks = (([rank], m) for rank, m in self.ranks)
        return with_rank_programs(self._dict(), self.world_size, self.rank, ranks)

    def _dict(self) -> dict[str, Any]:
        return {
            "program": self.program,
            "target": "cpu",
            "measured": True,
            "ending": self.ending,
            "steps": self.steps,
            "optimizers": self.optimizers,
            "optimizer_windows": [w.to_dict() for w in self.windows],
            "program_peak_bytes": self.peak_bytes,
            "step_peaks": {str(k): v for k, v in self.step_peaks.items()},
            "measurement_method": self.method,
            "notes": self.notes,
            "note_records": records(self.notes),
            "exit_code": self.exit_code,
            "seconds": round(self.seconds, 3),
        }


def measure_program(
    spec: ProgramSpec, *, gpu: str | None = None, quiet: bool = False
) -> ProgramMeasurement:
    """Run ``spec``'s program for real on CPU ("cuda" mapped onto the CPU; ``gpu`` only names
    what ``torch.cuda.get_device_properties`` says) and count its allocations. With
    ``spec.world_size`` > 1, on that many local gloo processes as torchrun would launch it,
    each rank counted in its own process (``quiet``: their output goes to stderr)."""
    if spec.world_size > 1:
        return _measure_ranks(spec, gpu, quiet)
    return _measure_one(spec, gpu)


def _measure_one(spec: ProgramSpec, gpu: str | None) -> ProgramMeasurement:
    start = time.perf_counter()
    gc.collect()  # earlier garbage must not die inside the counted run
    counter = CountedCpu()
    emulated = emulated_gpu(resolve_gpu(gpu or DEFAULT_GPU), spec.nproc_per_node)
    emulation = CudaEmulation(emulated, counter, CpuForCuda(quantizing_move))
    try:
        with emulation, real_quantization():
            run: ProgramRun = launch(spec, counter)
    except ProgramFailed as failed:  # this is the plain run: the error is the program's
        failed.confirmed = True
        failed.hint = "its traceback is above; it raised in its plain run on the CPU"
        raise
    if run.steps not in counter.step_peaks or run.ending != "max-steps":
        # what ran after the last step belongs to it, as in a trace (trace/program/program_trace.py)
        last = max(run.steps, 1)
        previous = counter.step_peaks.get(last, 0)
        counter.end_step(last)
        counter.step_peaks[last] = max(previous, counter.step_peaks[last])
    peaks = counter.step_peaks
    return ProgramMeasurement(
        program=" ".join([spec.program, *spec.args]),
        ending=run.ending,
        steps=run.steps,
        optimizers=list(run.optimizer_names),
        windows=optimizer_windows(peaks, run),
        peak_bytes=max(peaks.values(), default=0),
        step_peaks=peaks,
        notes=[
            Note(
                Topic.MEASUREMENT,
                "measured: the program ran for real on CPU, 'cuda' mapped onto the CPU",
            ),
            *tagged(
                [
                    *([skipped_saves_note(run.skipped_saves)] if run.skipped_saves else []),
                    *([children_note(run.children)] if run.children else []),
                ],
                Topic.PROGRAM,
            ),
        ],
        exit_code=run.exit_code,
        seconds=time.perf_counter() - start,
    )


# -- several ranks ---------------------------------------------------------------------------------
def _measure_ranks(spec: ProgramSpec, gpu: str | None, quiet: bool) -> ProgramMeasurement:
    """Every rank on its own gloo process (``measure/local.py``'s harness), the worst rank's
    measurement with every rank's in ``ranks``; a rank whose program raised raises its
    ``ProgramFailed`` here (the other processes are stopped)."""
    start = time.perf_counter()
    world = spec.world_size
    items = run_on_local_gloo(
        world, _measure_rank, (spec, gpu, quiet), world, stop_on=lambda item: item[1] is None
    )
    for rank, measured, failure in items:
        if measured is None:
            raise RankFailed(rank, *failure)
    ranks = sorted((rank, m) for rank, m, _ in items)
    worst_rank, worst = max(ranks, key=lambda item: _steady(item[1]))
    note = Note(
        Topic.MEASUREMENT,
        f"{world} ranks on {world} gloo processes on this machine (torchrun's environment; "
        "the program's init_process_group answered by their gloo group), each counted by its "
        "own allocator",
    )
    return replace(
        worst,
        notes=[*worst.notes, note],
        world_size=world,
        rank=worst_rank,
        ranks=ranks,
        seconds=time.perf_counter() - start,
    )


def _steady(m: ProgramMeasurement) -> int:
    return max((v for k, v in m.step_peaks.items() if k >= 2), default=m.peak_bytes)


class RankFailed(ProgramFailed):
    """A rank's program raised, in its own process: its traceback as text."""

    def __init__(self, rank: int, program_traceback: str, message: str) -> None:
        VramledgerError.__init__(
            self,
            f"rank {rank}: {message}",
            hint="its traceback is above; the error is in the program, not in vramledger",
        )
        self.exception = None
        self.program_traceback = program_traceback
        self.steps = 0


def _measure_rank(
    rank: int, world: int, queue: Any, spec: ProgramSpec, gpu: str | None, quiet: bool
) -> None:
    """One rank, in its own process, inside the harness's gloo group (``run_on_local_gloo``
    work): ``(rank, measurement, None)`` or ``(rank, None, (traceback, message))``."""
    where = TorchrunRank(
        rank=rank,
        nproc_per_node=spec.nproc_per_node,
        nnodes=spec.nnodes,
        master_port=int(os.environ["MASTER_PORT"]),
    )
    output = contextlib.redirect_stdout(sys.stderr) if quiet else contextlib.nullcontext()
    try:
        with (
            output,
            as_rank(where, _the_gloo_group),
            _group_kept(),
            _ddp_on_cpu(),
            host_rng_on_emulated_mesh(),
            real_program_deepspeed(),
        ):
            measured = _measure_one(spec, gpu)
    except ProgramFailed as failed:
        queue.put((rank, None, (failed.program_traceback, failed.one_line())))
        return
    except VramledgerError as error:
        queue.put((rank, None, ("", error.one_line())))
        return
    queue.put((rank, measured, None))


def _the_gloo_group(_backend: str | None, _kwargs: dict[str, Any]) -> None:
    """The program's ``init_process_group`` (any backend): the harness's gloo group is its."""


@contextlib.contextmanager
def _group_kept() -> Iterator[None]:
    """The program's ``destroy_process_group()`` of the default group leaves the harness's
    group (which it shuts down itself, after a barrier)."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    original = c10d.destroy_process_group

    def destroy_process_group(group: Any = None) -> None:
        if group is not None and group is not c10d.GroupMember.WORLD:
            original(group)

    owners = (dist, c10d)
    for owner in owners:
        owner.destroy_process_group = destroy_process_group
    try:
        yield
    finally:
        for owner in owners:
            owner.destroy_process_group = original


@contextlib.contextmanager
def _ddp_on_cpu() -> Iterator[None]:
    """``DDP(model, device_ids=[local_rank])`` of a model on the CPU (its "cuda" is the CPU
    here): DDP refuses device ids for CPU modules, so they are dropped (a CPU module's
    ``device_ids`` must be None)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    original = DDP.__dict__["__init__"]

    def init(
        ddp: Any,
        module: Any,
        device_ids: Any = None,
        output_device: Any = None,
        *args: Any,
        **kwargs: Any,
    ) -> None:
        on_cpu = all(p.device.type == "cpu" for p in module.parameters())
        if on_cpu:
            device_ids = output_device = None
        original(ddp, module, device_ids, output_device, *args, **kwargs)

    DDP.__init__ = init
    try:
        yield
    finally:
        DDP.__init__ = original
