"""One self-contained HTML report (no network: inline CSS and SVG, no scripts) for
``estimate``, ``measure``, ``plan``, ``advise`` and ``fit``.

A ledger's report has the live bytes of the step over time, stacked by category, with the phases
marked and the peak pointed at; the breakdown at the peak; the modules holding the most
activations; the notes. A measurement adds the estimate beside it category by category; a plan
draws its Pareto front (GPUs against memory per GPU); advice and fit list their answers. The
charts are drawn by ``charts.py``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vramledger.inputs.categories import CATEGORY_PRIORITY, STEP_PHASES
from vramledger.inputs.errors import InputError
from vramledger.inputs.units import format_bytes
from vramledger.ledger.ledger import TOP_MODULES, Ledger
from vramledger.ledger.peak_modules import PASS_NAMES, passes_used, top_modules
from vramledger.measure import Measurement
from vramledger.measure.compare import Comparison
from vramledger.plan.advise import Advice
from vramledger.plan.fit import Fit, NoFit
from vramledger.plan.search import Plan
from vramledger.render.charts import COLOURS, escape, front_svg, timeline_svg
from vramledger.render.notes import by_topic
from vramledger.render.planning import FIT_COLUMNS

_e = escape

CSS = """
body{font-family:system-ui,-apple-system,'Segoe UI',sans-serif;margin:2rem;color:#222;max-width:1000px}
h1{font-size:1.4rem}h2{font-size:1.1rem;margin-top:2rem}
table{border-collapse:collapse;margin:.5rem 0}td,th{padding:.2rem .7rem;border-bottom:1px solid #ddd}
td.n,th.n{text-align:right;font-variant-numeric:tabular-nums}
.swatch{display:inline-block;width:.8rem;height:.8rem;margin-right:.3rem;vertical-align:middle}
.notes li{color:#555}.verdict{font-weight:600}.bad{color:#b00}.good{color:#070}
svg text{font-size:11px;fill:#333}
"""


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
    """The notes under a heading per topic (``inputs/notes.py``), in the topics' order."""
    if not notes:
        return ""
    out = ["<h2>Notes</h2>"]
    for topic, texts in by_topic(notes):
        out.append(f"<h3 class='note-topic'>{_e(topic.value)}</h3><ul class='notes'>")
        out.extend(f"<li>{_e(n)}</li>" for n in texts)
        out.append("</ul>")
    return "".join(out)


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
