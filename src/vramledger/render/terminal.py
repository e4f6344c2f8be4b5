"""Terminal tables (rich) for ledgers and measurements."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from vramledger.inputs.categories import STEP_PHASES, Category
from vramledger.inputs.units import format_bytes
from vramledger.inputs.verdict import Verdict
from vramledger.ledger.ledger import TOP_MODULES, Ledger
from vramledger.ledger.peak_modules import PASS_NAMES, passes_used, top_modules
from vramledger.render.notes import note_lines

if TYPE_CHECKING:  # both import torch; a ledger's table does not (answer_cache.py draws one)
    from vramledger.measure import Measurement
    from vramledger.measure.compare import Comparison


def _pct(part: int, whole: int) -> str:
    return f"{100 * part / whole:5.1f} %" if whole else "   — "


def _title(ledger: Ledger) -> str:
    spec = ledger.spec
    parts = [str(spec.get("model", "model"))]
    for key in ("task",):
        if spec.get(key):
            parts.append(str(spec[key]))
    parts.append(f"batch {spec.get('batch_size')}×{spec.get('seq_len')}")
    parts.append(str(spec.get("precision")))
    parts.append(f"optimizer {spec.get('optimizer')}")
    if spec.get("strategy") not in (None, "none"):
        parts.append(f"{spec['strategy']} × {spec.get('world_size', 1)} ranks")
    if spec.get("offload") not in (None, "none"):
        parts.append(f"offload {spec['offload']}")
    if spec.get("grad_checkpointing") or spec.get("checkpoint_modules"):
        parts.append("checkpointing")
    if spec.get("grad_accum", 1) > 1:
        parts.append(f"grad-accum {spec['grad_accum']}")
    return " · ".join(parts)


def ledger_timing(ledger: Ledger) -> str:
    """The table's line of how long the ledger took (the answer cache replaces it in a stored
    answer: ``answer_cache.py``)."""
    return f"took {ledger.seconds:.2f} s"


def ledger_table(ledger: Ledger, *, label: str = "estimate") -> Group:
    breakdown = Table(
        title=f"{label}: peak of a steady-state step on {ledger.target}", title_justify="left"
    )
    breakdown.add_column("category")
    breakdown.add_column("at peak", justify="right")
    breakdown.add_column("share", justify="right")
    breakdown.add_column(f"allocated ({ledger.allocator})", justify="right")
    breakdown.add_column("first step", justify="right")
    for cat in Category:
        raw = ledger.at_peak.get(cat, 0)
        alloc = ledger.allocated_at_peak.get(cat, 0)
        first = ledger.first_step_at_peak.get(cat, 0)
        if raw == alloc == first == 0:
            continue
        breakdown.add_row(
            cat.value,
            format_bytes(raw),
            _pct(raw, ledger.peak_bytes),
            format_bytes(alloc),
            format_bytes(first),
        )
    breakdown.add_row(
        Text("total", style="bold"),
        Text(format_bytes(ledger.peak_bytes), style="bold"),
        "",
        Text(format_bytes(ledger.allocated_peak_bytes), style="bold"),
        Text(format_bytes(ledger.first_step_peak_bytes), style="bold"),
    )
    phases = Table(title="peak by phase (steady state)", title_justify="left")
    phases.add_column("phase")
    phases.add_column("peak", justify="right")
    phases.add_column("allocated", justify="right")
    for phase in STEP_PHASES:
        if phase in ledger.phases:
            marker = " ◀ peak" if phase is ledger.peak_phase else ""
            phases.add_row(
                phase.value + marker,
                format_bytes(ledger.phases[phase]),
                format_bytes(ledger.allocated_phases.get(phase, 0)),
            )
    parts: list = [Text(_title(ledger), style="bold")]
    parts += [Text(f"warning: {w}", style="yellow") for w in ledger.warnings]
    parts += [breakdown, phases]
    if ledger.verdict is not None:
        parts.append(verdict_line(ledger.verdict))
    if ledger.world_size > 1:
        parts.append(ranks_table(ledger))
    if ledger.top_modules:
        modules = Table(
            title="activations held at the end of forward, by module", title_justify="left"
        )
        modules.add_column("module")
        modules.add_column("activations", justify="right")
        for name, nbytes in ledger.top_modules:
            modules.add_row(name, format_bytes(nbytes))
        parts.append(modules)
    if ledger.peak_modules:
        parts.append(peak_modules_table(ledger))
    facts = []
    if ledger.reserved_peak_bytes != ledger.allocated_peak_bytes:
        facts.append(
            f"reserved by the caching allocator at its peak: {format_bytes(ledger.reserved_peak_bytes)} "
            f"(cached free blocks and segment rounding: "
            f"{format_bytes(ledger.reserved_peak_bytes - ledger.allocated_peak_bytes, signed=True)})"
        )
    facts += [
        parameters_line(ledger),
        optimizer_state_line(ledger),
        f"held at step start: {format_bytes(ledger.step_start_bytes)}",
    ]
    if ledger.host_bytes:
        facts.append(f"host memory (not on the device): {format_bytes(ledger.host_bytes)}")
    facts.extend(note_lines(ledger.notes))
    facts.append(ledger_timing(ledger))
    parts.append(Text("\n".join(facts), style="dim"))
    return Group(*parts)


def peak_modules_table(ledger: Ledger) -> Table:
    """What is live at the peak by the module that allocated it, split by pass: forward,
    forward recomputed by activation checkpointing, backward, outside both."""
    rows = top_modules(ledger.peak_modules, TOP_MODULES)
    passes = passes_used(rows)
    table = Table(
        title="live at the peak, by the module that allocated it (in its forward or backward)",
        title_justify="left",
    )
    table.add_column("module")
    table.add_column("at peak", justify="right")
    for p in passes:
        table.add_column(PASS_NAMES[p], justify="right")
    for row in rows:
        table.add_row(
            row.module,
            format_bytes(row.total),
            *(format_bytes(getattr(row, p)) if getattr(row, p) else "—" for p in passes),
        )
    return table


def parameters_line(ledger: Ledger) -> str:
    """The whole model's parameters; under pipeline parallelism also the worst rank's stage's."""
    line = f"parameters: {ledger.parameters:,} ({ledger.trainable_parameters:,} trainable)"
    if ledger.stage_parameters is not None:
        line += (
            f"; {_whose(ledger)} holds {ledger.stage_parameters:,} of them "
            "(pipeline stages split the layers over ranks)"
        )
    return line


def _whose(ledger: Ledger) -> str:
    """The rank a ledger describes: the worst of an estimate's ranks, or the one rank a real run
    on several measured (``measure`` under torchrun: no other ranks' ledgers beside it)."""
    return f"rank {ledger.worst_rank}" if ledger.world_size > 1 else "this rank"


def optimizer_state_line(ledger: Ledger) -> str:
    """The optimizer state, per trainable parameter; on several ranks this rank's and all ranks'
    together, each per parameter of the whole model (FSDP's 1.00 bytes/parameter per rank is
    AdamW's 8 over 8 ranks); one rank's alone where a real run measured only it."""
    method = ledger.optimizer_state_method
    per_param = ledger.optimizer_state_bytes_per_param
    if (ledger.spec.get("world_size") or 1) > 1 and ledger.world_size <= 1:
        return (  # one rank of a real run on several
            f"optimizer state: {format_bytes(ledger.optimizer_state_bytes)} on this rank "
            f"({per_param:.2f} bytes per trainable parameter of the whole model; {method})"
        )
    if ledger.world_size <= 1:
        return (
            f"optimizer state: {format_bytes(ledger.optimizer_state_bytes)} "
            f"({per_param:.2f} bytes/parameter; {method})"
        )
    total = ledger.optimizer_state_bytes_all_ranks
    total_per_param = total / ledger.trainable_parameters if ledger.trainable_parameters else 0.0
    return (
        f"optimizer state: {format_bytes(ledger.optimizer_state_bytes)} on rank "
        f"{ledger.worst_rank} ({per_param:.2f} bytes per trainable parameter of the whole model); "
        f"{format_bytes(total)} over all {ledger.world_size} ranks ({total_per_param:.2f} "
        f"bytes/parameter); {method}"
    )


def verdict_line(verdict: Verdict) -> Text:
    """One line: fits with how much headroom, or how much more it needs."""
    gpu = verdict.gpu
    basis = (
        f"(reserved peak {format_bytes(verdict.peak_bytes)} + margin "
        f"{format_bytes(verdict.margin_bytes)} of {format_bytes(gpu.memory_bytes)})"
    )
    if verdict.fits:
        return Text(
            f"fits on {gpu.name} with {format_bytes(verdict.headroom_bytes)} headroom {basis}",
            style="bold green",
        )
    return Text(
        f"does not fit on {gpu.name}: needs {format_bytes(-verdict.headroom_bytes)} more {basis}",
        style="bold red",
    )


def _rank_ids(ids: list[int]) -> str:
    if len(ids) > 2 and ids == list(range(ids[0], ids[-1] + 1)):
        return f"{ids[0]}–{ids[-1]}"
    return ", ".join(map(str, ids[:8])) + (" …" if len(ids) > 8 else "")


def _split_axes(spec: dict) -> list[str]:
    """The mesh axes a ranks table shows coordinates on: dp and every axis the model is split
    along (none for a data-parallel-only run, where the rank is its dp coordinate)."""
    split = [a for a in ("tp", "pp", "cp", "ep") if (spec.get(a) or 1) > 1]
    return ["dp", *split] if split else []


def ranks_table(ledger: Ledger) -> Table:
    table = Table(
        title=f"{ledger.strategy} on {ledger.world_size} ranks: each distinct rank (worst: {ledger.worst_rank})",
        title_justify="left",
    )
    axes = _split_axes(ledger.spec)
    mesh = [("mesh (" + " ".join(axes) + ")")] if axes else []
    for col in ("ranks", *mesh, "peak", "allocated", "model state", "host (offloaded)"):
        table.add_column(col, justify="left" if col in ("ranks", *mesh) else "right")
    for ids, rank_ledger in ledger.ranks:
        coords = rank_ledger.mesh_coords
        table.add_row(
            _rank_ids(ids),
            *([" ".join(str(coords.get(a, 0)) for a in axes)] if axes else []),
            format_bytes(rank_ledger.peak_bytes),
            format_bytes(rank_ledger.allocated_peak_bytes),
            format_bytes(rank_ledger.model_state_bytes),
            format_bytes(rank_ledger.host_bytes),
        )
    return table


def measurement_table(m: Measurement) -> Group:
    parts = [ledger_table(m.ledger, label=f"measured on {m.device}")]
    summary = Table(title="measured totals", title_justify="left")
    summary.add_column("")
    summary.add_column("steady-state peak", justify="right")
    summary.add_column("first step", justify="right")
    summary.add_row(
        f"allocator ({m.method})",
        format_bytes(m.measured_peak_bytes),
        format_bytes(m.measured_first_step_peak_bytes),
    )
    tracked = m.ledger.allocated_peak_bytes
    summary.add_row(
        "tracked tensors",
        format_bytes(tracked),
        format_bytes(m.ledger.first_step_allocated_peak_bytes),
    )
    if m.estimate is not None:
        est = m.estimate.allocated_peak_bytes
        summary.add_row(
            "estimate (fake tensors)",
            format_bytes(est),
            format_bytes(m.estimate.first_step_allocated_peak_bytes),
        )
        err = m.error()
        summary.add_row("estimate error", f"{100 * err:+.3f} %" if err is not None else "—", "")
    parts.append(summary)
    if m.estimate is not None:
        compared = Table(
            title="prediction against the measurement, category by category (each at its peak)",
            title_justify="left",
        )
        for col in ("category", "estimate", "measured (tracked)", "difference"):
            compared.add_column(col, justify="left" if col == "category" else "right")
        for category, est, real in m.by_category():
            compared.add_row(
                category.value,
                format_bytes(est),
                format_bytes(real),
                format_bytes(est - real, signed=True),
            )
        compared.add_row(
            Text("total", style="bold"),
            format_bytes(m.estimate.peak_bytes),
            format_bytes(m.ledger.peak_bytes),
            format_bytes(m.estimate.peak_bytes - m.ledger.peak_bytes, signed=True),
        )
        parts.append(compared)
    if m.ranks:
        ranks = Table(title=f"every rank, measured ({len(m.ranks)} ranks)", title_justify="left")
        for col in ("rank", "allocator peak", "tracked tensors"):
            ranks.add_column(col, justify="right")
        for r in m.ranks:
            ranks.add_row(
                str(r["rank"]),
                format_bytes(r["measured_peak_bytes"]),
                format_bytes(r["tracked_peak_bytes"]),
            )
        parts.append(ranks)
    return Group(*parts)


PIPED_MAX_WIDTH = 1000
"""Widest line written when output is not a terminal. rich gives a console that is not a
terminal 80 columns (``Console._width`` falls back to 80 without ``COLUMNS``), which cuts table
cells ("checkpoi…") in piped or captured output; there each table is drawn at its natural width,
up to this many columns."""


def output_console(renderable: object) -> Console:
    """The console to print ``renderable`` on: the terminal's own width on a terminal or where
    ``COLUMNS`` is set; otherwise as wide as the renderable's widest line (at least 80 columns), so
    that nothing is cut."""
    console = Console()
    if console.is_terminal or os.environ.get("COLUMNS"):
        return console
    natural = Console(width=PIPED_MAX_WIDTH).measure(renderable).maximum
    return Console(width=max(80, min(natural, PIPED_MAX_WIDTH)))


def print_renderable(renderable: object, console: Console | None = None) -> None:
    (console or output_console(renderable)).print(renderable)


def comparison_table(c: Comparison) -> Group:
    table = Table(
        title=f"{c.steps} steps on {c.device}, reference {c.reference}, tolerance {100 * c.tolerance:.1f} %",
        title_justify="left",
    )
    for col in (
        "optimizer",
        "peak",
        "optimizer state",
        "bytes/param",
        "final loss",
        "final gap",
        "max gap",
        "verdict",
    ):
        table.add_column(col, justify="left" if col in ("optimizer", "verdict") else "right")
    for r in c.runs:
        gap = "—" if r.final_gap is None else f"{100 * r.final_gap:+.2f} %"
        largest = "—" if r.max_gap is None else f"{100 * r.max_gap:.2f} %"
        table.add_row(
            r.optimizer,
            format_bytes(r.peak_bytes),
            format_bytes(r.optimizer_state_bytes),
            f"{r.optimizer_state_bytes_per_param:.2f}",
            f"{r.final_loss:.4f}",
            gap,
            largest,
            r.verdict,
        )
    notes = [f"memory: {c.memory_method}", *note_lines(c.notes)]
    return Group(table, Text("\n".join(notes), style="dim"))
