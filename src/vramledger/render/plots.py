"""Plots (matplotlib, Agg backend): drawn from the library's data, written to a file."""

from __future__ import annotations

from pathlib import Path

from ..compare import Comparison, smooth
from ..errors import InputError
from ..units import MIB


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
