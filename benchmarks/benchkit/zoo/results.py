"""Totals, triage of failures by cause, the table and the environment of a sweep."""

from __future__ import annotations

import datetime
import hashlib
import os
import platform
import re
import subprocess
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from .settings import HERE, TARGET_ESTIMATED, TARGET_WITHIN, WITHIN

RUN_STATUSES = (
    "ok",
    "off",
    "estimate failed",
    "measure failed",
    "both failed",
    "timeout",
    "crashed",
)


def totals(records: list[dict[str, Any]]) -> dict[str, Any]:
    cases = {(r["arch"], r["task"]) for r in records}
    skipped = {(r["arch"], r["task"]) for r in records if r["status"] == "skipped"}
    unsupported = {(r["arch"], r["task"]) for r in records if r["status"] == "unsupported task"}
    runs = [r for r in records if r["status"] in RUN_STATUSES]
    estimated = [r for r in runs if "estimate_bytes" in r]
    compared = [r for r in runs if "error" in r]
    within = [r for r in compared if abs(r["error"]) <= WITHIN]
    archs = {r["arch"] for r in records}
    archs_built = {r["arch"] for r in records if r["status"] != "skipped"}
    return {
        "architectures": len(archs),
        "architectures_built": len(archs_built),
        "cases": len(cases),
        "cases_built": len(cases) - len(skipped),
        "cases_skipped": len(skipped),
        "skip_reasons": dict(
            Counter(r["reason"] for r in records if r["status"] == "skipped").most_common()
        ),
        "cases_unsupported_task": len(unsupported),
        "unsupported_tasks": dict(
            Counter(r["task"] for r in records if r["status"] == "unsupported task").most_common()
        ),
        "runs": len(runs),
        "runs_by_status": dict(Counter(r["status"] for r in runs).most_common()),
        "estimated": len(estimated),
        "estimated_share": _share(len(estimated), len(runs)),
        "measured": sum("measured_bytes" in r for r in runs),
        "compared": len(compared),
        "within": len(within),
        "within_share_of_compared": _share(len(within), len(compared)),
        "within_share_of_runs": _share(len(within), len(runs)),
        "target_estimated": TARGET_ESTIMATED,
        "target_within": TARGET_WITHIN,
        "within_tolerance": WITHIN,
    }


def _share(n: int, d: int) -> float | None:
    return n / d if d else None


def failure_cause(r: dict[str, Any]) -> str:
    """A grouping key for a failed run: what went wrong, without the parts that name one model
    (module paths, quoted names, numbers)."""
    if r["status"] == "skipped":
        return f"skipped: {r['reason']}"
    if r["status"] in ("timeout", "crashed"):
        return f"{r['status']}: {_normalise(r.get('detail', ''))}"
    if r["status"] == "off":
        return f"estimate off by > {100 * WITHIN:.1f} %"
    est, real = r.get("estimate_error"), r.get("measure_error")
    plain = r.get("plain_step_error")
    if plain and plain["type"] == "InputError":  # vramledger's own batch maker, not the model
        plain = None
    same = plain and any(_same_error(plain, e) for e in (est, real) if e)
    if same:
        return (
            "the model does not train on these inputs with any shrunk config (a plain PyTorch "
            f"step fails too): {_normalise(plain['message'])}"
        )
    who = "estimate and real run" if est and real else "estimate" if est else "real run only"
    err = est or real
    frame = err.get("model_frame")
    at = f" (at {frame.split(':')[0]} {frame.split(' ')[1].rstrip(':')})" if frame else ""
    if err.get("operator"):  # where the model called it: the group's ``sites``
        why = re.sub(r".*?operator \S+ (.*?) \(in module.*", r"\1", err["message"])
        return f"{who}: {err['type']}: operator {err['operator']} {why}"
    if err.get("vramledger_error"):
        return f"{who}: {err['type']}: {_normalise(err['message'])}"
    return f"{who}: {_normalise(err['message'])}{at}"  # the message names the type


def _same_error(plain: dict[str, Any], err: dict[str, Any]) -> bool:
    """Whether vramledger failed the way the plain step did (the same exception text)."""
    text = plain["message"].split(": ", 1)[-1][:80]
    return bool(text) and text in err.get("message", "")


def _normalise(text: str) -> str:
    text = text.strip().splitlines()[0] if text.strip() else ""
    text = re.sub(r"/\S+", "PATH", text)
    text = re.sub(r"in module [^\s:)]+", "in module M", text)
    text = re.sub(r"\bthe [\w.-]+ config\b", "the … config", text)
    text = re.sub(r"\bcalling \w+ with\b", "calling … with", text)
    text = re.sub(r"'\w*(Config|Model|For\w+|Layer|Attention|Block|MLP)\w*'", "'…'", text)
    text = re.sub(r"\b\d+(\.\d+)?\b", "N", text)
    text = re.sub(r"\[[^\]]*\]", "[…]", text)
    return text[:160]


def _sites(errors: list[dict[str, Any]]) -> list[str]:
    """The distinct lines of model code the errors were raised from (the same line copied into
    several models once, with the first file that has it), most common first."""
    lines: dict[str, list[str]] = {}
    for e in errors:
        frame = e.get("model_frame")
        if frame:
            where, _, code = frame.partition(": ")
            lines.setdefault(code, []).append(where)
    ranked = sorted(lines.items(), key=lambda kv: -len(kv[1]))
    return [f"{code} ({wheres[0]}; {len(wheres)} runs)" for code, wheres in ranked]


def triage(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Failures grouped by cause, most common first: the cases, the modules named, one example
    line, and the errors of runs that were compared."""
    groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in records:
        if r["status"] not in ("ok", "unsupported task"):
            groups[failure_cause(r)].append(r)
    out = []
    for cause, rs in sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        errors = [r.get("estimate_error") or r.get("measure_error") or {} for r in rs]
        first, first_error = rs[0], errors[0]
        line = first_error.get("one_line") or first.get("detail", "")
        if first_error.get("model_frame"):
            line = f"{line} [model code: {first_error['model_frame']}]"
        elif first_error and not first_error.get("vramledger_error") and first_error.get("where"):
            line = f"{line} (at {first_error['where'][-1]})"
        if cause.startswith("the model does not train"):
            line = f"plain step: {first['plain_step_error']['message']} | vramledger: {line}"
        out.append(
            {
                "cause": cause,
                "runs": len(rs),
                "cases": sorted({f"{r['arch']}:{r['task']}" for r in rs}),
                "modules": sorted({e["module"] for e in errors if e.get("module")}),
                "sites": _sites(errors),
                "example": f"{first['arch']}:{first['task']} {first['precision']}/"
                f"{first['variant']}: {line}"
                if line
                else "",
                "errors": {
                    f"{r['arch']}:{r['task']} {r['precision']}/{r['variant']}": r["error"]
                    for r in rs
                    if "error" in r
                },
            }
        )
    return out


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.2f} MiB"


def table(records: list[dict[str, Any]]) -> str:
    cols = ("architecture", "task", "precision", "dtype", "status", "estimate", "measured", "error")
    rows = []
    for r in records:
        err = r.get("error")
        rows.append(
            (
                r["arch"],
                r["task"],
                r["precision"],
                r["variant"],
                r["status"],
                _mib(r.get("estimate_bytes")),
                _mib(r.get("measured_bytes")),
                "-" if err is None else f"{100 * err:+.4f} %",
            )
        )
    widths = [
        max(len(c), *(len(row[i]) for row in rows)) if rows else len(c) for i, c in enumerate(cols)
    ]
    right = {5, 6, 7}

    def fmt(row: tuple[str, ...]) -> str:
        return "  ".join(
            cell.rjust(w) if i in right else cell.ljust(w)
            for i, (cell, w) in enumerate(zip(row, widths, strict=True))
        ).rstrip()

    return "\n".join([fmt(cols), fmt(tuple("-" * w for w in widths)), *map(fmt, rows)])


def distributed_table(results: list[dict[str, Any]]) -> str:
    lines = [
        "per-rank sample (fp32 AdamW, world size 2, gloo): each rank's estimate against the "
        "tracker's count of its real run (the status), and against its allocator count "
        "(profiler events, which miss frees on gloo's threads)"
    ]
    for r in results:
        head = f"  {r['arch']}:{r['task']} {r['strategy']}: {r['status']}"
        if "per_rank" in r:
            ranks = "; ".join(
                f"rank {k} est {_mib(v['estimate'])} tracked {_mib(v['tracked'])} "
                f"({100 * v['error_vs_tracked']:+.3f} %), allocator {_mib(v['measured'])} "
                f"({100 * v['error']:+.3f} %)"
                for k, v in sorted(r["per_rank"].items())
            )
            head += f" — {ranks}"
        else:
            err = r.get("estimate_error") or r.get("measure_error") or {}
            head += f" — {err.get('message') or r.get('detail', '')}"
        lines.append(head)
    return "\n".join(lines)


def summary(result: dict[str, Any]) -> str:
    t = result["totals"]
    pct = lambda x: "-" if x is None else f"{100 * x:.1f} %"  # noqa: E731
    lines = [
        f"architectures: {t['architectures']} ({t['architectures_built']} built); "
        f"(architecture, head) cases: {t['cases']}, built {t['cases_built']}, "
        f"skipped {t['cases_skipped']} {t['skip_reasons']}",
        f"unsupported task (built, not run): {t['cases_unsupported_task']} {t['unsupported_tasks']}",
        f"runs (case x precision x dtype variant): {t['runs']} {t['runs_by_status']}",
        f"estimated without error: {t['estimated']}/{t['runs']} = {pct(t['estimated_share'])} "
        f"(target {100 * TARGET_ESTIMATED:.0f} %)",
        f"within {100 * WITHIN:.1f} % of the real run: {t['within']}/{t['compared']} compared = "
        f"{pct(t['within_share_of_compared'])}; of all runs {t['within']}/{t['runs']} = "
        f"{pct(t['within_share_of_runs'])} (target {100 * TARGET_WITHIN:.0f} %)",
        f"took {result['seconds'] / 60:.1f} min with {result['workers']} workers",
        "",
        "failures by cause (most common first):",
    ]
    for g in result["triage"]:
        lines.append(f"  [{g['runs']} runs, {len(g['cases'])} cases] {g['cause']}")
        lines.append(f"      cases: {', '.join(g['cases'])}")
        if g["modules"]:
            lines.append(f"      modules: {', '.join(g['modules'][:12])}")
        for site in g.get("sites", [])[:6]:
            lines.append(f"      at: {site}")
        if g["example"]:
            lines.append(f"      e.g. {_one_line(g['example'])}")
        if g["errors"]:
            shown = sorted(g["errors"].items(), key=lambda kv: -abs(kv[1]))[:20]
            lines.append("      " + ", ".join(f"{k} {100 * v:+.3f} %" for k, v in shown))
    return "\n".join(lines)


def _one_line(text: str, limit: int = 400) -> str:
    text = " ⏎ ".join(ln.strip() for ln in text.strip().splitlines())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def environment() -> dict[str, Any]:
    import torch
    import transformers

    import vramledger

    def git(*args: str) -> str:
        done = subprocess.run(
            ["git", *args], cwd=HERE.parent, capture_output=True, text=True, check=False
        )
        return done.stdout.strip()

    package = Path(vramledger.__file__).parent
    digest = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        digest.update(path.relative_to(package).as_posix().encode() + b"\0" + path.read_bytes())
    return {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "host": platform.node(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "vramledger": vramledger.__version__,
        "git_head": git("rev-parse", "HEAD"),
        "git_dirty_files": git("status", "--porcelain", "--", "src").splitlines(),
        "vramledger_path": str(package),
        "vramledger_sources_sha256": digest.hexdigest(),
        "cpus": os.cpu_count(),
    }
