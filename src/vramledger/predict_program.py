"""``run_program``: predict the memory of the user's own program, run unchanged with CUDA
emulated on fake tensors (``trace/program_trace.py``), as the ledger ``estimate`` gives.

The ledger is ``build_ledger``'s over the program's timeline (steps are the program's
optimizer steps, all optimizers counted; steady = steps >= 2), with each optimizer's steady
window beside it (``windows.py``). A program stopped before its second step has no steady
state: the report then holds what was seen (the peak so far, by category) and no ledger.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from .categories import Category
from .gpus import Gpu, resolve_gpu
from .ledger import Ledger, build_ledger, replay
from .predict import policy_for
from .program import ProgramSpec
from .trace.cuda_emulation import EmulatedGpu
from .trace.program_blocks import trace_program_blocks
from .verdict import DEFAULT_MARGIN, verdict
from .version import __version__
from .windows import OptimizerWindow, optimizer_windows

DEFAULT_GPU = "h100-80gb"
"""What ``torch.cuda.get_device_properties`` describes when no ``--gpu`` is given (compute
capability 9.0, the trace's default, ``gpus.DEFAULT_COMPUTE_CAPABILITY``)."""


@dataclass(frozen=True)
class _Target:
    """What ``predict.policy_for`` reads of a spec: the target and its GPU."""

    target: str
    gpu: Gpu | None

    def gpu_kind(self) -> Gpu | None:
        return self.gpu


def emulated_gpu(gpu: Gpu) -> EmulatedGpu:
    major, minor = gpu.compute_capability or (9, 0)
    return EmulatedGpu(name=gpu.name, total_memory=gpu.memory_bytes, major=major, minor=minor)


@dataclass(frozen=True, kw_only=True)
class ProgramReport:
    """A program's predicted memory: the ledger (None before a second step), each optimizer's
    window, and how the program ran."""

    program: str
    target: str
    ending: str
    """'ended', 'max-steps' (stopped after ``--max-steps``) or 'timeout'."""
    steps: int
    optimizers: list[str]
    windows: list[OptimizerWindow]
    peak_bytes: int
    """The most device memory held at once over the whole program, as the allocator counts it
    (``torch.cuda.max_memory_allocated()`` with no reset)."""
    at_peak: dict[Category, int]
    """Bytes by category there (tensor bytes)."""
    step_peaks: dict[int, int]
    """Each step's peak, as the allocator counts it."""
    ledger: Ledger | None
    notes: list[str] = field(default_factory=list)
    exit_code: int = 0
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = self.ledger.to_dict() if self.ledger is not None else {}
        out.update(
            program=self.program,
            target=self.target,
            ending=self.ending,
            steps=self.steps,
            optimizers=self.optimizers,
            optimizer_windows=[w.to_dict() for w in self.windows],
            program_peak_bytes=self.peak_bytes,
            program_at_peak={c.value: b for c, b in self.at_peak.items() if b},
            step_peaks={str(k): v for k, v in self.step_peaks.items()},
            notes=self.notes,
            exit_code=self.exit_code,
            seconds=round(self.seconds, 3),
        )
        return out


def run_program(
    spec: ProgramSpec, *, target: str = "cuda", gpu: str | Gpu | None = None
) -> ProgramReport:
    """Run ``spec``'s program with CUDA emulated for ``gpu`` (default H100 80GB) on fake
    tensors, under ``target``'s device policy ('cuda', or 'cpu' to predict what a CPU run's
    allocator counts), and report its memory."""
    kind = gpu if isinstance(gpu, Gpu) else resolve_gpu(gpu or DEFAULT_GPU)
    policy = policy_for(_Target(target, kind if gpu is not None else None))
    traced = trace_program_blocks(spec, policy, emulated_gpu(kind))
    timeline, run = traced.timeline, traced.run
    blocks = replay(timeline, policy.allocator)
    step_peaks = {k: p.total for k, p in blocks.step_peaks.items() if k >= 1}
    raw = replay(timeline)
    seen = max(raw.step_peaks.values(), key=lambda p: p.total, default=None)
    notes = [*traced.notes, _ending_note(run.ending, run.steps, spec)]
    ledger = None
    if timeline.steps >= 2:
        ledger = build_ledger(
            timeline,
            target=target,
            allocator=policy.allocator,
            parameters=traced.parameters,
            trainable_parameters=traced.trainable_parameters,
            optimizer_state_bytes=max(
                (p.by_category.get(Category.OPTIMIZER_STATE, 0) for p in raw.step_peaks.values()),
                default=0,
            ),
            spec={"program": spec.program, "args": list(spec.args), "target": target},
            notes=notes,
            seconds=traced.seconds,
            version=__version__,
        )
        ledger = replace(ledger, blocks_extended=traced.extended)
        if target == "cuda" and gpu is not None:
            ledger = replace(
                ledger,
                verdict=verdict(kind, ledger.reserved_peak_bytes, DEFAULT_MARGIN),
            )
    return ProgramReport(
        program=" ".join([spec.program, *spec.args]),
        target=target,
        ending=run.ending,
        steps=run.steps,
        optimizers=list(run.optimizer_names),
        windows=optimizer_windows(step_peaks, run),
        peak_bytes=max((p.total for p in blocks.step_peaks.values()), default=0),
        at_peak=dict(seen.by_category) if seen is not None else {},
        step_peaks=step_peaks,
        ledger=ledger,
        notes=notes,
        exit_code=run.exit_code,
        seconds=traced.seconds,
    )


def _ending_note(ending: str, steps: int, spec: ProgramSpec) -> str:
    made = f"{steps} optimizer step{'s' if steps != 1 else ''}"
    if ending == "max-steps":
        return f"the program was stopped after {made} (--max-steps {spec.max_steps})"
    if ending == "timeout":
        return f"the program was stopped after {spec.timeout:g} s (--timeout), having made {made}"
    return f"the program ran to its end ({made})"
