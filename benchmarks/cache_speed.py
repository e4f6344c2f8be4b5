"""The cache's speed on Llama-3-70B: ``estimate``, ``fit`` and ``plan`` cold, repeated, and asked
again for another margin and another GPU, each a fresh ``python -m vramledger`` process timed from
start to exit.

    python benchmarks/cache_speed.py                 # all three, ~15 minutes on 2 busy cores
    python benchmarks/cache_speed.py --cases estimate,fit

For each case, in a cache folder of its own (``VRAMLEDGER_CACHE_DIR``):

- **cold**: the command with an empty cache (every trace made);
- **warm**: the same command again: the answer is read from the cache (``answer_cache.py``)
  before torch is imported; its answer must be the cold run's, timings aside (a replay gives
  this call's timings and an ``answer_cache`` field);
- **other margin**: the command with ``--margin 4GiB``: a new question. An ``estimate`` is made
  from the kept answer of the cold one (``ledger/other_gpu.py``) before torch is imported; a ``fit`` or
  ``plan`` runs, its traces read from the trace cache (``trace/core/cache.py``) where it asks for the
  same ones;
- **other GPU**: the command for an H200 instead of an H100 (same compute capability), the same
  way;
- **... --no-cache**: those two questions with no cache at all; their JSON must equal the
  cached ones' field for field (timings and the ``answer_cache`` field aside).

Each run's ``answered_from`` says which cache answered it: ``answer cache`` (a replay),
``answer cache, other GPU or margin`` (other_gpu.py), or ``command`` (the command ran; the trace
cache applies within it).

Targets: issue 22's, a warm 70B estimate, fit or plan in at most 2 s of wall time, process start
included; a cold 70B fit in at most 8 s; a cold 70B 64-GPU plan in at most 40 s. Issue 32's: an
estimate whose traces are cached (another margin, another GPU of the same compute capability)
in at most 1.5 s, without importing transformers. The machine's load average is recorded before
each run (the development VM is shared). Results go to
benchmarks/results/cache-speed-<date>-<host>-<commit>.json (``--out``); ``--compare`` an earlier
one compares the answers (the commands, whether the outputs agree), not the times
(``benchkit/compare.py``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchkit import compare
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent
MODEL = str(ROOT / "examples" / "configs" / "llama-3-70b.json")
SPEC = ["--seq-len", "4096", "--precision", "bf16-master", "--world-size", "64"]
CASES = {
    "estimate": ["estimate", MODEL, *SPEC, "--strategy", "fsdp", "--grad-checkpointing"],
    "fit": ["fit", MODEL, *SPEC, "--strategy", "fsdp", "--checkpointing", "on"],
    "plan": ["plan", MODEL, "--gpus", "64", "--seq-len", "8192"],
}
"""The 70B questions: ``benchmarks/fit.py``'s FSDP2 run over 64 GPUs (estimate and fit, with
activation checkpointing) and ``benchmarks/layout_plan.py``'s plan on up to 64 GPUs."""
GPU, OTHER_GPU = "h100-80gb", "h200"
OTHER_MARGIN = ["--margin", "4GiB"]
"""The other margin asked (the default is 2 GiB, ``verdict.DEFAULT_MARGIN``)."""
TARGETS = {("estimate", "warm"): 2.0, ("fit", "warm"): 2.0, ("plan", "warm"): 2.0}
TARGETS.update({("fit", "cold"): 8.0, ("plan", "cold"): 40.0})
TARGETS.update({("estimate", "other margin"): 1.5, ("estimate", "other GPU"): 1.5})
"""Issue 22's and issue 32's targets, seconds of wall time including process start."""
TIMINGS = {"seconds", "search_seconds", "workers", "answer_cache"}
"""What differs between a cached and an uncached answer that is not the answer: timings, and
the answer cache's own field."""
IGNORED = {**compare.IGNORED, "targets": "verdicts on times, not answers"}
"""What ``--compare`` leaves out: the shared keys and the speed targets met or missed."""


def without_timings(value):
    if isinstance(value, dict):
        return {k: without_timings(v) for k, v in value.items() if k not in TIMINGS}
    if isinstance(value, list):
        return [without_timings(v) for v in value]
    return value


def timed(args: list[str], cache: str) -> dict:
    env = {**os.environ, "VRAMLEDGER_CACHE_DIR": cache}
    env.pop("VRAMLEDGER_NO_CACHE", None)
    load = os.getloadavg()[0]
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "vramledger", *args, "--json"],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        check=False,
    )
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(args)} failed:\n{done.stderr}")
    about = json.loads(done.stdout).get("answer_cache")
    answered_from = (
        "command"
        if about is None
        else "answer cache, other GPU or margin"
        if "made_for" in about
        else "answer cache"
    )
    return {
        "wall_seconds": round(wall, 2),
        "load_1min": load,
        "answered_from": answered_from,
        "stdout": done.stdout,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(CASES))
    compare.add_arguments(parser)
    args = parser.parse_args()
    if (status := compare.against_only(args, IGNORED)) is not None:
        return status
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT
    ).stdout.strip()
    rows = []
    for name in args.cases.split(","):
        base = CASES[name]
        with tempfile.TemporaryDirectory(prefix="vramledger-bench-cache-") as cache:
            margin = [*base, "--gpu", GPU, *OTHER_MARGIN]
            other = [*base, "--gpu", OTHER_GPU]
            runs = {
                "cold": timed([*base, "--gpu", GPU], cache),
                "warm": timed([*base, "--gpu", GPU], cache),
                "other margin": timed(margin, cache),
                "other GPU": timed(other, cache),
                "other margin, --no-cache": timed([*margin, "--no-cache"], cache),
                "other GPU, --no-cache": timed([*other, "--no-cache"], cache),
            }
        answers = {k: without_timings(json.loads(v["stdout"])) for k, v in runs.items()}
        row = {
            "case": name,
            "command": " ".join(["vramledger", *base, "--gpu", GPU, "--json"]).replace(
                str(ROOT) + "/", ""
            ),
            "warm_output_is_cold_output": answers["warm"] == answers["cold"],
            "cached_equals_uncached": all(
                answers[k] == answers[f"{k}, --no-cache"] for k in ("other margin", "other GPU")
            ),
            "runs": {
                k: {x: v[x] for x in ("wall_seconds", "load_1min", "answered_from")}
                for k, v in runs.items()
            },
        }
        for (case, kind), target in TARGETS.items():
            if case == name:
                row.setdefault("targets", {})[kind] = {
                    "seconds": target,
                    "met": runs[kind]["wall_seconds"] <= target,
                }
        rows.append(row)
        print(json.dumps(row), flush=True)

    table = Table(title=f"cache speed, Llama-3-70B ({datetime.date.today()}, {platform.node()})")
    shown = ("cold", "warm", "other margin", "other GPU", "other GPU, --no-cache")
    for col in ("case", *shown, "targets", "same"):
        table.add_column(col, justify="left" if col in ("case", "targets") else "right")
    short = {
        "command": "",
        "answer cache": ", answers",
        "answer cache, other GPU or margin": ", ledger",
    }
    for row in rows:
        r = row["runs"]
        targets = ", ".join(
            f"{kind} <= {t['seconds']:g} s: {'met' if t['met'] else 'MISSED'}"
            for kind, t in row.get("targets", {}).items()
        )
        table.add_row(
            row["case"],
            *(
                f"{r[k]['wall_seconds']:.2f} s (load {r[k]['load_1min']:.1f}"
                f"{short[r[k]['answered_from']]})"
                for k in shown
            ),
            targets,
            "yes" if row["warm_output_is_cold_output"] and row["cached_equals_uncached"] else "NO",
        )
    Console().print(table)
    print("answers: a replay from the answer cache; ledger: made from an earlier answer's ledger")
    out = ROOT / "benchmarks" / "results"
    path = args.out or out / f"cache-speed-{datetime.date.today()}-{platform.node()}-{commit}.json"
    path.write_text(
        json.dumps(
            {
                "commit": commit,
                "machine": f"{platform.node()}, {os.cpu_count()} CPUs, {platform.machine()}",
                "python": platform.python_version(),
                "rows": rows,
            },
            indent=2,
        )
        + "\n"
    )
    print(f"wrote {path}")
    return compare.after_run(args, path, IGNORED)


if __name__ == "__main__":
    raise SystemExit(main())
