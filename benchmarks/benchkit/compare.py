"""Whether two results of one benchmark give the same answers, field for field.

Every benchmark that writes a result JSON takes the same two options (:func:`add_arguments`):

    python benchmarks/NAME.py ... --compare OLD.json                     # run, then compare
    python benchmarks/NAME.py --compare OLD.json --against NEW.json      # compare two files only

Both results are walked together, every field of every row: each answer (estimates, bytes,
errors, verdicts, notes) that differs, and each field or row that only one of them has, is a
row of the printed table, and the script exits with :data:`ANSWERS_DIFFER`. Where a result was
made and when, on what machine and how fast are not answers: the keys of :data:`IGNORED` are
left out wherever they occur (a script adds its own, with why, where its result holds another
kind, e.g. speed verdicts). Rows of a list are paired by what names them (:data:`NAMING_KEYS`:
``case``, ``model``, ``rank``, ...) where every row has a distinct name in both results, else
by position. Values are compared exactly (a float equal to the last bit; a path into the
checkout by its part inside it, :data:`CHECKOUT_PATH`), both results read back from JSON (so an
answer held in memory compares as its file would).
"""

from __future__ import annotations

import argparse
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ANSWERS_DIFFER = 3
"""Exit status when an answer differs (1 is a benchmark's own "target missed", 2 argparse's)."""

PROVENANCE: dict[str, str] = {
    "commit": "the code the result was made with: the point of comparing two",
    "commit_note": "a word on that commit",
    "commit_in_this_repository": "the commit that stands for a recorded one not in the "
    "repository (a branch's before its rebase; tests/test_results_files.py)",
    "git_head": "the commit (zoo's name for it)",
    "git_dirty_files": "files changed from that commit",
    "vramledger_path": "where the package was imported from (a checkout's path)",
    "vramledger_sources_sha256": "a hash of the package's files: changes with any edit",
    "vramledger_version": "the package's version string",
    "date": "when the result was made",
    "started": "when the run started",
    "measured_at": "when a group was measured (noise.py)",
    "machine": "the machine and its load (provenance.machine(), or a line of text)",
    "environment": "zoo's record of date, host, versions, commit and source hash",
    "host": "the machine's name",
    "python": "the interpreter's version",
    "command": "how the script was invoked (its output path among its options)",
}
"""Where and from what a result was made: never an answer."""

TIMING: dict[str, str] = {
    "seconds": "time taken (a plan's, a fit's, a trace's, a ledger's)",
    "search_seconds": "a plan's search time",
    "wall_seconds": "a process's wall time",
    "probe_seconds": "layout_plan.py's speed probe of the machine",
    "estimate_seconds": "an estimate's time",
    "trace_seconds": "a trace's time",
    "fit_seconds": "a fit's time",
    "estimate_samples": "every timed estimate (adapters_speed.py)",
    "fit_samples": "every timed fit (adapters_speed.py)",
    "estimate_ratio": "a ratio of two times (adapters_speed.py)",
    "fit_ratio": "a ratio of two times (adapters_speed.py)",
    "speedup": "a ratio of two times (speed.py)",
    "case_s": "a zoo case's time",
    "estimate_s": "a zoo estimate's time",
    "measure_s": "a zoo real run's time",
    "estimate_wall_s": "speed.py's estimate, wall time",
    "estimate_trace_s": "speed.py's estimate, trace time",
    "full_trace_s": "speed.py's full 80-layer trace time",
    "extended_trace_s": "speed.py's extended trace time",
    "memtracker_s_8_layers": "MemTracker's time (speed.py)",
    "memtracker_s_scaled_80": "MemTracker's time scaled to 80 layers (speed.py)",
    "seconds_per_spawn": "noise.py's time per spawn",
    "load_average": "the machine's load (speed figures depend on it)",
    "load_1min": "the machine's load before a run",
    "load_before": "the machine's load before the benchmark",
    "load_after": "the machine's load after the benchmark",
    "estimate_peak_rss_bytes": "the estimating process's own resident memory: the tool's cost, "
    "which varies with the allocator and the load, not a prediction",
    "workers": "processes the work ran in: one per CPU by default, a fact of the machine",
    "estimates": "re-estimates a plan or fit made: its work, not its answer (with workers "
    "running ahead, it depends on their number and timing)",
    "fit_estimates": "the same count in adapters_speed.py",
}
"""How fast a result was made and under what load: speed benchmarks' answers are compared,
their timings are not."""

IGNORED: dict[str, str] = {**PROVENANCE, **TIMING}
"""Keys left out of every comparison, wherever they occur, with why."""

NAMING_KEYS = (
    "case",
    "program",
    "model",
    "arch",
    "task",
    "variant",
    "gpu",
    "strategy",
    "offload",
    "optimizer",
    "precision",
    "world",
    "rank",
    "t",
)
"""Fields that name a row of a list: rows are paired by the values of those they have."""

CHECKOUT_FOLDERS = ("benchmarks", "examples", "src", "tests")
"""A result names files by absolute path (a spec's ``model``, ``inputs``, ``loss``): two checkouts
of the repository, before and after a change, name the same file under different roots. A path
through one of these top-level folders compares by its part from that folder on."""
CHECKOUT_PATH = re.compile(r"(?:/[^/\s\"':]+)+?/(?=(?:" + "|".join(CHECKOUT_FOLDERS) + r")/)")
"""The root of an absolute path into a checkout: the shortest prefix followed by one of
:data:`CHECKOUT_FOLDERS`."""
ABSENT = "(absent)"
SHOWN_CHARACTERS = 70
"""A value longer than this is cut in the table (its path says where to look)."""


@dataclass(frozen=True)
class Difference:
    """One answer that differs: where (a path into the result), before and after (``ABSENT``
    where only one result has it)."""

    path: str
    before: Any
    after: Any


def _row_name(row: Any) -> tuple[tuple[str, Any], ...] | None:
    if not isinstance(row, Mapping):
        return None
    named = tuple(
        (k, row[k]) for k in NAMING_KEYS if isinstance(row.get(k), str | int | float | bool)
    )
    return named or None


def _paired(before: list[Any], after: list[Any]) -> list[tuple[str, Any, Any]] | None:
    """Rows paired by name (``[case=..., rank=...]``) when every row of both lists is named,
    and distinctly; None otherwise (paired by position)."""
    names = [[_row_name(r) for r in rows] for rows in (before, after)]
    if any(n is None for side in names for n in side):
        return None
    if any(len(set(side)) != len(side) for side in names):
        return None
    old = dict(zip(names[0], before, strict=True))
    new = dict(zip(names[1], after, strict=True))
    return [
        (
            "[" + ", ".join(f"{k}={v}" for k, v in name) + "]",
            old.get(name, ABSENT),
            new.get(name, ABSENT),
        )
        for name in dict.fromkeys([*names[0], *names[1]])
    ]


def _same_scalar(before: Any, after: Any) -> bool:
    if isinstance(before, float) and isinstance(after, float):
        return before == after or (math.isnan(before) and math.isnan(after))
    if isinstance(before, str) and isinstance(after, str):
        return CHECKOUT_PATH.sub("<checkout>/", before) == CHECKOUT_PATH.sub("<checkout>/", after)
    return type(before) is type(after) and before == after


def differences(
    before: Any, after: Any, ignored: Mapping[str, str] = IGNORED, path: str = ""
) -> list[Difference]:
    """Every answer that differs between two results (JSON values), ``ignored`` keys left out."""
    if isinstance(before, Mapping) and isinstance(after, Mapping):
        out = []
        for key in dict.fromkeys([*before, *after]):
            if key in ignored:
                continue
            where = f"{path}.{key}" if path else str(key)
            out += differences(before.get(key, ABSENT), after.get(key, ABSENT), ignored, where)
        return out
    if isinstance(before, list) and isinstance(after, list):
        pairs = _paired(before, after)
        if pairs is None:
            width = max(len(before), len(after))
            pairs = [
                (f"[{i}]", *(rows[i] if i < len(rows) else ABSENT for rows in (before, after)))
                for i in range(width)
            ]
        out = []
        for where, b, a in pairs:
            out += differences(b, a, ignored, f"{path}{where}")
        return out
    if _same_scalar(before, after):
        return []
    return [Difference(path or "(the result)", before, after)]


def _shown(value: Any) -> str:
    text = value if value is ABSENT else json.dumps(value, default=str)
    return text if len(text) <= SHOWN_CHARACTERS else text[: SHOWN_CHARACTERS - 3] + "..."


def report(found: list[Difference], before_name: str, after_name: str) -> int:
    """Print the differences (a table), or that there are none; the exit status."""
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    console = Console(width=160, markup=False, highlight=False)
    if not found:
        console.print(
            f"compare: every answer the same as {before_name} (timings and provenance aside)"
        )
        return 0
    table = Table(title=f"answers that differ: {before_name} (before) -> {after_name} (after)")
    for column in ("field", "before", "after"):
        table.add_column(column, overflow="fold")
    for d in found:
        table.add_row(*(Text(x) for x in (d.path, _shown(d.before), _shown(d.after))))
    console.print(table)
    console.print(f"compare: {len(found)} answer(s) DIFFER from {before_name}")
    return ANSWERS_DIFFER


def _read(path: Path) -> Any:
    return json.loads(Path(path).read_text())


def compare(
    before: Path, after: Path | Any, ignored: Mapping[str, str] = IGNORED, after_name: str = ""
) -> int:
    """Compare result file ``before`` with ``after`` (a result file, or a result in memory: read
    back from its JSON), print the table; the exit status."""
    if isinstance(after, Path):
        after_name, after = after_name or str(after), _read(after)
    else:
        after = json.loads(json.dumps(after, default=str))
    return report(differences(_read(before), after, ignored), str(before), after_name or "this run")


def add_arguments(parser: argparse.ArgumentParser, out: bool = True) -> None:
    """``--compare OLD.json`` and ``--against NEW.json``, and (``out``) ``--out FILE`` for a
    script that has no option for where its result goes."""
    parser.add_argument(
        "--compare",
        metavar="OLD.json",
        type=Path,
        help="an earlier result of this benchmark: print every answer that differs from it "
        f"(timings and provenance aside) and exit {ANSWERS_DIFFER} if any does",
    )
    parser.add_argument(
        "--against",
        metavar="NEW.json",
        type=Path,
        help="with --compare: compare this result file with it instead of running the benchmark",
    )
    if out:
        parser.add_argument(
            "--out", metavar="FILE.json", type=Path, help="where the result goes (default: "
            "benchmarks/results/, named by benchmark, date and host)"
        )  # fmt: skip


def against_only(args: argparse.Namespace, ignored: Mapping[str, str] = IGNORED) -> int | None:
    """With ``--against``: the exit status of comparing the two files (nothing is run); else
    None."""
    if args.against is None:
        return None
    if args.compare is None:
        raise SystemExit("--against compares with --compare OLD.json: give both")
    return compare(args.compare, args.against, ignored)


def after_run(
    args: argparse.Namespace, result: Path | Any, ignored: Mapping[str, str] = IGNORED
) -> int:
    """With ``--compare``: the exit status of comparing the run's result with it; else 0."""
    if args.compare is None:
        return 0
    return compare(args.compare, result, ignored)
