"""One self-contained HTML report (no network: inline CSS and SVG, no scripts) for
``estimate``, ``measure``, ``plan``, ``advise`` and ``fit``.

A ledger's report has the live bytes of the step over time, stacked by category, with the phases
marked and the peak pointed at; the breakdown at the peak; the modules holding the most
activations; the notes. A measurement adds the estimate beside it category by category; a plan
draws its Pareto front (GPUs against memory per GPU); advice and fit list their answers. Every
chart element carries a ``<title>`` (the browser's tooltip) with its numbers.
"""

from __future__ import annotations

import html
from pathlib import Path
from typing import Any

from ..categories import CATEGORY_PRIORITY, STEP_PHASES, Category
from ..compare import Comparison
from ..errors import InputError
from ..ledger import TOP_MODULES, Ledger
from ..measure import Measurement
from ..peak_modules import PASS_NAMES, passes_used, top_modules
from ..plan.advise import Advice
from ..plan.candidates import DERIVED
from ..plan.fit import Fit, NoFit
from ..plan.search import Plan
from ..replay import series
from ..units import format_bytes
from .planning import FIT_COLUMNS

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

CSS = """
body{font-family:system-ui,-apple-system,'Segoe UI',sans-serif;margin:2rem;color:#222;max-width:1000px}
h1{font-size:1.4rem}h2{font-size:1.1rem;margin-top:2rem}
table{border-collapse:collapse;margin:.5rem 0}td,th{padding:.2rem .7rem;border-bottom:1px solid #ddd}
td.n,th.n{text-align:right;font-variant-numeric:tabular-nums}
.swatch{display:inline-block;width:.8rem;height:.8rem;margin-right:.3rem;vertical-align:middle}
.notes li{color:#555}.verdict{font-weight:600}.bad{color:#b00}.good{color:#070}
svg text{font-size:11px;fill:#333}
"""


def _e(text: Any) -> str:
    return html.escape(str(text))


def _page(title: str, body: list[str]) -> str:
    return (
        "<!DOCTYPE html>\n<html lang='en'><head><meta charset='utf-8'>"
        f"<title>{_e(title)}</title><style>{CSS}</style></head><body>"
        f"<h1>{_e(title)}</h1>" + "".join(body) + "</body></html>\n"
    )


def _table(head: list[str], rows: list[list[str]], numeric: set[int] = frozenset()) -> str:
    cls = lambda i: " class='n'" if i in numeric else ""  # noqa: E731
    out = ["<table><tr>"]
    out += [f"<th{cls(i)}>{_e(h)}</th>" for i, h in enumerate(head)]
    out.append("</tr>")
    for row in rows:
        out.append("<tr>" + "".join(f"<td{cls(i)}>{c}</td>" for i, c in enumerate(row)) + "</tr>")
    out.append("</table>")
    return "".join(out)


def _notes(notes: list[str]) -> str:
    if not notes:
        return ""
    return (
        "<h2>Notes</h2><ul class='notes'>" + "".join(f"<li>{_e(n)}</li>" for n in notes) + "</ul>"
    )


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


def _breakdown(ledger: Ledger) -> str:
    rows = []
    for c in CATEGORY_PRIORITY:
        raw, alloc = ledger.at_peak.get(c, 0), ledger.allocated_at_peak.get(c, 0)
        if raw or alloc:
            share = 100 * raw / ledger.peak_bytes if ledger.peak_bytes else 0
            rows.append(
                [
                    f"<span class='swatch' style='background:{COLOURS[c]}'></span>{_e(c.value)}",
                    _e(format_bytes(raw)),
                    f"{share:.1f} %",
                    _e(format_bytes(alloc)),
                ]
            )
    rows.append(
        [
            "<b>total</b>",
            f"<b>{_e(format_bytes(ledger.peak_bytes))}</b>",
            "",
            f"<b>{_e(format_bytes(ledger.allocated_peak_bytes))}</b>",
        ]
    )
    phases = [
        [
            _e(p.value + (" ◀ peak" if p is ledger.peak_phase else "")),
            _e(format_bytes(ledger.phases[p])),
        ]
        for p in STEP_PHASES
        if p in ledger.phases
    ]
    return (
        "<h2>At the peak</h2>"
        + _table(
            ["category", "tensors", "share", f"allocated ({ledger.allocator})"], rows, {1, 2, 3}
        )
        + _table(["phase", "peak"], phases, {1})
    )


def _modules(ledger: Ledger) -> str:
    out = ""
    if ledger.top_modules:
        rows = [[_e(m), _e(format_bytes(b))] for m, b in ledger.top_modules]
        out += "<h2>Activations held at the end of forward, by module</h2>" + _table(
            ["module", "activations"], rows, {1}
        )
    if ledger.peak_modules:
        top = top_modules(ledger.peak_modules, TOP_MODULES)
        passes = passes_used(top)
        rows = [
            [
                _e(row.module),
                _e(format_bytes(row.total)),
                *(_e(format_bytes(getattr(row, p))) if getattr(row, p) else "—" for p in passes),
            ]
            for row in top
        ]
        out += "<h2>Live at the peak, by the module that allocated it</h2>" + _table(
            ["module", "at peak", *(PASS_NAMES[p] for p in passes)],
            rows,
            set(range(1, 2 + len(passes))),
        )
    return out


def _verdict(ledger: Ledger) -> str:
    v = ledger.verdict
    if v is None:
        return ""
    word, cls = ("fits", "good") if v.fits else ("does not fit", "bad")
    return (
        f"<p class='verdict {cls}'>{word} on {_e(v.gpu.name)}: headroom "
        f"{_e(format_bytes(v.headroom_bytes))} with a margin of "
        f"{_e(format_bytes(v.margin_bytes))}</p>"
    )


def ledger_html(ledger: Ledger, title: str = "vramledger estimate") -> str:
    spec = ledger.spec
    head = (
        f"<p>{_e(spec.get('model'))} · batch {_e(spec.get('batch_size'))}×"
        f"{_e(spec.get('seq_len'))} · {_e(spec.get('precision'))} · optimizer "
        f"{_e(spec.get('optimizer'))} · target {_e(ledger.target)} · peak "
        f"<b>{_e(format_bytes(ledger.peak_bytes))}</b> (allocated "
        f"{_e(format_bytes(ledger.allocated_peak_bytes))}, reserved "
        f"{_e(format_bytes(ledger.reserved_peak_bytes))})</p>"
    )
    return _page(title, [head, *ledger_body(ledger)])


def ledger_body(ledger: Ledger) -> list[str]:
    """The parts of a ledger's report below its one-line summary (the page of ``serve`` shows
    them too): warnings, verdict, timeline, breakdown at the peak, modules, notes."""
    warnings = "".join(f"<p class='bad'>warning: {_e(w)}</p>" for w in ledger.warnings)
    return [
        warnings,
        _verdict(ledger),
        "<h2>Live memory over the step</h2>",
        timeline_svg(ledger),
        _breakdown(ledger),
        _modules(ledger),
        _notes(ledger.notes),
    ]


def measurement_html(m: Measurement) -> str:
    page = ledger_html(m.ledger, title=f"vramledger measurement on {m.device}")
    rows = [["allocator's own count", _e(format_bytes(m.measured_peak_bytes))]]
    rows.append(["tracked tensors", _e(format_bytes(m.ledger.peak_bytes))])
    extra = "<h2>Measured</h2>" + _table(["", "steady-state peak"], rows, {1})
    if m.estimate is not None:
        extra += "<h2>Prediction against the measurement, category by category</h2>"
        extra += _table(
            ["category", "estimate", "measured", "difference"],
            [
                [
                    _e(c.value),
                    _e(format_bytes(e)),
                    _e(format_bytes(r)),
                    _e(format_bytes(e - r, signed=True)),
                ]
                for c, e, r in m.by_category()
            ]
            + [
                [
                    "<b>total</b>",
                    _e(format_bytes(m.estimate.peak_bytes)),
                    _e(format_bytes(m.ledger.peak_bytes)),
                    _e(format_bytes(m.estimate.peak_bytes - m.ledger.peak_bytes, signed=True)),
                ]
            ],
            {1, 2, 3},
        )
    return page.replace(
        "<h2>Live memory over the step</h2>", extra + "<h2>Live memory over the step</h2>"
    )


def plan_html(p: Plan) -> str:
    return _page("vramledger plan", plan_body(p))


def plan_body(p: Plan) -> list[str]:
    return [
        f"<p>{_e(p.gpu.name)}: {_e(format_bytes(p.gpu.memory_bytes))} per GPU, margin "
        f"{_e(format_bytes(p.margin_bytes))}</p>",
        "<h2>Fewest GPUs per optimizer</h2>",
        _table(
            [
                "optimizer",
                "GPUs",
                "strategy",
                "offload",
                "checkpointing",
                "peak per GPU",
                "headroom",
            ],
            [
                [
                    _e(name),
                    str(c.configuration.gpus),
                    _e(c.configuration.strategy),
                    _e(c.configuration.offload),
                    "yes" if c.configuration.checkpointing else "no",
                    _e(format_bytes(c.peak_bytes_per_gpu)),
                    _e(format_bytes(c.headroom_bytes)),
                ]
                if c
                else [_e(name), "—", f"does not fit on {p.max_gpus}", "", "", "", ""]
                for name, c in p.fewest_gpus.items()
            ],
            {1, 5, 6},
        ),
        "<h2>Pareto front (GPUs against memory per GPU)</h2>",
        front_svg(p),
        _notes(p.notes),
    ]


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
            + (f", offload {cfg.offload}" if cfg.offload != "none" else "")
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


def advice_html(a: Advice) -> str:
    return _page("vramledger advise", advice_body(a))


def advice_body(a: Advice) -> list[str]:
    rows = [
        [
            _e(c.name),
            _e("—" if c.peak_bytes is None else format_bytes(c.peak_bytes)),
            "yes" if c.fits else "no",
            _e(c.behaviour),
            _e(format_bytes(c.host_bytes_per_node) if c.host_bytes_per_node else "—"),
        ]
        for c in a.changes
    ]
    verdict = "fits" if a.fits else "does not fit"
    body = [
        f"<p class='verdict {'good' if a.fits else 'bad'}'>peak {_e(format_bytes(a.peak_bytes))} "
        f"against a budget of {_e(format_bytes(a.budget_bytes))}: {verdict}</p>",
        "<h2>Alternatives, least harm first</h2>",
        _table(["change", "peak alone", "fits alone", "training", "host / node"], rows, {1}),
    ]
    if a.first_fit:
        body.append(
            f"<p><b>First combination that fits:</b> {_e(' + '.join(a.first_fit))} "
            f"({_e(format_bytes(a.first_fit_peak_bytes or 0))})</p>"
        )
    body.append(_notes(a.notes))
    return body


def fit_html(f: Fit) -> str:
    return _page("vramledger fit", fit_body(f))


def fit_body(f: Fit) -> list[str]:
    """The answers, and as the terminal table does, each configuration whose smallest size does
    not fit, with what that size needs."""
    rows = []
    for a in f.rows():
        if isinstance(a, NoFit):
            rows.append(
                [
                    _e(a.optimizer),
                    "on" if a.checkpointing else "off",
                    "<span class='bad'>none fits</span>",
                    "",
                    _e(format_bytes(a.reserved_peak_bytes)),
                    _e(format_bytes(a.headroom_bytes, signed=True)),
                    _e(
                        f"smallest, {a.batch_size}×{a.seq_len}, needs "
                        f"{format_bytes(-a.headroom_bytes)} more"
                    ),
                ]
            )
            continue
        rows.append(
            [
                _e(a.optimizer),
                "on" if a.checkpointing else "off",
                str(a.batch_size),
                str(a.seq_len),
                _e(format_bytes(a.reserved_peak_bytes)),
                _e(format_bytes(a.headroom_bytes)),
                "fits" if a.fits_next else "does not fit",
            ]
        )
    return [
        f"<p>{_e(f.gpu.name)}, margin {_e(format_bytes(f.margin_bytes))}</p>",
        _table(list(FIT_COLUMNS), rows, {2, 3, 4, 5}),
        _notes(f.notes),
    ]


def render_html(result: Any) -> str:
    if isinstance(result, Measurement):
        return measurement_html(result)
    if isinstance(result, Ledger):
        return ledger_html(result)
    if isinstance(result, Plan):
        return plan_html(result)
    if isinstance(result, Advice):
        return advice_html(result)
    if isinstance(result, Fit):
        return fit_html(result)
    if isinstance(result, Comparison):
        raise InputError("compare has no HTML report", hint="use --plot for its curves")
    raise InputError(f"no HTML report for {type(result).__name__}")


def write_html(result: Any, path: str | Path) -> Path:
    path = Path(path)
    try:
        path.write_text(render_html(result), encoding="utf-8")
    except OSError as exc:
        raise InputError(f"cannot write {path}: {exc.strerror}", hint="check the path") from exc
    return path
