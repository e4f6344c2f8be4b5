"""Terminal tables (rich) for ``plan``, ``advise`` and ``rehearse``."""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import Any

from rich.console import Group
from rich.table import Table
from rich.text import Text

from vramledger.inputs.units import format_bytes
from vramledger.plan.advise import Advice
from vramledger.plan.candidates import DERIVED, Candidate
from vramledger.plan.fit import Fit, NoFit
from vramledger.plan.rehearse import Rehearsal
from vramledger.plan.search import Plan
from vramledger.render.notes import note_lines

FRONT_ROWS = 25
"""Rows of the Pareto front shown in the terminal (``--json`` has all of them)."""
FIT_COLUMNS = (
    "optimizer",
    "checkpointing",
    "micro-batch",
    "seq-len",
    "reserved peak",
    "headroom",
    "next size up",
)
"""The columns of ``fit``'s answers, in the terminal and in the HTML page (``html.py``)."""


def _table(title: str, columns: Sequence[str], right: Collection[str]) -> Table:
    """A table titled on the left, with ``columns``: those in ``right`` (numbers) justified
    right, the others left."""
    table = Table(title=title, title_justify="left")
    for col in columns:
        table.add_column(col, justify="right" if col in right else "left")
    return table


def _configuration(c: Candidate) -> str:
    cfg = c.configuration
    parts = [cfg.precision]
    if cfg.gpus > 1 or cfg.parallelism.is_data_parallel:
        parts.append(cfg.strategy)
    parts.append(
        f"micro-batch {cfg.micro_batch}" + (f"×{cfg.grad_accum}" if cfg.grad_accum > 1 else "")
    )
    if cfg.checkpointing:
        parts.append("checkpointing")
    if cfg.parallelism.offloads:
        parts.append(f"offload {cfg.offload}")
    return ", ".join(parts)


_COST_WORDS: dict[str, Callable[[Any], str]] = {
    "recompute_fraction": lambda f: f"+{100 * f:.0f} % compute",
    "communication_bytes_per_step": lambda n: f"{format_bytes(n)} comm/step",
    "host_transfer_bytes_per_step": lambda n: f"{format_bytes(n)} host↔GPU/step",
    "tensor_parallel_bytes_per_step": lambda n: f"{format_bytes(n)} TP comm/step",
    "fsdp_bytes_per_step": lambda n: f"{format_bytes(n)} FSDP comm/step",
    "pipeline_bubble_fraction": lambda f: f"{100 * f:.0f} % bubble",
    "optimizer_behaviour": str,
    "numerics": str,
}
"""How the tables say each cost of a configuration (``candidates.costs``) or a layout
(``layouts.layout_costs``), in this order; a cost of 0 or ``unchanged`` is not said."""


def _costs(costs: dict[str, Any]) -> str:
    said = [
        say(costs[k]) for k, say in _COST_WORDS.items() if costs.get(k, 0) not in (0, "unchanged")
    ]
    return "; ".join(said) or "—"


def _host(c: Candidate) -> str:
    return format_bytes(c.host_bytes_per_node) if c.host_bytes_per_node else "—"


def _how(c: Candidate) -> str:
    return "derived*" if c.method == DERIVED else "re-estimated"


def plan_timing(p: Plan) -> str:
    """The table's line of what the search made and how long it took (the answer cache replaces
    it in a stored answer: ``answer_cache.py``)."""
    return (
        f"searched {p.configurations} configurations from {p.traces} traces in "
        f"{p.search_seconds:.1f} s; {p.estimates} re-estimates with the real engines; "
        f"{p.seconds:.1f} s in all"
    )


def plan_table(p: Plan) -> Group:
    budget = p.gpu.memory_bytes - p.margin_bytes
    head = Text(
        f"{p.gpu.name}: {format_bytes(p.gpu.memory_bytes)} per GPU, margin "
        f"{format_bytes(p.margin_bytes)} → {format_bytes(budget)} for the training step"
        + (
            f"; host memory {format_bytes(p.host_memory_bytes)} per node of {p.gpus_per_node} GPUs"
            if p.host_memory_bytes is not None
            else ""
        ),
        style="bold",
    )
    numbers = ("GPUs", "peak per GPU", "headroom", "host / node")
    fewest = _table(
        "fewest GPUs per optimizer",
        ("optimizer", "GPUs", "configuration", *numbers[1:], "without offload"),
        numbers,
    )
    for name, c in p.fewest_gpus.items():
        plain = p.fewest_gpus_without_offload.get(name)
        if c is None:
            fewest.add_row(name, "—", f"does not fit on {p.max_gpus} GPUs", "", "", "", "")
            continue
        if plain is not None and plain.configuration == c.configuration:
            alt = "same"
        elif plain is None:
            alt = f"does not fit on {p.max_gpus}"
        else:
            alt = (
                f"{plain.configuration.gpus} GPUs: {_configuration(plain)} "
                f"({format_bytes(plain.peak_bytes_per_gpu)})"
            )
        fewest.add_row(
            name,
            str(c.configuration.gpus),
            _configuration(c),
            format_bytes(c.peak_bytes_per_gpu),
            format_bytes(c.headroom_bytes),
            _host(c),
            alt,
        )
    front = _table(
        f"Pareto front of configurations that fit ({len(p.front)}; GPUs, memory and costs)",
        ("GPUs", "optimizer", "configuration", "peak per GPU", "host / node", "costs", "peak"),
        ("GPUs", "peak per GPU", "host / node"),
    )
    for c in p.front[:FRONT_ROWS]:
        front.add_row(
            str(c.configuration.gpus),
            c.configuration.optimizer,
            _configuration(c),
            format_bytes(c.peak_bytes_per_gpu),
            _host(c),
            _costs(c.costs),
            _how(c),
        )
    facts = [
        plan_timing(p),
        "peaks: what the caching allocator reserves on the worst GPU; re-estimated = what "
        "`vramledger estimate` says for that configuration",
        f"margin: {p.margin_source}",
    ]
    derived = [c for c in p.front if c.method == DERIVED]
    if derived:
        facts.append(f"* derived from single-GPU traces, not re-estimated: {derived[0].error}")
    if len(p.front) > FRONT_ROWS:
        facts.append(f"{len(p.front) - FRONT_ROWS} more front rows with --json")
    facts += note_lines(p.notes)
    parts = [head, fewest, front]
    if any(p.layouts.values()):
        parts.append(layouts_table(p))
        facts.append(
            "layouts: tensor parallel within a node (torchtitan's plan, sequence parallel), "
            "pipeline stages (1F1B, pp micro-batches) across nodes, FSDP2 over the "
            "data-parallel ranks; dp moved until one replica fewer does not fit (settled)"
        )
    return Group(*parts, Text("\n".join(facts), style="dim"))


def layouts_table(p: Plan) -> Table:
    table = _table(
        "model-parallel layouts from each answer without offload (each re-estimated)",
        ("optimizer", "GPUs", "tp × pp × dp", "peak per GPU", "headroom", "costs", "fit"),
        ("GPUs", "peak per GPU", "headroom"),
    )
    for name, results in p.layouts.items():
        for r in results:
            x = r.layout
            fit = "fits" if r.fits else "does not fit"
            if r.fits and not r.settled:
                fit += " (one replica fewer not re-estimated)"
            table.add_row(
                name,
                str(x.gpus),
                f"{x.tp} × {x.pp} × {x.dp}",
                format_bytes(r.peak_bytes_per_gpu),
                format_bytes(r.headroom_bytes),
                _costs(r.costs),
                fit,
            )
    return table


def advice_table(a: Advice) -> Group:
    verdict = "fits" if a.fits else "does not fit"
    head = Text(
        f"peak {format_bytes(a.peak_bytes)} vs budget {format_bytes(a.budget_bytes)}: {verdict}",
        style="bold",
    )
    parts: list = [head]
    if a.changes:
        columns = ("#", "change", "peak alone", "saves", "fits alone", "training", "host / node")
        table = _table(
            "alternatives, least harm first (each re-estimated on its own)",
            columns,
            [c for c in columns if c not in ("change", "training")],
        )
        for i, ch in enumerate(a.changes, 1):
            table.add_row(
                str(i),
                f"{ch.name}\n[dim]{ch.description}[/dim]",
                "—" if ch.peak_bytes is None else format_bytes(ch.peak_bytes),
                "—" if ch.saves_bytes is None else format_bytes(ch.saves_bytes, signed=True),
                "yes" if ch.fits else "no",
                ch.behaviour,
                format_bytes(ch.host_bytes_per_node) if ch.host_bytes_per_node else "—",
            )
        parts.append(table)
    if a.stray_temporaries:
        temps = _table(
            "tensors the training code keeps alive after backward (delete them)",
            ("bytes", "made in", "module", "operator"),
            ("bytes",),
        )
        for t in a.stray_temporaries:
            temps.add_row(format_bytes(t["bytes"]), t["phase"], t["module"] or "—", t["op"] or "—")
        parts.append(temps)
    if not a.fits:
        if a.first_fit:
            host = (
                f"; host memory {format_bytes(a.first_fit_host_bytes_per_node)} per node"
                if a.first_fit_host_bytes_per_node
                else ""
            )
            parts.append(
                Text(
                    "first combination that fits, in that order (each change needed): "
                    + " + ".join(a.first_fit)
                    + f" ({format_bytes(a.first_fit_peak_bytes or 0)}{host})",
                    style="bold",
                )
            )
        else:
            parts.append(
                Text(
                    "no combination of the changes above fits on one GPU of this kind",
                    style="bold",
                )
            )
    limits = [
        f"host memory per node: {format_bytes(a.host_memory_bytes)} "
        f"({a.gpus_per_node} GPUs per node)"
        if a.host_memory_bytes is not None
        else f"host memory per node not limited (--host-memory); {a.gpus_per_node} GPUs per node"
    ]
    parts.append(Text("\n".join(limits + note_lines(a.notes)), style="dim"))
    return Group(*parts)


def rehearsal_table(r: Rehearsal) -> Group:
    runs = Table(title=f"rehearsals on {r.device}", title_justify="left")
    runs.add_column("layers", justify="right")
    if r.narrowed:
        runs.add_column("width", justify="right")
    runs.add_column("measured peak", justify="right")
    runs.add_column("tracked tensors", justify="right")
    runs.add_column("beyond tensors", justify="right")
    widths = r.widths or [1.0] * len(r.depths)
    for depth, width, peak, total in zip(
        r.depths, widths, r.measured_peaks, r.tracked_peaks, strict=True
    ):
        runs.add_row(
            str(depth),
            *([f"{width:g}"] if r.narrowed else []),
            format_bytes(peak),
            format_bytes(total),
            format_bytes(peak - total, signed=True),
        )
    how = (
        "least squares: lines in the depth, quadratics in the width; at the full width"
        if r.narrowed
        else "least-squares lines"
    )
    fits = Table(
        title=f"growth per layer at the {r.peak_phase} peak ({how})",
        title_justify="left",
    )
    fits.add_column("category")
    fits.add_column("per layer", justify="right")
    fits.add_column("at 0 layers", justify="right")
    fits.add_column(f"at {r.full_depth} layers", justify="right")
    for name, f in r.fits.items():
        fits.add_row(
            name,
            format_bytes(round(f.slope), signed=True),
            format_bytes(round(f.intercept), signed=True),
            format_bytes(f.at(r.full_depth)),
        )
    error = (r.extrapolated_peak_bytes - r.estimate_peak_bytes) / r.estimate_peak_bytes
    summary = Text(
        f"full model ({r.full_depth} layers): rehearsal extrapolates {format_bytes(r.extrapolated_peak_bytes)}, "
        f"fake-tensor estimate {format_bytes(r.estimate_peak_bytes)} ({100 * error:+.2f} %)\n"
        f"residual beyond tensors: {format_bytes(r.residual_bytes)} "
        "(add it to plan's margin with --margin-from this JSON)\n"
        f"took {r.seconds:.1f} s",
        style="dim",
    )
    return Group(runs, fits, summary)


def fit_timing(f: Fit) -> str:
    """How many estimates the answer took and how long (the answer cache replaces it in a stored
    answer: ``answer_cache.py``)."""
    return f"{f.estimates} estimates in {f.seconds:.1f} s"


def fit_table(f: Fit) -> Group:
    head = Text(
        f"{f.gpu.name}: {format_bytes(f.gpu.memory_bytes)}, margin {format_bytes(f.margin_bytes)}"
        f" — the largest {'micro-batch' if f.maximize == 'batch-size' else 'sequence length'}"
        + (" at each micro-batch" if f.maximize == "both" else "")
        + " that fits",
        style="bold",
    )
    table = _table(
        "answers (each re-estimated, with the next size up)", FIT_COLUMNS, FIT_COLUMNS[2:]
    )
    for a in f.rows():
        if isinstance(a, NoFit):
            table.add_row(
                a.optimizer,
                "on" if a.checkpointing else "off",
                Text("none fits", style="red"),
                "",
                format_bytes(a.reserved_peak_bytes),
                format_bytes(a.headroom_bytes, signed=True),
                f"smallest, {a.batch_size}×{a.seq_len}, needs "
                f"{format_bytes(-a.headroom_bytes)} more",
            )
            continue
        nxt = a.next_size
        table.add_row(
            a.optimizer,
            "on" if a.checkpointing else "off",
            str(a.batch_size),
            str(a.seq_len),
            format_bytes(a.reserved_peak_bytes),
            format_bytes(a.headroom_bytes),
            f"{nxt['batch_size']}×{nxt['seq_len']}: {format_bytes(nxt['reserved_peak_bytes'])} "
            + ("fits" if a.fits_next else "does not fit"),
        )
    facts = [
        f"{fit_timing(f)}; sequence lengths in steps of {f.seq_step}",
        *note_lines(f.notes),
    ]
    return Group(head, table, Text("\n".join(facts), style="dim"))
