"""Where a benchmark result comes from: the commit of the code it ran, the machine and its load,
and the file it is written to (``benchmarks/results/NAME-DATE-HOST-COMMIT.json``)."""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
EXPORTED_COMMIT = "VRAMLEDGER_COMMIT"
"""An exported tree (``git archive``) has no repository: its commit is given in this variable."""


def commit() -> str:
    """The checkout's commit, with ``+dirty`` when tracked files differ from it. Read it before
    the benchmark runs: others may commit meanwhile."""
    git = ["git", "-C", str(ROOT)]
    head = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True).stdout
    if not head.strip():
        return os.environ.get(EXPORTED_COMMIT, "unknown")
    dirty = subprocess.run(
        [*git, "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True
    ).stdout
    return head.strip() + ("+dirty" if dirty.strip() else "")


def _cpu_model() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def machine(note: str | None = None) -> dict[str, Any]:
    """The machine and its load when the result was taken (speed figures depend on both)."""
    import torch

    facts: dict[str, Any] = {
        "host": platform.node(),
        "platform": platform.platform(),
        "processor": _cpu_model(),
        "cpus": os.cpu_count(),
        "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
    }
    if note:
        facts["note"] = note
    return facts


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def result_path(name: str, commit_id: str | None = None, suffix: str = ".json") -> Path:
    """``benchmarks/results/NAME-DATE-HOST[-COMMIT7]SUFFIX``, the folder made if needed."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    parts = [name, str(datetime.date.today()), platform.node() or "host"]
    if commit_id:
        parts.append(commit_id[:7])
    return RESULTS / ("-".join(parts) + suffix)
