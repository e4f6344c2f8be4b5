"""Run-to-run spread of the real multi-process runs the tests compare predictions with.

    python benchmarks/noise.py [--spawns 4] [--repeats 5]
        [--groups gloo-2,gloo-4,deepspeed-2,deepspeed-4,library] [--cases NAME,...]
        [--json benchmarks/results/noise-DATE-vm.json]
    python benchmarks/noise.py --merge A.json B.json ... --json benchmarks/results/noise-DATE-vm.json

Each group is the test's own cases (``tests/mesh_real.py``, ``tests/test_deepspeed_real.py``,
``tests/test_library_loops.py``) run ``--spawns`` times with fresh processes, each spawn running
every case ``--repeats`` times in turn (round 1 in the test's order, as one test run makes it;
the later rounds in the same processes, which saves the start-up that is most of a spawn's
time on 2 cores): spawns x repeats real runs of each case. For every case and rank it records each
run's count by the CPU allocator (``cpu_allocator_count``, every thread), the storage tracker's
count where the run has one, and the prediction (``vramledger.estimate``, made once), and sums
them up as the spread (max - min) and the largest distance of any run from the prediction. The
named allowances in the tests cite these figures. The JSON is rewritten after every run, so an
interrupted measurement keeps what it has; groups already in the file and not run again are kept.
``--merge`` joins the files of invocations run side by side (each on some of a group's cases)
into one, the summaries made again over all their runs. ``--compare`` an earlier result compares
its predictions (``benchkit/compare.py``): the real runs' counts are what this script measures
the spread of, different from run to run by nature (``MEASURED``).

``benchmarks/results/noise-2026-12-02-vm.json`` was made with (on this 2-core VM, with other
work running): ``--groups gloo-2,gloo-4`` on the data-parallel cases, 2 spawns x 10;
``--groups deepspeed-2,deepspeed-4 --spawns 1 --repeats 20``; ``--groups library``, 2 x 10;
the tensor/expert/pipeline cases 1 x 4, 1 x 8 and 1 x 8 (20 runs); then ``--merge``. Its
``isa_emulation`` key holds the runs behind ``docs/test-bounds.md``'s "Why two tests failed on
another machine".
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT))

from benchkit import compare, provenance  # noqa: E402

GROUPS = ("gloo-2", "gloo-4", "deepspeed-2", "deepspeed-4", "library")
MEASURED = {
    "runs": "every real run's counts (and, in a summary row, how many runs)",
    "counted_min": "the real runs' counts",
    "counted_max": "the real runs' counts",
    "counted_spread": "the real runs' counts",
    "distinct_counts": "the real runs' counts",
    "counted_minus_predicted": "the real runs' counts",
    "worst_bytes_from_prediction": "the real runs' counts",
    "counted_minus_tracked_min": "the real runs' counts",
    "counted_minus_tracked_max": "the real runs' counts",
    "failures": "spawns that failed",
    "invocations": "the merged invocations' own times, commits and runs",
    "isa_emulation": "runs of docs/test-bounds.md's CPU-emulation check",
}
"""What ``--compare`` leaves out besides the shared keys: what the real runs counted, whose
spread is this benchmark's subject. The predictions are compared."""
IGNORED = {**compare.IGNORED, **MEASURED}


def _run_spawn(
    group: str, workdir: Path, repeats: int, only: set[str] | None
) -> list[dict[str, dict[int, dict[str, Any]]]]:
    """One spawn of the group's cases, each run ``repeats`` times: per round, case -> rank ->
    counts."""
    kind, _, world_text = group.partition("-")
    keep = (lambda case: True) if not only else (lambda case: case in only)
    rounds: list[dict[str, dict[int, dict[str, Any]]]] = [{} for _ in range(repeats)]
    if kind == "gloo":
        from tests import mesh_real
        from vramledger.measure.local import measure_on_local_gloo

        world = int(world_text)
        cases = {c: s for c, s in mesh_real.world_cases(world).items() if keep(c)}
        real = measure_on_local_gloo(
            world, {f"{c}#{i}": s for i in range(repeats) for c, s in cases.items()}
        )
        for key, ranks in real.items():
            case, _, i = key.partition("#")
            rounds[int(i)][case] = {r: {"tracked": t, "counted": c} for r, (t, c) in ranks.items()}
        return rounds
    if kind == "deepspeed":
        from tests import test_deepspeed_real as ds

        world = int(world_text)
        cases = [c for c in ds.CASES if keep(c)]
        for i, real in enumerate(ds.run_real(world, ds._configs(workdir), cases, repeats)):
            rounds[i] = {
                case: {
                    r: {"tracked": t, "counted": c, "counted_phases": phases}
                    for r, (t, c, phases) in ranks.items()
                }
                for case, ranks in real.items()
            }
        return rounds
    if kind == "library":
        from tests import test_library_loops as loops

        for i, real in enumerate(loops.run_all(repeats, only)):
            rounds[i] = {
                case: {r: {"counted": c} for r, c in ranks.items()} for case, ranks in real.items()
            }
        return rounds
    raise SystemExit(f"unknown group {group!r}; one of {', '.join(GROUPS)}")


def _predictions(group: str, workdir: Path, only: set[str] | None) -> dict[str, dict[int, int]]:
    from vramledger import estimate

    kind, _, world_text = group.partition("-")
    if kind == "gloo":
        from tests import mesh_real

        specs = mesh_real.world_cases(int(world_text))
    elif kind == "deepspeed":
        from tests import test_deepspeed_real as ds

        configs = ds._configs(workdir)
        specs = {c: ds._spec(c, int(world_text), configs) for c in ds.CASES}
    else:
        from tests import test_library_loops as loops

        specs = {c: case.spec for c, case in loops.CASES.items()}
    out = {}
    for case, spec in specs.items():
        if only and case not in only:
            continue
        ledger = estimate(spec) if not isinstance(spec, dict) else estimate(**spec)
        out[case] = {r: led.peak_bytes for ids, led in ledger.ranks for r in ids}
    return out


def _summary(runs: list[dict], predicted: dict[str, dict[int, int]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    cases = list(dict.fromkeys(case for run in runs for case in run))
    for case in cases:
        with_case = [run[case] for run in runs if case in run]
        for rank in sorted(with_case[0], key=int):
            counted = [ranks[rank]["counted"] for ranks in with_case]
            row: dict[str, Any] = {
                "runs": len(counted),
                "counted_min": min(counted),
                "counted_max": max(counted),
                "counted_spread": max(counted) - min(counted),
                "distinct_counts": len(set(counted)),
            }
            want = predicted.get(case, {}).get(int(rank))
            if want is not None:
                row["predicted"] = want
                row["counted_minus_predicted"] = sorted({c - want for c in counted})
                row["worst_bytes_from_prediction"] = (
                    max(counted, key=lambda c: abs(c - want)) - want
                )
            tracked = [ranks[rank].get("tracked") for ranks in with_case]
            if all(t is not None for t in tracked):
                gaps = [c - t for c, t in zip(counted, tracked, strict=True)]
                row["counted_minus_tracked_min"] = min(gaps)
                row["counted_minus_tracked_max"] = max(gaps)
            out[f"{case} rank {rank}"] = row
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spawns", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--groups", default=",".join(GROUPS))
    parser.add_argument("--cases", default="", help="only these cases (default: all)")
    parser.add_argument(
        "--merge",
        nargs="*",
        type=Path,
        default=[],
        help="only merge these results files' groups into --json (invocations run in parallel)",
    )
    today = datetime.date.today().isoformat()
    parser.add_argument("--json", type=Path, default=HERE / "results" / f"noise-{today}-vm.json")
    compare.add_arguments(parser, out=False)
    args = parser.parse_args(argv)
    if (status := compare.against_only(args, IGNORED)) is not None:
        return status
    data = json.loads(args.json.read_text()) if args.json.exists() else {"groups": {}}
    data.update(
        date=today,
        machine=provenance.machine(note="a 2-core VM shared with other work while measuring"),
    )
    if args.merge:
        # invocations that ran in parallel, each on some cases of a group: a group's runs are
        # theirs together, its summary made again over all of them
        data["groups"] = {}
        for path in args.merge:
            for group, part in json.loads(path.read_text())["groups"].items():
                merged = data["groups"].setdefault(group, {"invocations": [], "runs": []})
                predicted = merged.setdefault("predicted", {})
                for key, row in part.pop("summary").items():
                    case, _, rank = key.rpartition(" rank ")
                    if "predicted" in row:
                        predicted.setdefault(case, {})[int(rank)] = row["predicted"]
                merged["runs"].extend(part.pop("runs"))
                merged["invocations"].append({**part, "from": path.name})
        for merged in data["groups"].values():
            merged["summary"] = _summary(merged["runs"], merged.pop("predicted"))
        args.json.write_text(json.dumps(data, indent=1) + "\n")
        return compare.after_run(args, args.json, IGNORED)
    workdir = Path(tempfile.mkdtemp(prefix="vramledger-noise-"))
    groups = args.groups.split(",")
    only = set(args.cases.split(",")) if args.cases else None
    predicted = {g: _predictions(g, workdir, only) for g in groups}
    runs: dict[str, list[dict]] = {g: [] for g in groups}
    seconds: dict[str, list[float]] = {g: [] for g in groups}
    failures: dict[str, list[str]] = {g: [] for g in groups}
    for i in range(args.spawns):  # the groups interleaved: an interrupted measurement has them all
        for group in groups:
            start = time.perf_counter()
            try:
                runs[group].extend(_run_spawn(group, workdir, args.repeats, only))
            except Exception as exc:  # a failed spawn is recorded, not retried
                failures[group].append(f"spawn {i}: {type(exc).__name__}: {exc}")
            seconds[group].append(round(time.perf_counter() - start, 1))
            serialised = [
                {c: {str(r): v for r, v in ranks.items()} for c, ranks in run.items()}
                for run in runs[group]
            ]
            data["groups"][group] = {
                "commit": provenance.commit(),
                "measured_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                "spawns_x_repeats": [args.spawns, args.repeats],
                "seconds_per_spawn": seconds[group],
                "failures": failures[group],
                "summary": _summary(serialised, predicted[group]) if serialised else {},
                "runs": serialised,
            }
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(data, indent=1) + "\n")
            print(f"{group} spawn {i + 1}/{args.spawns}: {seconds[group][-1]} s", flush=True)
    return compare.after_run(args, args.json, IGNORED)


if __name__ == "__main__":
    raise SystemExit(main())
