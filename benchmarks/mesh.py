"""Per-rank predictions of tensor, expert and pipeline parallelism against real gloo runs.

    python benchmarks/mesh.py [--json FILE] [--compare OLD.json]

For each case the estimate (PyTorch's own engines on a fake process group, ``parallel/mesh.py``
and ``parallel/pipeline.py``) gives every rank's steady-state peak; the same spec then runs for
real on 2, 4 or 8 gloo processes on this CPU (``vramledger.measure``), each rank counted twice: by
the storage tracker and by the CPU allocator itself (``cpu_allocator_count``, every thread).
The table prints each rank's prediction and both counts; the error is against the allocator's.
The cases are the multi-process tests' (``tests/mesh_real.py``: ``tests/test_tensor_parallel.py``
and ``tests/test_pipeline.py``, bound 1 % per rank), and the 8-process ones only this script
runs (pipeline x tensor parallel x FSDP2).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT))

from benchkit import compare  # noqa: E402


def cases() -> dict[int, dict[str, dict]]:
    """The multi-process tests' cases (``tests/mesh_real.py``): one definition for both."""
    from tests import mesh_real

    worlds = sorted({*mesh_real.TENSOR_PARALLEL, *mesh_real.PIPELINE})
    return {w: mesh_real.world_cases(w) for w in worlds}


def main(argv: list[str] | None = None) -> int:
    from vramledger import TrainingSpec, estimate
    from vramledger.measure.local import measure_on_local_gloo
    from vramledger.parallel.mesh import mesh_coords

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path)
    compare.add_arguments(parser, out=False)
    args = parser.parse_args(argv)
    if (status := compare.against_only(args)) is not None:
        return status
    rows = []
    print(
        f"{'case':<22}{'rank':>5}{'mesh (dp tp pp ep)':>20}{'predicted':>12}{'tracked':>12}"
        f"{'allocator':>12}{'error':>10}"
    )
    for world, specs in cases().items():
        real = measure_on_local_gloo(world, specs)
        for case, spec in specs.items():
            start = time.perf_counter()
            ledger = estimate(**spec)
            seconds = time.perf_counter() - start
            per_rank = {
                r: (led.peak_bytes, mesh_coords(r, TrainingSpec(**spec)))
                for ids, led in ledger.ranks
                for r in ids
            }
            for rank, (tracked, counted) in sorted(real[case].items()):
                want, coords = per_rank[rank]
                err = (want - counted) / counted
                mesh = " ".join(str(coords.get(a, 0)) for a in ("dp", "tp", "pp", "ep"))
                print(
                    f"{case:<22}{rank:>5}{mesh:>20}{want:>12,}{tracked:>12,}{counted:>12,}"
                    f"{100 * err:>+9.3f}%"
                )
                rows.append(
                    dict(
                        case=case,
                        world=world,
                        rank=rank,
                        mesh_coords=coords,
                        predicted=want,
                        tracked=tracked,
                        counted=counted,
                        error=err,
                        estimate_seconds=round(seconds, 2),
                    )
                )
    worst = max(abs(r["error"]) for r in rows)
    print(f"worst |error| against the allocator's count: {100 * worst:.3f} % (bound 1 %)")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return compare.after_run(args, args.json or rows)


if __name__ == "__main__":
    raise SystemExit(main())
