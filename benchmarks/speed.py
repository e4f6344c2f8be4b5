"""Speed and memory of an estimate for a Llama-3-70B-shaped model, against PyTorch's MemTracker.

    python benchmarks/speed.py            # about a minute on 2 cores

Case (issue 2): Llama-3-70B shape (80 layers, hidden 8192, intermediate 28672, 64 heads, 8 KV
heads, vocab 128256), batch 1, seq 4096, bf16-master AdamW with activation checkpointing,
target cuda. Measured in one run:

1. ``vramledger estimate`` in a fresh process: wall time and peak RSS (target <= 2 GiB);
2. PyTorch's ``MemTracker`` (torch.distributed._tools.mem_tracker) on the same fake-tensor
   training step, run on 8 of the 80 layers for two steps and scaled by depth (80/8) — which
   flatters it, since its per-operator cost grows with the number of modules;
3. the proof that tracing 3 and 4 blocks and extending is exact: a full trace of all 80 layers
   gives the same timeline and the same ledger.

Target: at least 10x faster than MemTracker. Results go to benchmarks/results/speed-<date>-<host>.json
(``--out``); ``--compare`` an earlier one compares the answers (the predicted peak, extended ==
full), not the times (``benchkit/compare.py``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
import warnings
from pathlib import Path

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
warnings.filterwarnings("ignore")

import torch  # noqa: E402
from benchkit import compare  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "examples" / "configs" / "llama-3-70b.json"
ARGS = dict(
    batch_size=1, seq_len=4096, optimizer="adamw", precision="bf16-master", grad_checkpointing=True
)
MEMTRACKER_LAYERS = 8
TARGET_SPEEDUP = 10.0
TARGET_RSS = 2 * 1024**3

ESTIMATE_IN_CHILD = f"""
import json, resource, time, warnings, os
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error"); warnings.filterwarnings("ignore")
t0 = time.perf_counter()
import vramledger
ledger = vramledger.estimate(model={str(CONFIG)!r}, target="cuda", **{ARGS!r})
wall = time.perf_counter() - t0
print(json.dumps({{"wall": wall, "trace": ledger.seconds, "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                  "peak": ledger.peak_bytes, "notes": ledger.notes}}))
"""


def run_estimate_in_child() -> dict:
    out = subprocess.run(
        [sys.executable, "-c", ESTIMATE_IN_CHILD], capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def time_memtracker(layers: int) -> float:
    """Two training steps of the same model, cut to ``layers`` layers, under MemTracker."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker

    from vramledger.inputs.recipe import resolve
    from vramledger.inputs.sources import load_hf_config
    from vramledger.inputs.spec import TrainingSpec
    from vramledger.inputs.training import NullObserver, assemble
    from vramledger.trace.core.fake import TRACE_DEVICE, fakeify
    from vramledger.trace.emulation.cuda_policy import CudaPolicy

    config = load_hf_config(CONFIG).to_dict()
    config["num_hidden_layers"] = layers
    recipe = resolve(TrainingSpec(model=config, target="cuda", **ARGS))
    policy = CudaPolicy()
    model = recipe.build_model("meta")
    mode = FakeTensorMode()
    fakeify(model, mode, TRACE_DEVICE)
    with mode, policy.context():
        batch = recipe.make_inputs(TRACE_DEVICE, recipe.shape)
        run = assemble(
            model=model,
            batch=batch,
            loss_fn=recipe.loss_fn,
            optimizer=policy.optimizer(recipe.optimizer),
            precision=recipe.precision,
            device=TRACE_DEVICE,
            grad_accum=1,
            observer=NullObserver(),
        )
        tracker = MemTracker()
        tracker.track_external(model, run.optimizer, *batch.values())
        start = time.perf_counter()
        with tracker:
            run.step(1, NullObserver())
            tracker.reset_mod_stats()
            run.step(2, NullObserver())
        seconds = time.perf_counter() - start
        peak = max(snap["Total"] for snap in tracker.get_tracker_snapshot("peak").values())
    return seconds, peak


def full_trace_equals_extended() -> tuple[bool, float, float]:
    from vramledger.inputs.spec import TrainingSpec
    from vramledger.predict.step import policy_for
    from vramledger.trace.core.blocks import same_timeline
    from vramledger.trace.core.fake import trace

    spec = TrainingSpec(model=str(CONFIG), target="cuda", **ARGS)
    t0 = time.perf_counter()
    extended = trace(spec, policy_for("cuda"))
    t1 = time.perf_counter()
    full = trace(spec, policy_for("cuda"), extend_blocks=False)
    t2 = time.perf_counter()
    return same_timeline(extended.timeline, full.timeline), t1 - t0, t2 - t1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    compare.add_arguments(parser)
    args = parser.parse_args()
    if (status := compare.against_only(args)) is not None:
        return status
    console = Console(width=120)
    console.print(
        f"[bold]{CONFIG.name}[/bold] {ARGS} target cuda — torch {torch.__version__}, {os.cpu_count()} CPUs"
    )
    ours = run_estimate_in_child()
    console.print(
        f"vramledger estimate: {ours['wall']:.2f} s wall (trace {ours['trace']:.2f} s), "
        f"peak RSS {ours['rss'] / 2**30:.2f} GiB"
    )
    mt_seconds, _ = time_memtracker(MEMTRACKER_LAYERS)
    mt_scaled = mt_seconds * 80 / MEMTRACKER_LAYERS
    console.print(
        f"MemTracker: {mt_seconds:.2f} s for {MEMTRACKER_LAYERS} layers -> {mt_scaled:.1f} s scaled to 80"
    )
    same, t_ext, t_full = full_trace_equals_extended()
    console.print(
        f"full 80-layer trace {t_full:.2f} s vs extended {t_ext:.2f} s: timelines identical = {same}"
    )

    speedup = mt_scaled / ours["wall"]
    table = Table(
        title="Llama-3-70B shape, bf16-master AdamW + checkpointing, batch 1 x 4096, target cuda"
    )
    for col in ("measure", "value", "target", "met"):
        table.add_column(col)
    table.add_row("vramledger estimate (wall, fresh process)", f"{ours['wall']:.2f} s", "", "")
    table.add_row(f"MemTracker, {MEMTRACKER_LAYERS} layers x 10", f"{mt_scaled:.1f} s", "", "")
    table.add_row(
        "speed-up",
        f"{speedup:.1f}x",
        f">= {TARGET_SPEEDUP:.0f}x",
        "yes" if speedup >= TARGET_SPEEDUP else "NO",
    )
    table.add_row(
        "peak RSS of the estimate",
        f"{ours['rss'] / 2**30:.2f} GiB",
        "<= 2 GiB",
        "yes" if ours["rss"] <= TARGET_RSS else "NO",
    )
    table.add_row("extended == full 80-layer trace", str(same), "True", "yes" if same else "NO")
    table.add_row("predicted steady-state peak", f"{ours['peak'] / 2**30:.2f} GiB", "", "")
    console.print(table)
    out = args.out or (
        ROOT
        / "benchmarks"
        / "results"
        / f"speed-{datetime.date.today()}-{platform.node() or 'host'}.json"
    )
    out.write_text(
        json.dumps(
            {
                "estimate_wall_s": ours["wall"],
                "estimate_trace_s": ours["trace"],
                "estimate_peak_rss_bytes": ours["rss"],
                "memtracker_s_8_layers": mt_seconds,
                "memtracker_s_scaled_80": mt_scaled,
                "speedup": speedup,
                "extended_equals_full": same,
                "full_trace_s": t_full,
                "extended_trace_s": t_ext,
                "predicted_peak_bytes": ours["peak"],
            },
            indent=2,
        )
    )
    console.print(f"[dim]wrote {out}[/dim]")
    ok = speedup >= TARGET_SPEEDUP and ours["rss"] <= TARGET_RSS and same
    return compare.after_run(args, out) or (0 if ok else 1)


if __name__ == "__main__":
    sys.exit(main())
