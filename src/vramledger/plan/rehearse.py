"""``rehearse``: the source documents' memory rehearsal.

Build scaled-down copies of the model — fewer identical blocks and, where the user allows
(``widths``), narrower ones (``narrow.py``) — run real training steps of each on the hardware at
hand while measuring memory (``measure``), fit each category's growth, and extrapolate to the
full model. In the depth every category grows by one block's worth per block (a straight line);
in the width fraction each block's bytes and the rest are polynomials of degree at most two
(weights grow as width × width, activations as the width), so the fit is a line in the depth
whose slope and intercept are quadratics in the width. The extrapolation is reported beside the
full fake-tensor estimate, together with the residual the real runs showed beyond tensors
(allocator overhead, kernel workspaces), which ``plan`` can fold into its margin.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from vramledger.inputs.categories import STEP_PHASES, Category, Phase
from vramledger.inputs.config_depth import config_depth, shallow_config
from vramledger.inputs.errors import InputError
from vramledger.inputs.recipe import resolve
from vramledger.inputs.spec import TrainingSpec
from vramledger.ledger.replay import breakdown_at, replay, steady_phase_point
from vramledger.measure import measure
from vramledger.plan.narrow import narrow_config
from vramledger.predict.step import estimate
from vramledger.record.timeline import Timeline

Progress = Callable[[str, int, int], None]


BASIS: dict[str, Callable[[float, float], float]] = {
    "1": lambda d, w: 1.0,
    "w": lambda d, w: w,
    "w^2": lambda d, w: w * w,
    "d": lambda d, w: d,
    "d*w": lambda d, w: d * w,
    "d*w^2": lambda d, w: d * w * w,
}
"""Terms of the fit in the depth ``d`` (blocks) and the width fraction ``w``."""
DEPTH_TERMS = ("1", "d")
WIDTH_TERMS = tuple(BASIS)


@dataclass(frozen=True, kw_only=True)
class Fit:
    """Least-squares fit of bytes over rehearsals: coefficient of each term of ``BASIS``."""

    coefficients: dict[str, float]

    def value(self, depth: float, width: float = 1.0) -> float:
        return sum(c * BASIS[t](depth, width) for t, c in self.coefficients.items())

    def at(self, depth: float, width: float = 1.0) -> int:
        return round(self.value(depth, width))

    @property
    def slope(self) -> float:
        """Bytes per block at the full width."""
        return self.value(1) - self.value(0)

    @property
    def intercept(self) -> float:
        """Bytes outside the blocks at the full width."""
        return self.value(0)


def fit(points: Sequence[tuple[float, float]], ys: Sequence[float], terms: Sequence[str]) -> Fit:
    """Least squares of ``ys`` over the terms at (depth, width) ``points``."""
    a = torch.tensor([[BASIS[t](d, w) for t in terms] for d, w in points], dtype=torch.float64)
    b = torch.tensor([[float(y)] for y in ys], dtype=torch.float64)
    solution = torch.linalg.lstsq(a, b, driver="gelsd").solution
    return Fit(coefficients={t: float(c) for t, c in zip(terms, solution[:, 0], strict=True)})


def phase_breakdown(tl: Timeline, phase: Phase) -> tuple[int, dict[str, int]]:
    """Device bytes by category at the largest total of ``phase`` in the steady-state steps."""
    point = steady_phase_point(replay(tl), phase)
    if point is None:
        return -1, {}
    total, event = point
    return total, {c.value: b for c, b in breakdown_at(tl, event).items() if b}


@dataclass(frozen=True, kw_only=True)
class Rehearsal:
    depths: list[int]
    """Depth of each rehearsal (blocks)."""
    full_depth: int
    device: str
    measured_peaks: list[int]
    """The allocator's peak of each rehearsal (profiler on CPU, max_memory_allocated on CUDA)."""
    tracked_peaks: list[int]
    """Tensors the tracker saw at each rehearsal's peak (measured - tracked = beyond tensors)."""
    peak_phase: str
    """The phase whose fitted peak is largest for the full model (where the full model peaks)."""
    phase_totals: list[int]
    """Tracked bytes at that phase's peak in each rehearsal (the points the total is fitted to)."""
    tracked_at_peak: list[dict[str, int]]
    """Tracked bytes by category at that phase's peak in each rehearsal."""
    extrapolated_peak_bytes: int
    extrapolated_at_peak: dict[str, int]
    estimate_peak_bytes: int
    """The full model's fake-tensor estimate for the same device."""
    residual_bytes: int
    """Largest (measured - tracked) of the rehearsals: memory beyond tensors."""
    fits: dict[str, Fit] = field(default_factory=dict)
    phase_fits: dict[str, Fit] = field(default_factory=dict)
    widths: list[float] = field(default_factory=list)
    """Width fraction of each rehearsal (all 1.0 unless narrower copies were allowed)."""
    seconds: float = 0.0

    @property
    def narrowed(self) -> bool:
        return any(w != 1.0 for w in self.widths)

    def to_dict(self) -> dict[str, Any]:
        def lines(fits: dict[str, Fit]) -> dict[str, dict[str, Any]]:
            return {
                k: {
                    "slope_bytes_per_block": f.slope,
                    "intercept_bytes": f.intercept,
                    "coefficients": f.coefficients,
                }
                for k, f in fits.items()
            }

        return {
            "depths": self.depths,
            "widths": self.widths,
            "full_depth": self.full_depth,
            "device": self.device,
            "measured_peaks": self.measured_peaks,
            "tracked_peaks": self.tracked_peaks,
            "peak_phase": self.peak_phase,
            "phase_totals": self.phase_totals,
            "tracked_at_peak": self.tracked_at_peak,
            "extrapolated_peak_bytes": self.extrapolated_peak_bytes,
            "extrapolated_at_peak": self.extrapolated_at_peak,
            "estimate_peak_bytes": self.estimate_peak_bytes,
            "extrapolation_vs_estimate": (self.extrapolated_peak_bytes - self.estimate_peak_bytes)
            / self.estimate_peak_bytes,
            "residual_bytes": self.residual_bytes,
            "fits": lines(self.fits),
            "phase_fits": lines(self.phase_fits),
            "seconds": round(self.seconds, 2),
        }


MIN_WIDTHS = 3
"""Distinct widths a narrow rehearsal needs: the fit is quadratic in the width."""


def _rehearsed_sizes(
    depths: Sequence[int], widths: Sequence[float] | None, full: int
) -> tuple[list[int], list[float]]:
    """The depths and width fractions to rehearse (sorted, each once; no widths: the full
    width), refused unless they can be fitted and extrapolated to the ``full`` depth."""
    depths = sorted(set(depths))
    if len(depths) < 2 or depths[0] < 1 or depths[-1] >= full:
        raise InputError(
            f"rehearse needs at least two depths from 1 to below the model's {full} layers, "
            f"not {depths}",
            hint="--depths 1,2,3",
        )
    fractions = sorted(set(widths)) if widths else [1.0]
    if widths and len(fractions) < MIN_WIDTHS:
        raise InputError(
            f"narrower rehearsals need at least {MIN_WIDTHS} widths (the fit is quadratic in "
            f"the width), not {fractions}",
            hint="--widths 0.25,0.5,0.75",
        )
    return depths, fractions


def rehearse(
    spec: TrainingSpec,
    *,
    depths: Sequence[int] = (1, 2, 3),
    widths: Sequence[float] | None = None,
    device: str = "cpu",
    progress: Progress | None = None,
) -> Rehearsal:
    """Measure scaled-down copies (every depth at every width, when ``widths`` allows narrower
    ones), fit each phase's peak and each category at the peak, extrapolate. Phases are fitted
    apart because the phase that peaks moves with depth (the optimizer step for one layer, the
    backward pass for many)."""
    start = time.perf_counter()
    config = resolve(spec).source.config
    full = config_depth(config)
    if full is None:
        raise InputError(
            "rehearse needs a Hugging Face config with a layer count",
            hint="give a config.json of a decoder or encoder model",
        )
    depths, fractions = _rehearsed_sizes(depths, widths, full)
    copies = [
        (depth, width, narrow_config(config, width) if width != 1.0 else config)
        for width in fractions
        for depth in depths
    ]
    runs: list[tuple[int, float]] = []
    measured, timelines, tracked_peaks = [], [], []
    for i, (depth, width, scaled) in enumerate(copies):
        small = replace(spec, model=shallow_config(scaled, depth, full), target=device)
        m = measure(small, device=device)
        runs.append((depth, width))
        measured.append(m.measured_peak_bytes)
        tracked_peaks.append(m.ledger.peak_bytes)
        assert m.ledger.timeline is not None
        timelines.append(m.ledger.timeline)
        if progress is not None:
            progress("rehearsals", i + 1, len(copies))
    terms = WIDTH_TERMS if widths else DEPTH_TERMS
    phases = [p for p in STEP_PHASES if all(p in _phases(tl) for tl in timelines)]
    breakdowns = {p: [phase_breakdown(tl, p) for tl in timelines] for p in phases}
    phase_fits = {p.value: fit(runs, [b[0] for b in breakdowns[p]], terms) for p in phases}
    peak_phase = max(phases, key=lambda p: phase_fits[p.value].at(full))
    totals = [b[0] for b in breakdowns[peak_phase]]
    at_phase = [b[1] for b in breakdowns[peak_phase]]
    fits = {"total": phase_fits[peak_phase.value]}
    at_peak = {}
    for category in Category:
        values = [t.get(category.value, 0) for t in at_phase]
        if any(values):
            fits[category.value] = fit(runs, values, terms)
            at_peak[category.value] = fits[category.value].at(full)
    residual = max(0, *(p - t for p, t in zip(measured, tracked_peaks, strict=True)))
    full_estimate = estimate(replace(spec, target=device))
    return Rehearsal(
        depths=[d for d, _ in runs],
        widths=[w for _, w in runs],
        full_depth=full,
        device=device,
        measured_peaks=measured,
        tracked_peaks=tracked_peaks,
        peak_phase=peak_phase.value,
        phase_totals=totals,
        tracked_at_peak=at_phase,
        extrapolated_peak_bytes=fits["total"].at(full) + residual,
        extrapolated_at_peak=at_peak,
        estimate_peak_bytes=full_estimate.allocated_peak_bytes,
        residual_bytes=residual,
        fits=fits,
        phase_fits=phase_fits,
        seconds=time.perf_counter() - start,
    )


def _phases(tl: Timeline) -> set[Phase]:
    return {phase for _, step, phase in tl.marks if step >= 2}
