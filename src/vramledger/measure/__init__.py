"""``measure``: run the same training step for real and report the same ledger.

The step runs twice, and each run gives one thing:

- the **plain run** gives the truth: the step with nothing of vramledger's around it, no
  dispatch mode and no tensor subclass active while it runs (a ``TorchDispatchMode``, the
  tracker included, turns autograd onto its out-of-place branches: ``trace/core/plain_autograd.py``).
  The allocator counts it: on CPU in one process, ``torch.profiler`` memory events
  (``profile_memory=True``; RecordFunction callbacks, not a dispatch mode; the profiler starts
  before the model is built, so nothing is missed on this thread); on CPU under several
  processes, ``cpu_allocator_count`` (a wrapper of the CPU allocator that sees the frees gloo
  makes on its own threads, which the profiler misses); on CUDA,
  ``torch.cuda.max_memory_allocated()`` after ``reset_peak_memory_stats()`` at the start of each
  step. These are ``measured_peak_bytes`` and ``measured_step_peaks``.
- a **tracked run** of the same step (same seed, same batch) under the storage tracker (the one
  tracing uses) gives the Timeline, so the measured ledger has the same categories, phases and
  modules as a prediction. The tracker folds autograd's out-of-place buffers back into their
  operands as the plain run writes them (``trace/core/plain_autograd.py``), so its totals equal the
  plain run's except for memory that operators allocate inside their kernels, which no
  dispatch-level tracker sees (``untracked_bytes``).

On CPU in one process the tracked run goes first: what the step's libraries make once per
process (their import-time tables, caches they fill on first use: bitsandbytes' CPU 4-bit
quantization bounds, 252 B) is then made before the plain run's count starts, as in a program
that imports at its top, whatever ran in this process before.

``zero1``/``zero2`` (DeepSpeed's engine, ``measure/deepspeed.py``) and pipeline stages
(``measure/pipeline.py``) run by their own modules the same way: a plain run counted with
``cpu_allocator_count`` (CUDA: ``max_memory_allocated``; ``measure/counting.py``), then a tracked
run for the ledger. ``measure/local.py`` runs cases on several local gloo processes.
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist
from torch.profiler import profile, record_function

from vramledger.inputs.categories import CATEGORY_PRIORITY, Category, Phase
from vramledger.inputs.errors import InputError
from vramledger.inputs.launch_configs import apply_configs
from vramledger.inputs.notes import Note, Topic
from vramledger.inputs.recipe import count_parameters, module_names, resolve
from vramledger.inputs.spec import TrainingSpec
from vramledger.inputs.training import NullObserver, assemble
from vramledger.inputs.version import __version__
from vramledger.ledger.ledger import Ledger, build_ledger
from vramledger.measure import cpu_allocator_count
from vramledger.measure.counting import MEASURED
from vramledger.measure.deepspeed import measure_deepspeed
from vramledger.measure.pipeline import measure_pipeline
from vramledger.parallel.engines import adapt_recipe
from vramledger.parallel.real import in_step_context, real_optimizer, wrap_real
from vramledger.predict.step import as_spec
from vramledger.predict.step import estimate as predict
from vramledger.record.allocator_events import memory_events, ranges, recording
from vramledger.trace.core.tracker import StorageTracker, TrackerObserver
from vramledger.trace.emulation.target_policy import policy_for

_STEP_LABEL = "vramledger.step{}"


@dataclass(frozen=True, kw_only=True)
class Measurement:
    """A measured run: the allocator's own peaks of a plain run, and the ledger (categories) of
    a separate tracked run of the same step."""

    ledger: Ledger
    """Categories, phases and modules, from the tracked run (``ledger_run``)."""
    device: str
    measured_peak_bytes: int
    """Steady-state step peak as the allocator counts it (profiler events on CPU,
    ``max_memory_allocated`` on CUDA), in the run ``measured_run`` names."""
    measured_first_step_peak_bytes: int
    method: str
    """How the allocator's peaks were counted, and in which run."""
    measured_run: str = ""
    """Which run the allocator's peaks come from (``PLAIN_RUN`` or ``TRACKED_RUN``)."""
    ledger_run: str = ""
    """Which run the ledger (its categories and ``peak_bytes``) comes from."""
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
            measured_run=self.measured_run,
            ledger_run=self.ledger_run,
            tracked_peak_bytes=self._tracked_peak,
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
    # a --deepspeed config decides the strategy and precision, as in the estimate
    spec, _ = apply_configs(as_spec(spec, fields))
    _check(spec, device, compare)
    if spec.world_size > 1 and device == "cuda":
        torch.cuda.set_device(dist.get_rank() % torch.cuda.device_count())
    start = time.perf_counter()
    # Garbage of earlier work in this process (models in reference cycles) must not die inside
    # the measured steps: on CPU its frees would be subtracted, on CUDA it is counted until then.
    gc.collect()
    ledger, peaks, method = _runs(spec, device)
    estimate = predict(spec, target=device) if compare else None
    ledger = _with_seconds(ledger, time.perf_counter() - start)
    # the strategy that ran (its JSON ``engine`` follows), as the estimate's ledger says it
    ledger = replace(ledger, strategy=spec.parallelism.name)
    steady = max(v for k, v in peaks.items() if k >= 2)
    rank_results: list[dict[str, Any]] = []
    if spec.world_size > 1:
        rank_results = gather_peaks(
            {
                "rank": dist.get_rank(),
                "measured_peak_bytes": steady,
                "tracked_peak_bytes": ledger.peak_bytes,
                "at_peak": {c.value: b for c, b in ledger.at_peak.items()},
            }
        )
    return Measurement(
        ledger=ledger,
        device=device,
        measured_peak_bytes=steady,
        measured_first_step_peak_bytes=peaks[1],
        measured_step_peaks=peaks,
        method=f"{method}, {PLAIN_RUN}",
        measured_run=PLAIN_RUN,
        ledger_run=TRACKED_RUN,
        estimate=estimate,
        ranks=rank_results,
    )


def _check(spec: TrainingSpec, device: str, compare: bool) -> None:
    """Refuse, in one line, what cannot be measured here."""
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


def _runs(spec: TrainingSpec, device: str) -> tuple[Ledger, dict[int, int], str]:
    """The plain run's allocator peaks per step and the tracked run's ledger, and how the
    peaks were counted."""
    if (spec.world_size > 1 and spec.pp > 1) or spec.parallelism.is_deepspeed:
        # the pipeline's schedule and DeepSpeed's engine (on one process too) own their step:
        # run by their modules (a plain run counted, then a tracked run for the ledger)
        run = measure_pipeline(spec, device) if spec.pp > 1 else measure_deepspeed(spec, device)
        method = COUNTED if device == "cpu" else "torch.cuda.max_memory_allocated() per step"
        return run.ledger, run.counted_step_peaks, method
    if device == "cpu" and spec.world_size > 1:
        # gloo frees on its own threads, which the profiler misses: count every thread
        peaks = _plain_counted(spec)
        return _tracked(spec, "cpu")[0], peaks, COUNTED
    if device == "cpu":
        # The tracked run first: the libraries the step imports lazily (bitsandbytes, peft) and
        # the tables they cache on first use (bitsandbytes' CPU quantization bounds) are then the
        # process's, made before the count starts, as in a program that imports at the top;
        # counted only when this was the first such run in the process, they made the plain
        # run's peak depend on what ran before it (396 B on a 37 KB model, 1 %).
        ledger, _ = _tracked(spec, device)
        gc.collect()
        with recording() as prof:
            steps = _plain(spec, device)
        method = "torch.profiler memory events (profile_memory=True) per step"
        return ledger, _profiler_step_peaks(prof, steps), method
    peaks = _plain_cuda(spec)
    return _tracked(spec, "cuda")[0], peaks, "torch.cuda.max_memory_allocated() per step"


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
    if spec.precision.endswith("-mixed") and spec.parallelism.is_zero_redundancy:
        raise InputError(
            "measuring zero1-torch with master weights is not supported", hint="use fsdp, or fp32"
        )


def gather_peaks(value: dict[str, Any]) -> list[dict[str, Any]]:
    """Every rank's result, on every rank (rank 0 reports them)."""
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


EAGER_TORCHAO = Note(
    Topic.KERNELS,
    "torchao's compiled optimizer step ran eagerly under the tracker (same arithmetic)",
)

PLAIN_RUN = "counted in a plain run (no dispatch mode, no tensor subclass active during the step)"
TRACKED_RUN = Note(
    Topic.MEASUREMENT,
    "categories from a separate tracked run of the same step (StorageTracker, a "
    "TorchDispatchMode; autograd's out-of-place branches folded back as trace/core/plain_autograd.py "
    "models them)",
)


def _with_seconds(ledger: Ledger, seconds: float) -> Ledger:
    return replace(ledger, seconds=seconds)


def _build(spec: TrainingSpec, device: str) -> tuple[Any, Any, Any, Any]:
    """Model (wrapped for its ranks), batch, recipe and counts, as every run builds them."""
    torch.manual_seed(spec.seed)
    recipe = adapt_recipe(resolve(spec))
    torch_device = torch.device(device)
    model = recipe.build_model(torch_device)
    counts = count_parameters(model)
    if spec.world_size > 1:
        model = wrap_real(model, spec, recipe.precision.name)
    return recipe, model, counts, torch_device


def _plain(spec: TrainingSpec, device: str, per_step: Any = None) -> int:
    """The step with nothing of vramledger's active while it runs: no dispatch mode, no tensor
    subclass, no tracker (vramledger's own loop, ``TrainingRun.step``, with a null observer).
    ``per_step(step, 'start'|'end')`` reads the allocator around each step. Everything it
    made is dropped before it returns."""
    with record_function("vramledger.setup"):
        recipe, model, _, torch_device = _build(spec, device)
        batch = recipe.make_batch(torch_device)
        observer = NullObserver()
        run = _assemble(spec, recipe, model, batch, torch_device, observer)
    _steps(run, observer, spec.steps, per_step)
    del run, model, batch
    gc.collect()
    return spec.steps


def _assemble(
    spec: TrainingSpec, recipe: Any, model: Any, batch: Any, device: torch.device, observer: Any
) -> Any:
    """``training.py``'s step over the built model (the plain and the tracked run alike)."""
    run = assemble(
        model=model,
        batch=batch,
        loss_fn=recipe.loss_fn,
        optimizer=real_optimizer(recipe.optimizer, spec),
        precision=recipe.precision,
        device=device,
        grad_accum=spec.grad_accum,
        observer=observer,
    )
    return in_step_context(run, model)


def _steps(run: Any, observer: Any, steps: int, per_step: Any = None) -> None:
    """Run the steps, each inside its profiler label, ``per_step(step, 'start'|'end')`` around."""
    for step in range(1, steps + 1):
        if per_step is not None:
            per_step(step, "start")
        with record_function(_STEP_LABEL.format(step)):
            run.step(step, observer)
        if per_step is not None:
            per_step(step, "end")


def _tracked(spec: TrainingSpec, device: str, per_step: Any = None) -> tuple[Ledger, int]:
    """The same step under the storage tracker: the ledger's categories, phases and modules."""
    policy = policy_for(device)
    with record_function("vramledger.setup"):
        recipe, model, (parameters, trainable), torch_device = _build(spec, device)
        tracker = StorageTracker(module_names=module_names(model), device_type=torch_device.type)
        observer = TrackerObserver(tracker)
        # Made before tracking, as in a trace: what the inputs function allocates on the way is
        # not part of the step.
        batch = recipe.make_batch(torch_device)
        with tracker:
            run = _assemble(spec, recipe, model, batch, torch_device, observer)
    notes: list[str] = [MEASURED, TRACKED_RUN]
    # The tracker is a dispatch mode, under which torch.compile cannot run: torchao's compiled
    # optimizer step runs eagerly (same arithmetic; the eager step's temporaries).
    eager = recipe.optimizer.package == "torchao"
    if eager:
        notes.append(EAGER_TORCHAO)
    with tracker, torch.compiler.set_stance("force_eager" if eager else "default"):
        _steps(run, observer, spec.steps, per_step)
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


_run = _tracked
"""The tracked run under its former name (tests compare its timeline with a fake trace's)."""


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


def _plain_counted(spec: TrainingSpec) -> dict[int, int]:
    """A plain CPU run counted by the allocator wrapper (``cpu_allocator_count``), step by
    step, from before the model is built."""
    cpu_allocator_count.install()
    base = cpu_allocator_count.live()
    peaks: dict[int, int] = {}

    def per_step(step: int, when: str) -> None:
        if when == "start":
            cpu_allocator_count.reset_peak()
        else:
            peaks[step] = cpu_allocator_count.peak() - base

    _plain(spec, "cpu", per_step)
    return peaks


def _plain_cuda(spec: TrainingSpec) -> dict[int, int]:
    """A plain CUDA run: ``max_memory_allocated`` of each step, after resetting the peak to
    what is allocated when it starts."""
    peaks: dict[int, int] = {}

    def per_step(step: int, when: str) -> None:
        torch.cuda.synchronize()
        if when == "start":
            torch.cuda.reset_peak_memory_stats()
        else:
            peaks[step] = torch.cuda.max_memory_allocated()

    _plain(spec, "cuda", per_step)
    return peaks


__all__ = ["Measurement", "Phase", "measure"]
