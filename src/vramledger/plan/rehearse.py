"""``rehearse``: the source documents' memory rehearsal.

Build scaled-down copies of the model (fewer identical blocks), run real training steps of each
on the hardware at hand while measuring memory (``measure``), fit each category's growth with
the number of blocks (a straight line: parameters, gradients, optimizer state and activations
all grow by one block's worth per block), and extrapolate to the full model. The extrapolation
is reported beside the full fake-tensor estimate, together with the residual the real runs
showed beyond tensors (allocator overhead, kernel workspaces), which ``plan`` can fold into its
margin. Copies are made shallower, never narrower: width changes the shapes kernels see.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from ..categories import Category
from ..errors import InputError
from ..measure import measure
from ..predict import estimate
from ..recipe import resolve
from ..spec import TrainingSpec
from ..trace.blocks import config_depth, shallow_config

Progress = Callable[[str, int, int], None]


@dataclass(frozen=True, kw_only=True)
class Fit:
    slope: float
    intercept: float

    def at(self, x: float) -> int:
        return round(self.intercept + self.slope * x)


def fit_line(xs: Sequence[float], ys: Sequence[float]) -> Fit:
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var if var else 0.0
    return Fit(slope=slope, intercept=my - slope * mx)


@dataclass(frozen=True, kw_only=True)
class Rehearsal:
    depths: list[int]
    full_depth: int
    device: str
    measured_peaks: list[int]
    """The allocator's peak of each rehearsal (profiler on CPU, max_memory_allocated on CUDA)."""
    tracked_at_peak: list[dict[str, int]]
    extrapolated_peak_bytes: int
    extrapolated_at_peak: dict[str, int]
    estimate_peak_bytes: int
    """The full model's fake-tensor estimate for the same device."""
    residual_bytes: int
    """Largest (measured - tracked) of the rehearsals: memory beyond tensors."""
    fits: dict[str, Fit] = field(default_factory=dict)
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "depths": self.depths,
            "full_depth": self.full_depth,
            "device": self.device,
            "measured_peaks": self.measured_peaks,
            "tracked_at_peak": self.tracked_at_peak,
            "extrapolated_peak_bytes": self.extrapolated_peak_bytes,
            "extrapolated_at_peak": self.extrapolated_at_peak,
            "estimate_peak_bytes": self.estimate_peak_bytes,
            "extrapolation_vs_estimate": (self.extrapolated_peak_bytes - self.estimate_peak_bytes)
            / self.estimate_peak_bytes,
            "residual_bytes": self.residual_bytes,
            "fits": {
                k: {"slope_bytes_per_block": f.slope, "intercept_bytes": f.intercept}
                for k, f in self.fits.items()
            },
            "seconds": round(self.seconds, 2),
        }


def rehearse(
    spec: TrainingSpec,
    *,
    depths: Sequence[int] = (1, 2, 3),
    device: str = "cpu",
    progress: Progress | None = None,
) -> Rehearsal:
    start = time.perf_counter()
    config = resolve(spec).source.config
    full = config_depth(config)
    if full is None:
        raise InputError(
            "rehearse needs a Hugging Face config with a layer count",
            hint="give a config.json of a decoder or encoder model",
        )
    depths = sorted(set(depths))
    if len(depths) < 2 or depths[-1] >= full:
        raise InputError(
            f"rehearse needs at least two depths below the model's {full} layers, not {depths}"
        )
    peaks, tracked = [], []
    for i, depth in enumerate(depths):
        small = replace(spec, model=shallow_config(config, depth, full), target=device)
        m = measure(small, device=device)
        peaks.append(m.measured_peak_bytes)
        tracked.append({c.value: b for c, b in m.ledger.at_peak.items()})
        if progress is not None:
            progress("rehearsals", i + 1, len(depths))
    total_fit = fit_line(depths, peaks)
    fits = {"total": total_fit}
    at_peak = {}
    for category in Category:
        values = [t.get(category.value, 0) for t in tracked]
        if any(values):
            fits[category.value] = fit_line(depths, values)
            at_peak[category.value] = fits[category.value].at(full)
    residual = max(p - sum(t.values()) for p, t in zip(peaks, tracked, strict=True))
    full_estimate = estimate(replace(spec, target=device))
    return Rehearsal(
        depths=list(depths),
        full_depth=full,
        device=device,
        measured_peaks=peaks,
        tracked_at_peak=tracked,
        extrapolated_peak_bytes=total_fit.at(full),
        extrapolated_at_peak=at_peak,
        estimate_peak_bytes=full_estimate.allocated_peak_bytes,
        residual_bytes=max(0, residual),
        fits=fits,
        seconds=time.perf_counter() - start,
    )
