"""Terminal tables for a program's run: its ledger (``terminal.ledger_table``) with each
optimizer's window, or, for a real CPU run, the allocator's counts."""

from __future__ import annotations

from rich.console import Group
from rich.table import Table
from rich.text import Text

from vramledger.inputs.categories import Category
from vramledger.inputs.units import format_bytes
from vramledger.measure.program import ProgramMeasurement
from vramledger.predict.program import ProgramReport
from vramledger.predict.windows import OptimizerWindow
from vramledger.render.notes import note_lines
from vramledger.render.terminal import ledger_table


def _title(program: str, target: str, ending: str, steps: int, label: str) -> Text:
    how = {"ended": "ran to its end", "max-steps": "stopped at --max-steps", "timeout": "timed out"}
    return Text(
        f"{label}: {program} · on {target} · {steps} optimizer step{'s' if steps != 1 else ''} "
        f"({how.get(ending, ending)})",
        style="bold",
    )


def windows_table(windows: list[OptimizerWindow], peak_bytes: int, allocator: str) -> Table:
    table = Table(
        title=f"each optimizer's steady window (allocated, {allocator})", title_justify="left"
    )
    table.add_column("optimizer")
    table.add_column("steps", justify="right")
    table.add_column("steady peak", justify="right")
    table.add_column("first step", justify="right")
    for w in windows:
        steps = f"{w.steps[0]}–{w.steps[-1]}" if len(w.steps) > 1 else str(w.steps[0])
        if len(w.steps) > 1 and w.steps != list(range(w.steps[0], w.steps[-1] + 1)):
            steps = f"{len(w.steps)} of {w.steps[0]}–{w.steps[-1]}"
        table.add_row(
            w.optimizer,
            steps,
            format_bytes(w.peak_bytes) + ("" if w.steady else " (one step)"),
            format_bytes(w.first_step_peak_bytes),
        )
    table.add_row(Text("program", style="bold"), "", Text(format_bytes(peak_bytes), style="bold"))
    return table


def _ids(ids: list[int]) -> str:
    if len(ids) > 2 and ids == list(range(ids[0], ids[-1] + 1)):
        return f"{ids[0]}–{ids[-1]}"
    return ", ".join(map(str, ids))


def ranks_windows_table(
    ranks: list[tuple[list[int], list[OptimizerWindow], int]], world_size: int, allocator: str
) -> Table:
    """Each rank's (or group of equal ranks') steady window per optimizer and program peak."""
    table = Table(
        title=f"each rank of {world_size}: steady window per optimizer (allocated, {allocator})",
        title_justify="left",
    )
    table.add_column("ranks")
    table.add_column("optimizer")
    table.add_column("steady peak", justify="right")
    table.add_column("program peak", justify="right")
    for ids, windows, peak in ranks:
        for i, w in enumerate(windows or [None]):
            table.add_row(
                _ids(ids) if i == 0 else "",
                w.optimizer if w else "(no step)",
                format_bytes(w.peak_bytes) + ("" if w.steady else " (one step)") if w else "",
                format_bytes(peak) if i == 0 else "",
            )
    return table


def program_table(report: ProgramReport) -> Group:
    """The ledger of the program's steady steps, then each optimizer's window; before a
    second step, what was seen."""
    label = "run" + (
        f" (rank {report.rank} of {report.world_size})" if report.world_size > 1 else ""
    )
    title = _title(report.program, report.target, report.ending, report.steps, label)
    allocator = "CUDA caching allocator" if report.target == "cuda" else "CPU allocator"
    windows: Table | Group = windows_table(report.windows, report.peak_bytes, allocator)
    if report.world_size > 1:
        rows = [(ids, r.windows, r.peak_bytes) for ids, r in report.ranks]
        windows = Group(windows, ranks_windows_table(rows, report.world_size, allocator))
    if report.ledger is not None:
        group = ledger_table(report.ledger, label="run")
        group.renderables[0] = title
        group.renderables.insert(1, windows)
        return group
    seen = Table(title="what was seen (no steady step)", title_justify="left")
    seen.add_column("category")
    seen.add_column("at the peak seen", justify="right")
    for cat in Category:
        if report.at_peak.get(cat):
            seen.add_row(cat.value, format_bytes(report.at_peak[cat]))
    seen.add_row(
        Text("total (tensor bytes)", style="bold"), format_bytes(sum(report.at_peak.values()))
    )
    notes = Text("\n".join(note_lines(report.notes)), style="dim")
    return Group(title, windows, seen, notes)


def measured_program_table(m: ProgramMeasurement) -> Group:
    label = "run --measure" + (f" (rank {m.rank} of {m.world_size})" if m.world_size > 1 else "")
    title = _title(m.program, "cpu (measured)", m.ending, m.steps, label)
    steps = Table(title="allocator peak of each step", title_justify="left")
    steps.add_column("step", justify="right")
    steps.add_column("optimizer")
    steps.add_column("peak", justify="right")
    for step, peak in m.step_peaks.items():
        owner = next((w.optimizer for w in m.windows if step in w.steps), "(after the last step)")
        steps.add_row(str(step), owner, format_bytes(peak))
    notes = Text("\n".join([f"counted by {m.method}", *note_lines(m.notes)]), style="dim")
    parts = [title, windows_table(m.windows, m.peak_bytes, "CPU allocator"), steps]
    if m.world_size > 1:
        rows = [([rank], r.windows, r.peak_bytes) for rank, r in m.ranks]
        parts.append(ranks_windows_table(rows, m.world_size, "CPU allocator"))
    return Group(*parts, notes)
