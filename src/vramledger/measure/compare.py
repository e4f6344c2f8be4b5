"""``compare``: before trusting a memory-light optimizer, train with it and with the reference.

The source documents' advice: an 8-bit optimizer roughly halves or quarters the optimizer line,
but train both versions for some hundred steps and compare the loss curves first. ``compare``
trains the same model from the same initial weights on the same batches with each optimizer (on
CUDA when present, else CPU), and reports per optimizer the measured peak memory and optimizer
state, the loss curve, the final-loss gap and the largest gap along the way relative to the
first (reference) optimizer, and a verdict against ``tolerance``.

Losses are compared after smoothing with an exponential moving average (``EMA_ALPHA``); the
final loss is the mean of the last ``FINAL_WINDOW`` fraction of steps; the largest gap is taken
after the first ``WARMUP`` fraction of steps (early steps differ wildly for any two optimizers).
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from vramledger.inputs.categories import Category
from vramledger.inputs.errors import InputError
from vramledger.inputs.notes import Note, Topic, records
from vramledger.inputs.optimizers import resolve_optimizer
from vramledger.inputs.recipe import resolve
from vramledger.inputs.sources import BatchShape, load_callable
from vramledger.inputs.spec import TrainingSpec
from vramledger.inputs.training import NullObserver, assemble, optimizer_state_tensors
from vramledger.ledger.replay import replay, steady_peak
from vramledger.trace.core.tracker import StorageTracker, TrackerObserver, storages_of

EMA_ALPHA = 0.05
"""Weight of the newest loss in the smoothed curve."""
FINAL_WINDOW = 0.1
"""The final loss is the mean of the last 10 % of steps (at least one)."""
WARMUP = 0.1
"""The largest gap along the way ignores the first 10 % of steps."""
CPU_TRACKED_STEPS = 3
"""On CPU, memory is tracked over the first steps (the steady state starts at step 2)."""

Progress = Callable[[str, int, int], None]
OptimizerEntry = str | tuple[str, dict[str, Any]]


@dataclass(frozen=True, kw_only=True)
class OptimizerRun:
    optimizer: str
    kwargs: dict[str, Any]
    losses: list[float]
    peak_bytes: int
    """Measured peak of a training step: ``max_memory_allocated`` on CUDA; on CPU the tracked
    tensor bytes of the steady-state steps among the first ``CPU_TRACKED_STEPS``."""
    optimizer_state_bytes: int
    parameters: int
    final_loss: float
    final_gap: float | None = None
    """(final loss - reference final loss) / reference final loss."""
    max_gap: float | None = None
    """Largest |smoothed loss - smoothed reference| / smoothed reference after warm-up."""
    verdict: str = "reference"
    seconds: float = 0.0

    @property
    def optimizer_state_bytes_per_param(self) -> float:
        return self.optimizer_state_bytes / self.parameters if self.parameters else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "optimizer": self.optimizer,
            "kwargs": {
                k: v for k, v in self.kwargs.items() if isinstance(v, (int, float, str, bool))
            },
            "peak_bytes": self.peak_bytes,
            "optimizer_state_bytes": self.optimizer_state_bytes,
            "optimizer_state_bytes_per_param": round(self.optimizer_state_bytes_per_param, 4),
            "final_loss": self.final_loss,
            "final_gap": self.final_gap,
            "max_gap": self.max_gap,
            "verdict": self.verdict,
            "seconds": round(self.seconds, 2),
            "losses": self.losses,
        }


@dataclass(frozen=True, kw_only=True)
class Comparison:
    reference: str
    """The optimizer the others are compared with (the first one given)."""
    runs: list[OptimizerRun]
    """One run per optimizer, the reference first."""
    steps: int
    tolerance: float
    """Largest relative final-loss gap that still ``matches`` (:func:`verdict`)."""
    device: str
    memory_method: str
    """How ``peak_bytes`` was measured on this device."""
    notes: list[str] = field(default_factory=list)
    spec: dict[str, Any] = field(default_factory=dict)
    """The spec's summary (``TrainingSpec.summary``)."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "reference": self.reference,
            "steps": self.steps,
            "tolerance": self.tolerance,
            "device": self.device,
            "memory_method": self.memory_method,
            "runs": [r.to_dict() for r in self.runs],
            "notes": self.notes,
            "note_records": records(self.notes),
            "spec": self.spec,
        }


def smooth(values: Sequence[float], alpha: float = EMA_ALPHA) -> list[float]:
    out: list[float] = []
    for v in values:
        out.append(v if not out else alpha * v + (1 - alpha) * out[-1])
    return out


def final_loss(losses: Sequence[float]) -> float:
    n = max(1, int(len(losses) * FINAL_WINDOW))
    return sum(losses[-n:]) / n


def gaps(losses: Sequence[float], reference: Sequence[float]) -> tuple[float, float]:
    """(final gap, largest gap after warm-up), both relative to the reference."""
    ref_final = final_loss(reference)
    final = (final_loss(losses) - ref_final) / abs(ref_final)
    a, b = smooth(losses), smooth(reference)
    start = int(len(a) * WARMUP)
    largest = max(
        (abs(x - y) / abs(y) for x, y in zip(a[start:], b[start:], strict=True)), default=0.0
    )
    return final, largest


def verdict(final_gap: float, tolerance: float) -> str:
    """'matches' when the final loss is within ``tolerance`` of the reference, else 'worse' or
    'better'."""
    if final_gap > tolerance:
        return "worse"
    if final_gap < -tolerance:
        return "better"
    return "matches"


def parse_entry(text: str) -> tuple[str, dict[str, Any]]:
    """``name`` or ``name@LR`` (the learning rate for that optimizer)."""
    name, _, lr = text.strip().partition("@")
    if not lr:
        return name, {}
    try:
        return name, {"lr": float(lr)}
    except ValueError as exc:
        raise InputError(
            f"cannot read the learning rate in {text!r}", hint="write it like sgd-momentum@0.05"
        ) from exc


def compare(
    spec: TrainingSpec,
    optimizers: Sequence[OptimizerEntry],
    *,
    steps: int = 500,
    data: Any = None,
    tolerance: float = 0.05,
    device: str | None = None,
    eager_optimizer_on_cpu: bool = True,
    progress: Progress | None = None,
) -> Comparison:
    """Train ``spec``'s model with each optimizer (the first is the reference) and compare."""
    if len(optimizers) < 2:
        raise InputError(
            "compare needs at least two optimizers", hint="e.g. --optimizers adamw,adamw8bit"
        )
    if steps < 2:
        raise InputError(f"steps must be at least 2, not {steps}")
    if not 0 < tolerance < 1:
        raise InputError(f"tolerance must be between 0 and 1, not {tolerance}")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise InputError("no CUDA GPU here", hint="compare on cpu")
    entries = [parse_entry(e) if isinstance(e, str) else e for e in optimizers]
    recipe = resolve(spec)
    torch_device = torch.device(device)
    torch.manual_seed(spec.seed)
    initial = {
        k: v.detach().clone() for k, v in recipe.build_model(torch_device).state_dict().items()
    }
    next_batch = _batches(data, recipe, torch_device, spec)
    notes: list[str] = []
    runs: list[OptimizerRun] = []
    for name, kwargs in entries:
        choice = resolve_optimizer(name, {**spec.optimizer_kwargs, **kwargs})
        eager = device == "cpu" and eager_optimizer_on_cpu and choice.package == "torchao"
        if eager:
            notes.append(
                Note(
                    Topic.KERNELS,
                    f"{name}: torchao's compiled step ran eagerly on CPU (same arithmetic)",
                )
            )
        stance = torch.compiler.set_stance("force_eager" if eager else "default")
        with stance:
            runs.append(
                _train(
                    recipe,
                    replace(choice, name=name),
                    initial,
                    next_batch,
                    steps,
                    torch_device,
                    progress,
                )
            )
    reference = runs[0]
    compared = [reference]
    for run in runs[1:]:
        final_gap, max_gap = gaps(run.losses, reference.losses)
        compared.append(
            replace(
                run, final_gap=final_gap, max_gap=max_gap, verdict=verdict(final_gap, tolerance)
            )
        )
    method = (
        "torch.cuda.max_memory_allocated() over the run"
        if device == "cuda"
        else f"tracked tensor bytes of steps 2..{CPU_TRACKED_STEPS}"
    )
    return Comparison(
        reference=reference.optimizer,
        runs=compared,
        steps=steps,
        tolerance=tolerance,
        device=device,
        memory_method=method,
        notes=notes,
        spec=spec.summary(),
    )


def _batches(
    data: Any, recipe: Any, device: torch.device, spec: TrainingSpec
) -> Callable[[int], Any]:
    """The batch of each step: the user's data function, or seeded synthetic batches."""
    shape = BatchShape(batch_size=spec.batch_size, seq_len=spec.seq_len, image_size=spec.image_size)
    if data is None:

        def synthetic(step: int) -> Any:
            torch.manual_seed(spec.seed * 1_000_003 + step)
            return recipe.make_inputs(device, shape)

        return synthetic
    fn = load_callable(data, "data function") if isinstance(data, str) else data
    params = inspect.signature(fn).parameters
    given = {
        "device": device,
        "batch_size": shape.batch_size,
        "seq_len": shape.seq_len,
        "step": None,
    }

    def user(step: int) -> Any:
        kwargs = {k: (step if k == "step" else v) for k, v in given.items() if k in params}
        try:
            return fn(**kwargs)
        except Exception as exc:
            raise InputError(f"the data function raised {type(exc).__name__}: {exc}") from exc

    return user


def _train(recipe, choice, initial, next_batch, steps, device, progress) -> OptimizerRun:
    model = recipe.build_model(device)
    model.load_state_dict(initial)
    parameters = sum(p.numel() for p in model.parameters())
    start = time.perf_counter()
    tracked = device.type == "cpu"
    tracker = StorageTracker(device_type=device.type) if tracked else None
    observer = TrackerObserver(tracker) if tracker is not None else NullObserver()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    if tracker is not None:
        tracker.__enter__()
    try:
        run = assemble(
            model=model,
            batch=next_batch(1),
            loss_fn=recipe.loss_fn,
            optimizer=choice,
            precision=recipe.precision,
            device=device,
            grad_accum=recipe.spec.grad_accum,
            observer=observer,
        )
        run.record_losses = True
        for step in range(1, steps + 1):
            if step > 1:
                run.batch = next_batch(step)
            run.step(step, observer)
            if tracker is not None and step == CPU_TRACKED_STEPS:
                tracker.__exit__(None, None, None)
                timeline, tracker, observer = tracker.close(), None, NullObserver()
            if progress is not None:
                progress(choice.name, step, steps)
    finally:
        if tracker is not None:
            tracker.__exit__(None, None, None)
            timeline = tracker.close()
    if device.type == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
    else:
        peak = _tracked_peak(timeline)
    state = {
        st.data_ptr(): st.nbytes()
        for t in optimizer_state_tensors(run.optimizer)
        for st in storages_of(t)
    }
    return OptimizerRun(
        optimizer=choice.name,
        kwargs=choice.kwargs,
        losses=run.losses,
        peak_bytes=peak,
        optimizer_state_bytes=sum(state.values()),
        parameters=parameters,
        final_loss=final_loss(run.losses),
        seconds=time.perf_counter() - start,
    )


def _tracked_peak(timeline: Any) -> int:
    return steady_peak(replay(timeline)).total if timeline.steps >= 2 else 0


__all__ = ["Category", "Comparison", "OptimizerRun", "compare"]
