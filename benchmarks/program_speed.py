"""Speed and memory of `vramledger run` on programs that build a Llama-3-70B-shaped model.

    python benchmarks/program_speed.py            # two programs, about a minute on 2 cores
    python benchmarks/program_speed.py --full     # also trace every block (the reference)

Issue 20, "Speed": a program that builds a Llama-3-70B-shaped model answers in <= 15 s here,
with peak resident memory <= 2 GiB, using the block extension where the model allows it.
Programs (tests/programs/, ordinary scripts that run unchanged on a CUDA machine):

- ``hf-llama-70b``: transformers' ``LlamaForCausalLM(config)`` from examples/configs/
  llama-3-70b.json, ``.to("cuda", torch.bfloat16)``, AdamW, three steps on 1 x 1024 random
  tokens (``llama_from_config.py``);
- ``plain-70b``: a decoder written in the script in plain PyTorch, 80 blocks of width 8192,
  fp32, ``.cuda()``, AdamW, three steps on 1 x 1024 tokens (``plain_deep.py``): 66.5 B
  parameters.

Each runs as `vramledger run --json -- PROGRAM ...` in a fresh process, timed from the process
start (``wall_s``, with the CPU seconds it used, ``cpu_s``: on a shared machine the wall time
depends on its load, which is recorded) with its peak resident memory (``getrusage`` of the
child, ``max_rss_bytes``). ``--full`` runs each once more with the extension turned off (the
trace of every block), which must give the same peak. Results go to
benchmarks/results/program-speed-<date>-<host>-<commit>.json (``--out``) with the date, commit
and machine.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchkit import compare, provenance
from rich.console import Console
from rich.table import Table

HERE = Path(__file__).parent
ROOT = HERE.parent
PROGRAMS = ROOT / "tests" / "programs"
CASES = {
    "hf-llama-70b": [
        str(PROGRAMS / "llama_from_config.py"),
        str(ROOT / "examples" / "configs" / "llama-3-70b.json"),
        "1024",
    ],
    "plain-70b": [str(PROGRAMS / "plain_deep.py"), "80", "8192", "64", "128256", "1024"],
}
TARGET_SECONDS = 15.0
"""Issue 20's target for the wall time, process start included."""
TARGET_RSS_BYTES = 2 * 1024**3
"""Issue 20's target for the peak resident memory."""

FULL = """
import sys
import vramledger.predict.program as p
from vramledger.cli import main
from vramledger.trace.program.program_trace import trace_program
p.trace_program_blocks = trace_program
sys.exit(main(sys.argv[1:]))
"""
"""`vramledger` with the block extension turned off: every block traced."""


KIB = 1024
"""``ru_maxrss`` is in KiB on Linux (getrusage(2))."""

IGNORED = {
    **compare.IGNORED,
    "wall_s": "a program's wall time, from process start",
    "cpu_s": "a program's CPU time",
    "max_rss_bytes": "the process's peak resident memory (a speed target, not an answer)",
}
"""Keys left out of ``--compare``: the answer is each case's peak bytes and how it was traced."""


def run_case(argv: list[str], full: bool) -> dict:
    """One fresh process: its answer, wall and CPU seconds, and peak resident memory."""
    launcher = ["-c", FULL] if full else ["-m", "vramledger"]
    command = [sys.executable, *launcher, "run", "--json", "--", *argv]
    start = time.perf_counter()
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        process = subprocess.Popen(command, stdout=out, stderr=err)
        # wait4: this child's own usage (RUSAGE_CHILDREN's peak RSS is the largest child so far)
        _, status, usage = os.wait4(process.pid, 0)
        wall = time.perf_counter() - start
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read().decode(), err.read().decode()
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{stderr[-3000:]}")
    answer = json.loads(stdout)
    extended = next((n for n in answer["notes"] if n.startswith("traced ")), None)
    return {
        "command": " ".join(["vramledger", "run", "--json", "--", *argv]),
        "full": full,
        "wall_s": round(wall, 2),
        "cpu_s": round(usage.ru_utime + usage.ru_stime, 2),
        "max_rss_bytes": usage.ru_maxrss * KIB,
        "peak_bytes": answer["peak_bytes"],
        "program_peak_bytes": answer["program_peak_bytes"],
        "parameters": answer["parameters"],
        "blocks_extended": bool(extended and extended.startswith("traced 4 and 5")),
        "how": extended or "traced in one run",
        "trace_seconds": answer["seconds"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--full", action="store_true", help="also trace every block")
    compare.add_arguments(parser)
    args = parser.parse_args()
    if (status := compare.against_only(args, IGNORED)) is not None:
        return status
    commit = provenance.commit()
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    rows = []
    for name, argv in CASES.items():
        for full in (False, True) if args.full else (False,):
            rows.append({"case": name, **run_case(argv, full)})
    table = Table(title="vramledger run on Llama-3-70B-shaped programs")
    for column in ("case", "blocks", "wall s", "cpu s", "max RSS", "peak bytes", "targets"):
        table.add_column(column, justify="left" if column in ("case", "blocks") else "right")
    for row in rows:
        met = row["wall_s"] <= TARGET_SECONDS and row["max_rss_bytes"] <= TARGET_RSS_BYTES
        table.add_row(
            row["case"],
            "every block" if row["full"] else "extended" if row["blocks_extended"] else "all",
            f"{row['wall_s']:.1f}",
            f"{row['cpu_s']:.1f}",
            f"{row['max_rss_bytes'] / 1024**3:.2f} GiB",
            f"{row['peak_bytes']:,}",
            "met" if met else "MISSED",
        )
    Console(width=120).print(table)
    out = args.out or provenance.result_path("program-speed", commit)
    out.write_text(
        json.dumps(
            {
                "date": provenance.now(),
                "commit": commit,
                "machine": provenance.machine(),
                "targets": {"wall_s": TARGET_SECONDS, "max_rss_bytes": TARGET_RSS_BYTES},
                "rows": rows,
            },
            indent=1,
        )
        + "\n"
    )
    print(f"written to {out}")
    return compare.after_run(args, out, IGNORED)


if __name__ == "__main__":
    sys.exit(main())
