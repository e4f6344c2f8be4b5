"""The patch registry's check (``vramledger compat``) as terminal tables."""

from __future__ import annotations

from rich.console import Group
from rich.table import Table
from rich.text import Text

from vramledger.inputs.patch_check import PatchCheck, PatchReport

STATUS_STYLES = {
    "present": "green",
    "missing": "bold red",
    "absent": "yellow",
    "not installed": "dim",
    "untested version": "yellow",
}
"""How each status is drawn."""
SUMMARY_STATUSES = ("present", "absent", "missing")
"""The statuses counted in a column of their own in the packages' table."""


def _packages_table(result: PatchReport) -> Table:
    table = Table(title="patched packages", title_justify="left")
    for col in ("package", "installed", "tested range", "patches", *SUMMARY_STATUSES):
        table.add_column(col, justify="right" if col in ("patches", *SUMMARY_STATUSES) else "left")
    for package, about in result.packages().items():
        statuses = about["statuses"]
        if about["version"] is None:
            installed = Text("not installed", style=STATUS_STYLES["not installed"])
        elif about["in_range"] is False:
            installed = Text(
                f"{about['version']} (untested)", style=STATUS_STYLES["untested version"]
            )
        else:
            installed = Text(about["version"])
        table.add_row(
            package,
            installed,
            about["tested_range"] or "none declared",
            str(about["patches"]),
            *(str(statuses.get(s, 0)) for s in SUMMARY_STATUSES),
        )
    return table


def _patches_table(checks: list[PatchCheck], title: str) -> Table:
    table = Table(title=title, title_justify="left")
    for col in ("status", "target", "package", "by", "why"):
        table.add_column(col)
    for check in checks:
        patch = check.patch
        why = patch.reason if check.status in ("present", "not installed") else check.detail
        table.add_row(
            Text(check.status, style=STATUS_STYLES[check.status]),
            patch.target,
            patch.package,
            patch.by,
            why or patch.reason,
        )
    return table


def patch_table(result: PatchReport, *, every: bool = False) -> Group:
    """The packages' table, then the patches that are not present (every patch with
    ``every``), then one line: whether every target of an installed package in its tested range
    resolves."""
    parts: list[object] = [_packages_table(result)]
    shown = [c for c in result.checks if every or c.status != "present"]
    if shown:
        title = "every patch" if every else "patches not present"
        parts.append(_patches_table(shown, title))
    failed = result.failed
    if failed:
        line = (
            f"{len(failed)} of {len(result.checks)} patched targets missing: vramledger replaces "
            "them, and the installed libraries, in their tested ranges, no longer have them"
        )
    else:
        line = (
            f"{len(result.checks)} patched targets: every one of an installed package in its "
            "tested range resolves"
        )
    parts.append(Text(line, style=STATUS_STYLES["missing" if failed else "present"]))
    return Group(*parts)
