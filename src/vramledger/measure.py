"""``measure``: run the same training step for real and report the same ledger.

The run is recorded twice, independently:

- the storage tracker (the one tracing uses) gives the Timeline, so the measured ledger has the
  same categories, phases and modules as a prediction;
- the allocator's own count gives the measured total: on CPU in one process, ``torch.profiler``
  memory events (``profile_memory=True``; the profiler starts before the model is built, so
  nothing is missed on this thread); on CPU under several processes, ``cpu_allocator_count`` (a
  wrapper of the CPU allocator that sees the frees gloo makes on its own threads, which the
  profiler misses); on CUDA, ``torch.cuda.max_memory_allocated()`` after
  ``reset_peak_memory_stats()`` at the start of each step. ``zero1``/``zero2`` run DeepSpeed's
  engine (``parallel/real.py: measure_deepspeed``).

The difference between the two totals is memory that operators allocate inside their kernels,
which no dispatch-level tracker sees.
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.profiler import profile, record_function

from .allocator_events import memory_events, ranges, recording
from .categories import CATEGORY_PRIORITY, Category, Phase
from .errors import InputError
from .ledger import Ledger, build_ledger
from .parallel.accelerate import apply_accelerate
from .parallel.engines import adapt_recipe
from .parallel.pipeline import measure_pipeline
from .parallel.real import (
    check_world,
    gather_peaks,
    in_step_context,
    measure_deepspeed,
    real_optimizer,
    wrap_real,
)
from .parallel.strategy import DEEPSPEED_STRATEGIES
from .predict import as_spec, policy_for
from .recipe import count_parameters, module_names, resolve
from .spec import TrainingSpec
from .trace.tracker import StorageTracker, TrackerObserver
from .training import assemble
from .version import __version__

_STEP_LABEL = "vramledger.step{}"


@dataclass(frozen=True, kw_only=True)
class Measurement:
    """A measured run: its ledger (from the tracker) and the allocator's own peaks."""

    ledger: Ledger
    device: str
    measured_peak_bytes: int
    """Steady-state step peak as the allocator counts it (profiler events on CPU,
    ``max_memory_allocated`` on CUDA)."""
    measured_first_step_peak_bytes: int
    method: str
    measured_step_peaks: dict[int, int] = field(default_factory=dict)
    estimate: Ledger | None = None
    """The prediction for the same spec, when asked to compare."""
    ranks: list[dict[str, Any]] = field(default_factory=list)
    """Under torchrun: every rank's measured and tracked peak (gathered)."""

    @property
    def untracked_bytes(self) -> int:
        """Allocator peak minus tracker peak: allocations inside kernels."""
        return self.measured_peak_bytes - self._tracked_peak

    @property
    def _tracked_peak(self) -> int:
        return self.ledger.allocated_peak_bytes if self.device == "cuda" else self.ledger.peak_bytes

    def error(self) -> float | None:
        """Relative error of the estimate against the measured peak."""
        if self.estimate is None:
            return None
        predicted = (
            self.estimate.allocated_peak_bytes
            if self.device == "cuda"
            else self.estimate.peak_bytes
        )
        return (predicted - self.measured_peak_bytes) / self.measured_peak_bytes

    def by_category(self) -> list[tuple[Category, int, int]]:
        """(category, estimated, measured) bytes at each one's steady-state peak, for every
        category either has, in the vocabulary's order (the measured side is the tracker's view
        of the real run: the same categories)."""
        if self.estimate is None:
            return []
        return [
            (c, self.estimate.at_peak.get(c, 0), self.ledger.at_peak.get(c, 0))
            for c in CATEGORY_PRIORITY
            if self.estimate.at_peak.get(c, 0) or self.ledger.at_peak.get(c, 0)
        ]

    def to_dict(self) -> dict[str, Any]:
        out = self.ledger.to_dict()
        out.update(
            device=self.device,
            measured_peak_bytes=self.measured_peak_bytes,
            measured_first_step_peak_bytes=self.measured_first_step_peak_bytes,
            measured_step_peaks={str(k): v for k, v in self.measured_step_peaks.items()},
            measurement_method=self.method,
            untracked_bytes=self.untracked_bytes,
        )
        if self.ranks:
            out["ranks_measured"] = self.ranks
        if self.estimate is not None:
            out["estimate"] = self.estimate.to_dict()
            out["estimate_error"] = self.error()
            out["estimate_by_category"] = {
                c.value: {"estimate": e, "measured": m} for c, e, m in self.by_category()
            }
        return out


def measure(
    spec: TrainingSpec | None = None,
    /,
    *,
    device: str = "cpu",
    compare: bool = False,
    **fields: Any,
) -> Measurement:
    """Run ``spec`` for real on ``device`` ('cpu' or 'cuda') and measure it."""
    spec, _ = apply_accelerate(as_spec(spec, fields))
    if device not in ("cpu", "cuda"):
        raise InputError(f"unknown device {device!r}", hint="measure on cpu or cuda")
    if spec.attn_implementation == "flash_attention_2":
        raise InputError(
            "flash_attention_2 is modelled from flash-attn's code for estimates; its stand-in "
            "computes nothing, so a real run cannot use it",
            hint="measure with --attn-implementation sdpa or eager, or run your own script "
            "with flash-attn on the GPU",
        )
    if device == "cuda" and not torch.cuda.is_available():
        raise InputError("no CUDA GPU here", hint="measure on cpu, or run on a machine with a GPU")
    if spec.world_size > 1:
        check_world(spec)
        if compare:
            raise InputError(
                "--compare is not available under torchrun (the estimate uses its own fake process group)",
                hint="run `vramledger estimate` with the same options separately",
            )
        if device == "cuda":
            torch.cuda.set_device(dist.get_rank() % torch.cuda.device_count())
    start = time.perf_counter()
    # Garbage of earlier work in this process (models in reference cycles) must not die inside
    # the measured steps: on CPU its frees would be subtracted, on CUDA it is counted until then.
    gc.collect()
    if spec.world_size > 1 and (spec.pp > 1 or spec.strategy in DEEPSPEED_STRATEGIES):
        # the pipeline's schedule and DeepSpeed's engine own their step: run by their modules
        run = measure_pipeline(spec, device) if spec.pp > 1 else measure_deepspeed(spec, device)
        ledger, peaks = run.ledger, run.counted_step_peaks
        method = COUNTED if device == "cpu" else "torch.cuda.max_memory_allocated() per step"
    elif device == "cpu" and spec.world_size > 1:
        # gloo frees on its own threads, which the profiler misses: count every thread
        ledger, steps, peaks = _run_counted(spec)
        method = COUNTED
    elif device == "cpu":
        with recording() as prof:
            ledger, steps = _run(spec, device)
        peaks = _profiler_step_peaks(prof, steps)
        method = "torch.profiler memory events (profile_memory=True)"
    else:
        ledger, steps, peaks = _run_cuda(spec)
        method = "torch.cuda.max_memory_allocated() per step"
    estimate = None
    if compare:
        from .predict import estimate as predict

        estimate = predict(spec, target=device)
    ledger = _with_seconds(ledger, time.perf_counter() - start)
    rank_results: list[dict[str, Any]] = []
    if spec.world_size > 1:
        rank_results = gather_peaks(
            {
                "rank": dist.get_rank(),
                "measured_peak_bytes": max(v for k, v in peaks.items() if k >= 2),
                "tracked_peak_bytes": ledger.peak_bytes,
                "at_peak": {c.value: b for c, b in ledger.at_peak.items()},
            }
        )
    return Measurement(
        ledger=ledger,
        device=device,
        measured_peak_bytes=max(v for k, v in peaks.items() if k >= 2),
        measured_first_step_peak_bytes=peaks[1],
        measured_step_peaks=peaks,
        method=method,
        estimate=estimate,
        ranks=rank_results,
    )


EAGER_TORCHAO = "torchao's compiled optimizer step ran eagerly under the tracker (same arithmetic)"


def _with_seconds(ledger: Ledger, seconds: float) -> Ledger:
    from dataclasses import replace

    return replace(ledger, seconds=seconds)


def _run(spec: TrainingSpec, device: str, per_step: Any = None) -> tuple[Ledger, int]:
    torch.manual_seed(spec.seed)
    recipe = adapt_recipe(resolve(spec))
    policy = policy_for(device)
    torch_device = torch.device(device)
    with record_function("vramledger.setup"):
        model = recipe.build_model(torch_device)
        parameters, trainable = count_parameters(model)
        if spec.world_size > 1:
            model = wrap_real(model, spec, recipe.precision.name)
        tracker = StorageTracker(module_names=module_names(model), device_type=torch_device.type)
        observer = TrackerObserver(tracker)
        # Made before tracking, as in a trace: what the inputs function allocates on the way is
        # not part of the step.
        batch = recipe.make_batch(torch_device)
        with tracker:
            run = assemble(
                model=model,
                batch=batch,
                loss_fn=recipe.loss_fn,
                optimizer=real_optimizer(recipe.optimizer, spec),
                precision=recipe.precision,
                device=torch_device,
                grad_accum=spec.grad_accum,
                observer=observer,
            )
            run = in_step_context(run, model)
    notes = ["measured"]
    # The tracker is a dispatch mode, under which torch.compile cannot run: torchao's compiled
    # optimizer step runs eagerly (same arithmetic; the eager step's temporaries).
    eager = recipe.optimizer.package == "torchao"
    if eager:
        notes.append(EAGER_TORCHAO)
    with tracker, torch.compiler.set_stance("force_eager" if eager else "default"):
        for step in range(1, spec.steps + 1):
            if per_step is not None:
                per_step(step, "start")
            with record_function(_STEP_LABEL.format(step)):
                run.step(step, observer)
            if per_step is not None:
                per_step(step, "end")
    timeline = tracker.close()
    state_bytes = timeline.live_at_end(Category.OPTIMIZER_STATE)
    ledger = build_ledger(
        timeline,
        target=device,
        allocator=policy.allocator,
        parameters=parameters,
        trainable_parameters=trainable,
        optimizer_state_bytes=state_bytes,
        optimizer_state_method="measured",
        spec=spec.summary(),
        notes=notes,
        version=__version__,
    )
    return ledger, spec.steps


def _profiler_step_peaks(prof: profile, steps: int) -> dict[int, int]:
    """Peak of the cumulative allocated bytes inside each step's time window."""
    prefix = _STEP_LABEL.format("")
    windows = {int(name[len(prefix) :]): span for name, span in ranges(prof, prefix).items()}
    memory = memory_events(prof)
    peaks: dict[int, int] = {}
    live = 0
    for ts, delta in memory:
        for step, (lo, hi) in windows.items():
            if lo <= ts <= hi:
                peaks[step] = max(peaks.get(step, live), live + delta)
        live += delta
    for step, (lo, _) in windows.items():
        if step not in peaks:
            peaks[step] = sum(d for ts, d in memory if ts < lo)
    assert set(peaks) == set(range(1, steps + 1)), peaks
    return peaks


COUNTED = "cpu_allocator_count: every CPU allocation on every thread, per step"


def _run_counted(spec: TrainingSpec) -> tuple[Ledger, int, dict[int, int]]:
    """A CPU run counted by the allocator wrapper (``cpu_allocator_count``), step by step."""
    from . import cpu_allocator_count

    cpu_allocator_count.install()
    base = cpu_allocator_count.live()
    peaks: dict[int, int] = {}

    def per_step(step: int, when: str) -> None:
        if when == "start":
            cpu_allocator_count.reset_peak()
        else:
            peaks[step] = cpu_allocator_count.peak() - base

    ledger, steps = _run(spec, "cpu", per_step)
    return ledger, steps, peaks


def _run_cuda(spec: TrainingSpec) -> tuple[Ledger, int, dict[int, int]]:
    peaks: dict[int, int] = {}

    def per_step(step: int, when: str) -> None:
        torch.cuda.synchronize()
        if when == "start":
            torch.cuda.reset_peak_memory_stats()
        else:
            peaks[step] = torch.cuda.max_memory_allocated()

    ledger, steps = _run(spec, "cuda", per_step)
    return ledger, steps, peaks


__all__ = ["Measurement", "Phase", "measure"]
