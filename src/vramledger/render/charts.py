"""The SVG charts of the HTML report (``html.py``): the live bytes of the step over time stacked by
category, the bar of the categories at the peak (also drawn by ``serve``'s page), and a plan's
Pareto front. Every chart element carries a ``<title>`` (the browser's tooltip) with its numbers.
"""

from __future__ import annotations

import html
from typing import Any

from vramledger.inputs.categories import CATEGORY_PRIORITY, Category
from vramledger.inputs.units import format_bytes
from vramledger.ledger.ledger import Ledger
from vramledger.ledger.replay import series
from vramledger.plan.candidates import DERIVED
from vramledger.plan.search import Plan

COLOURS = {
    Category.PARAMETERS: "#4e79a7",
    Category.SHARDED_PARAMETERS: "#76a0cf",
    Category.BUFFERS: "#9c755f",
    Category.INPUTS: "#bab0ac",
    Category.MASTER_WEIGHTS: "#59a14f",
    Category.OPTIMIZER_STATE: "#e15759",
    Category.SHARDED_GRADIENTS: "#f1a4a5",
    Category.GRADIENTS: "#f28e2b",
    Category.GRADIENT_BUCKETS: "#ffbe7d",
    Category.ALL_GATHER_BUFFERS: "#b07aa1",
    Category.REDUCE_SCATTER_BUFFERS: "#d4a6c8",
    Category.WORKSPACE: "#79706e",
    Category.PIPELINE_BUFFERS: "#499894",
    Category.ACTIVATIONS: "#edc948",
    Category.COMM_BUFFERS: "#8cd17d",
    Category.TEMPORARIES: "#86bcb6",
}
"""One colour per category (Tableau 10 and its light variants)."""
WIDTH, HEIGHT, PAD = 900, 320, 56
LEFT = 84
"""Room for the byte labels of the vertical axis."""
LABEL_CHAR_WIDTH = 7.0
"""Pixels a character of the chart's 11 px labels can take (system sans-serif is about 6 on
average; this is the widest lower-case letters', so a label given this much room never reaches
its neighbour)."""
PHASE_LABEL_Y = PAD - 6
PEAK_LABEL_Y = PAD - 28
"""Phase names sit in a row just above the plot, the peak's label in a row of its own above
them, so that short phases and the peak never print over each other."""
SHORT_PHASE = {"forward": "fwd", "backward": "bwd", "optimizer": "opt"}
"""What a phase too narrow for its name is labelled; narrower still, only its tooltip names it."""


def escape(text: Any) -> str:
    """``text`` written as HTML text (labels, tooltips, the report's cells)."""
    return html.escape(str(text))


_e = escape


# -- the timeline chart ----------------------------------------------------------------------------
def timeline_svg(ledger: Ledger) -> str:
    """Stacked areas of live device bytes by category over the step, phases marked, the
    steady-state peak pointed at."""
    if ledger.timeline is None:
        return "<p>(no timeline)</p>"
    s = series(ledger.timeline)
    n = len(s.totals)
    top = max(s.totals) or 1
    x = lambda i: LEFT + (WIDTH - LEFT - PAD) * i / max(1, n - 1)  # noqa: E731
    y = lambda b: HEIGHT - PAD - (HEIGHT - 2 * PAD) * b / top  # noqa: E731
    parts = [
        f"<svg id='timeline' xmlns='http://www.w3.org/2000/svg' width='{WIDTH}' height='{HEIGHT}' "
        f"viewBox='0 0 {WIDTH} {HEIGHT}' role='img' aria-label='live memory over the step'>"
    ]
    peak = max(range(n), key=lambda i: s.totals[i] if i >= _steady_start(s) else -1)
    px, py = x(peak), y(s.totals[peak])
    for k, (start, step, phase) in enumerate(s.phases):
        end = s.phases[k + 1][0] if k + 1 < len(s.phases) else n - 1
        if phase.value in ("forward", "backward", "optimizer"):
            fill = {"forward": "#f4f8fb", "backward": "#fbf7f0", "optimizer": "#f3f9f1"}[
                phase.value
            ]
            parts.append(
                f"<rect class='phase' x='{x(start):.1f}' y='{PAD}' width='{max(0.5, x(end) - x(start)):.1f}' "
                f"height='{HEIGHT - 2 * PAD}' fill='{fill}'><title>step {step} {phase.value}</title></rect>"
            )
            label = _phase_label(phase.value, x(start), x(end), px)
            if label is not None:
                lx, text = label
                parts.append(
                    f"<text class='phase-label' x='{lx:.1f}' y='{PHASE_LABEL_Y}'>{_e(text)}"
                    f"<title>step {step} {phase.value}</title></text>"
                )
    base = [0] * n
    for category in CATEGORY_PRIORITY:
        values = s.by_category[category]
        if not any(values):
            continue
        upper = [b + v for b, v in zip(base, values, strict=True)]
        path = " ".join(f"{x(i):.1f},{y(u):.1f}" for i, u in enumerate(upper))
        back = " ".join(f"{x(i):.1f},{y(b):.1f}" for i, b in reversed(list(enumerate(base))))
        parts.append(
            f"<polygon class='category' data-category='{category.value}' points='{path} {back}' "
            f"fill='{COLOURS[category]}'><title>{_e(category.value)}: up to "
            f"{_e(format_bytes(max(values)))}</title></polygon>"
        )
        base = upper
    anchor = "end" if px > WIDTH / 2 else "start"
    tx = px - 6 if anchor == "end" else px + 6
    parts.append(
        f"<g id='peak'><line x1='{px:.1f}' y1='{py:.1f}' x2='{px:.1f}' y2='{PEAK_LABEL_Y - 4}' "
        f"stroke='#b00' stroke-dasharray='3,2'/><circle cx='{px:.1f}' cy='{py:.1f}' r='4' "
        f"fill='#b00'/><text x='{tx:.1f}' y='{PEAK_LABEL_Y}' fill='#b00' text-anchor='{anchor}'>peak "
        f"{_e(format_bytes(ledger.peak_bytes))} ({_e(ledger.peak_phase.value)})</text>"
        f"<title>steady-state peak {format_bytes(ledger.peak_bytes)}</title></g>"
    )
    for frac in (0, 0.5, 1):
        b = int(top * frac)
        parts.append(
            f"<text x='{LEFT - 4}' y='{y(b) + 4:.1f}' text-anchor='end'>{_e(format_bytes(b))}</text>"
        )
    parts.append(
        f"<text x='{WIDTH / 2:.0f}' y='{HEIGHT - PAD + 24}' text-anchor='middle'>allocations and "
        "frees of the traced steps, in order</text></svg>"
    )
    legend = "".join(
        f"<span><span class='swatch' style='background:{COLOURS[c]}'></span>{_e(c.value)}</span> "
        for c in CATEGORY_PRIORITY
        if any(s.by_category[c])
    )
    return "".join(parts) + f"<p>{legend}</p>"


BAR_HEIGHT = 34
BAR_TOP = 30
BAR_BUDGET_SCALE = 4
"""The bar is drawn to the GPU's budget when that is at most this many times its length; a
budget further off is written, not drawn (a tiny model's bar on an 80 GiB GPU would be a
sliver)."""
RESERVE_COLOUR = "#e6e6e6"
"""The bar's last segment: what the allocator reserves beyond the tensors at the peak."""


def category_bar_svg(ledger: Ledger) -> str:
    """One bar: the tensors at the steady-state peak stacked by category (``at_peak``, which
    sums to ``peak_bytes``), then what the allocator reserves beyond them, so that the bar ends
    at ``reserved_peak_bytes``; with a verdict, the GPU's budget (its memory less the margin)
    marked on the same scale."""
    reserve = max(0, ledger.reserved_peak_bytes - ledger.peak_bytes)
    segments = [(c.value, ledger.at_peak[c], COLOURS[c]) for c in CATEGORY_PRIORITY]
    segments = [s for s in segments if s[1] > 0]
    if reserve:
        segments.append(("allocator reserve", reserve, RESERVE_COLOUR))
    total = sum(b for _, b, _ in segments)
    assert total == ledger.peak_bytes + reserve
    budget = ledger.verdict.budget_bytes if ledger.verdict is not None else None
    on_scale = budget is not None and budget <= BAR_BUDGET_SCALE * total
    top = max(total, budget if on_scale else 0) or 1
    span = WIDTH - LEFT - PAD
    x = lambda b: LEFT + span * b / top  # noqa: E731
    height = BAR_TOP + BAR_HEIGHT + 40
    parts = [
        f"<svg id='categories' xmlns='http://www.w3.org/2000/svg' width='{WIDTH}' "
        f"height='{height}' viewBox='0 0 {WIDTH} {height}' role='img' "
        "aria-label='memory at the peak by category'>",
        f"<text x='{LEFT - 6}' y='{BAR_TOP + BAR_HEIGHT / 2 + 4:.1f}' text-anchor='end'>at the "
        "peak</text>",
    ]
    start = 0
    for name, size, colour in segments:
        share = 100 * size / total
        parts.append(
            f"<rect class='segment' data-category='{_e(name)}' data-bytes='{size}' "
            f"x='{x(start):.1f}' y='{BAR_TOP}' width='{max(0.5, x(start + size) - x(start)):.1f}' "
            f"height='{BAR_HEIGHT}' fill='{colour}' stroke='#fff' stroke-width='0.5'>"
            f"<title>{_e(name)}: {_e(format_bytes(size))} ({share:.1f} %)</title></rect>"
        )
        start += size
    parts.append(
        f"<text x='{x(0):.1f}' y='{BAR_TOP + BAR_HEIGHT + 16}'>0</text>"
        f"<text id='bar-total' x='{x(0):.1f}' y='{BAR_TOP - 8}'>"
        f"{_e(format_bytes(ledger.peak_bytes))} of tensors at the peak, "
        f"{_e(format_bytes(ledger.reserved_peak_bytes))} reserved</text>"
    )
    if budget is not None:
        label = f"budget {format_bytes(budget)} ({ledger.verdict.gpu.name} less the margin)"
        if on_scale:
            bx = x(budget)
            anchor = "end" if bx > WIDTH / 2 else "start"
            mark = (
                f"<line x1='{bx:.1f}' x2='{bx:.1f}' y1='{BAR_TOP - 4}' "
                f"y2='{BAR_TOP + BAR_HEIGHT + 4}' stroke='#b00' stroke-width='2' "
                f"stroke-dasharray='4,3'/>"
            )
        else:
            bx, anchor, mark = WIDTH - PAD, "end", ""
            label += f", {budget / total:.0f}× the bar: off its scale"
        parts.append(
            f"<g id='budget'>{mark}<text x='{bx:.1f}' y='{BAR_TOP + BAR_HEIGHT + 30}' "
            f"fill='#b00' text-anchor='{anchor}'>{_e(label)}</text>"
            f"<title>{_e(label)}</title></g>"
        )
    parts.append("</svg>")
    legend = "".join(
        f"<span><span class='swatch' style='background:{colour}'></span>{_e(name)}</span> "
        for name, _, colour in segments
    )
    return "".join(parts) + f"<p>{legend}</p>"


def _phase_label(name: str, left: float, right: float, avoid: float) -> tuple[float, str] | None:
    """Where a phase's name goes (its left edge) and which form: the full name, else its short
    form, whichever fits inside the phase without crossing the peak's line at ``avoid``; None
    when neither does."""
    for text in (name, SHORT_PHASE[name]):
        width = LABEL_CHAR_WIDTH * len(text)
        for lx in (left + 2, avoid + 4):
            clear = not (lx - 3 <= avoid <= lx + width + 3)
            if lx >= left + 2 and lx + width <= right - 2 and clear:
                return lx, text
    return None


def _steady_start(s: Any) -> int:
    return next((i for i, step, _ in s.phases if step >= 2), 0)


def front_svg(p: Plan) -> str:
    if not p.front:
        return "<p>nothing fits</p>"
    gpus = [c.configuration.gpus for c in p.front]
    peaks = [c.peak_bytes_per_gpu for c in p.front]
    budget = p.gpu.memory_bytes - p.margin_bytes
    top = max(max(peaks), budget) or 1
    most = max(gpus)
    x = lambda g: LEFT + (WIDTH - LEFT - PAD) * (g - 1) / max(1, most - 1)  # noqa: E731
    y = lambda b: HEIGHT - PAD - (HEIGHT - 2 * PAD) * b / top  # noqa: E731
    parts = [
        f"<svg id='front' xmlns='http://www.w3.org/2000/svg' width='{WIDTH}' height='{HEIGHT}' "
        f"viewBox='0 0 {WIDTH} {HEIGHT}' role='img' aria-label='Pareto front'>",
        f"<line x1='{LEFT}' x2='{WIDTH - PAD}' y1='{y(budget):.1f}' y2='{y(budget):.1f}' "
        f"stroke='#b00' stroke-dasharray='4,3'><title>budget {format_bytes(budget)}</title></line>",
        f"<text x='{WIDTH - PAD}' y='{y(budget) - 4:.1f}' text-anchor='end' fill='#b00'>budget "
        f"{_e(format_bytes(budget))}</text>",
    ]
    for c in p.front:
        cfg = c.configuration
        label = (
            f"{cfg.optimizer}, {cfg.strategy}, {cfg.gpus} GPUs"
            + (", checkpointing" if cfg.checkpointing else "")
            + (f", offload {cfg.offload}" if cfg.parallelism.offloads else "")
            + f": {format_bytes(c.peak_bytes_per_gpu)}"
            + (" (derived)" if c.method == DERIVED else "")
        )
        parts.append(
            f"<circle class='candidate' cx='{x(cfg.gpus):.1f}' cy='{y(c.peak_bytes_per_gpu):.1f}' "
            f"r='5' fill='{'#bbb' if c.method == DERIVED else '#4e79a7'}'><title>{_e(label)}</title>"
            "</circle>"
        )
    parts.append(
        f"<text x='{WIDTH / 2:.0f}' y='{HEIGHT - PAD + 24}' text-anchor='middle'>GPUs (1 to "
        f"{most})</text><text x='{LEFT - 4}' y='{y(top) + 4:.1f}' text-anchor='end'>"
        f"{_e(format_bytes(top))}</text></svg>"
    )
    return "".join(parts)
