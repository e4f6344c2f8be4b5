"""Plots (matplotlib, Agg backend): drawn from the library's data, written to a file."""

from __future__ import annotations

from pathlib import Path

from vramledger.inputs.errors import InputError
from vramledger.inputs.units import MIB
from vramledger.measure.compare import Comparison, smooth
from vramledger.plan.rehearse import Rehearsal


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise InputError("plots need matplotlib", hint="pip install 'vramledger[report]'") from exc
    return plt


def comparison_plot(comparison: Comparison, path: str | Path) -> Path:
    """Loss curves (smoothed, raw faint) beside the memory of each optimizer."""
    plt = _pyplot()
    fig, (curves, bars) = plt.subplots(
        1, 2, figsize=(12, 4.5), gridspec_kw={"width_ratios": [3, 2]}
    )
    for run in comparison.runs:
        steps = range(1, len(run.losses) + 1)
        (line,) = curves.plot(steps, smooth(run.losses), label=run.optimizer)
        curves.plot(steps, run.losses, color=line.get_color(), alpha=0.15, linewidth=0.8)
    curves.set_xlabel("step")
    curves.set_ylabel("training loss")
    curves.set_title(f"loss (EMA), reference {comparison.reference}")
    curves.legend()
    names = [r.optimizer for r in comparison.runs]
    xs = range(len(names))
    peak = [r.peak_bytes / MIB for r in comparison.runs]
    state = [r.optimizer_state_bytes / MIB for r in comparison.runs]
    bars.bar([x - 0.2 for x in xs], peak, width=0.4, label="peak of a step")
    bars.bar([x + 0.2 for x in xs], state, width=0.4, label="optimizer state")
    bars.set_xticks(list(xs), names, rotation=20, ha="right")
    bars.set_ylabel("MiB")
    bars.set_title(f"memory ({comparison.device})")
    bars.legend()
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def rehearsal_plot(rehearsal: Rehearsal, path: str | Path) -> Path:
    """Measured points of each rehearsal and the fitted lines out to the full depth."""
    plt = _pyplot()
    fig, (near, far) = plt.subplots(1, 2, figsize=(12, 4.5))
    full = rehearsal.full_depth
    widths = rehearsal.widths or [1.0] * len(rehearsal.depths)
    right = max(rehearsal.depths) + 1
    for name, fit in rehearsal.fits.items():
        if name == "total":
            ys = rehearsal.phase_totals
        else:
            ys = [t.get(name, 0) for t in rehearsal.tracked_at_peak]
        (line,) = far.plot(
            [0, full], [fit.at(0) / MIB, fit.at(full) / MIB], linewidth=0.9, label=name
        )
        # Near: each rehearsal width's points and its fitted line (the full width dashed).
        for width in sorted(set(widths)):
            xs = [d for d, w in zip(rehearsal.depths, widths, strict=True) if w == width]
            near.scatter(
                xs,
                [y / MIB for y, w in zip(ys, widths, strict=True) if w == width],
                color=line.get_color(),
                s=14,
            )
            near.plot(
                [0, right],
                [fit.at(0, width) / MIB, fit.at(right, width) / MIB],
                linewidth=0.9,
                color=line.get_color(),
            )
        if rehearsal.narrowed:
            near.plot(
                [0, right],
                [fit.at(0) / MIB, fit.at(right) / MIB],
                linewidth=0.9,
                linestyle="--",
                color=line.get_color(),
            )
    far.scatter(
        [full],
        [rehearsal.estimate_peak_bytes / MIB],
        marker="*",
        s=120,
        color="black",
        label="fake-tensor estimate",
        zorder=3,
    )
    near.set_title(
        f"rehearsals on {rehearsal.device}: {rehearsal.peak_phase} peak (points), fits"
        + (" per width (full width dashed)" if rehearsal.narrowed else "")
    )
    far.set_title(f"extrapolated to {full} layers")
    for axes in (near, far):
        axes.set_xlabel("layers")
        axes.set_ylabel("MiB at the peak")
    far.legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
