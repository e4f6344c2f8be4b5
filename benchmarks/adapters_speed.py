"""How long a LoRA or QLoRA ``estimate`` and ``fit`` take against full fine-tuning of the same
model, in one process (issue 22).

    python benchmarks/adapters_speed.py                    # Llama-2-7B and Llama-3-8B
    python benchmarks/adapters_speed.py --models 7b        # one model

Each model is estimated three ways with everything else equal (bf16-mixed AdamW, batch 1,
sequence 512, target cuda): full fine-tuning, LoRA (``r=16,alpha=32`` on q/k/v/o_proj) and QLoRA
(the same LoRA over an nf4 base). Each is timed as ``estimate`` (one ledger) and as ``fit`` on an
H200 (the largest micro-batch, checkpointing off and on). Before timing, a tiny QLoRA estimate
imports peft and bitsandbytes, so no row pays for an import. Each is run ``--repeats`` (3)
estimates and ``--fit-repeats`` (2) fits, the three variants taking turns; the fastest of each
is compared and every sample is kept. The targets: a LoRA or QLoRA
``estimate`` in at most 2x the full fine-tuning estimate's time, and its ``fit`` in at most 2x
the full fine-tuning ``fit``'s. Each row says whether the block extension was used.

The machine's load average is recorded before and after: on a shared machine the times are
only comparable within one run. Results go to
benchmarks/results/adapters-speed-<date>-vm-<commit>.json (``--out``); ``--compare`` an earlier
one compares the answers (peaks, fits, notes), not the times (``benchkit/compare.py``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import time
import warnings
from pathlib import Path

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
warnings.filterwarnings("ignore")

from benchkit import compare  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from vramledger.inputs.gpus import resolve_gpu  # noqa: E402
from vramledger.inputs.spec import TrainingSpec  # noqa: E402
from vramledger.inputs.units import format_bytes  # noqa: E402
from vramledger.plan.fit import fit  # noqa: E402
from vramledger.predict.step import estimate  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
MODELS = {
    "7b": ROOT / "tests" / "fixtures" / "hub" / "llama-7b-bf16",
    "8b": ROOT / "examples" / "configs" / "llama-3-8b.json",
}
"""A Hub-saved Llama-2-7B config (bf16 checkpoint) and the Llama-3-8B config."""
WARM_UP = ROOT / "tests" / "fixtures" / "hub" / "tiny-llama-bf16"
LORA = "r=16,alpha=32,targets=q_proj,k_proj,v_proj,o_proj"
VARIANTS = {
    "full": {},
    "lora": dict(lora=LORA),
    "qlora": dict(lora=LORA, quantize="nf4"),
}
BASE = dict(precision="bf16-mixed", batch_size=1, seq_len=512, target="cuda")
FIT_GPU = "h200"
TARGET_RATIO = 2.0
"""The issue: a LoRA or QLoRA estimate (and fit) in at most 2x full fine-tuning's."""
IGNORED = {**compare.IGNORED, "targets_met": "verdicts on times, not answers"}
"""What ``--compare`` leaves out: the shared keys and the speed verdicts."""


def load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def commit() -> str:
    out = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT
    )
    return out.stdout.strip() or "unknown"


def timed_estimate(model: Path, variant: str) -> tuple[float, object]:
    spec = TrainingSpec(model=str(model), **BASE, **VARIANTS[variant])
    start = time.perf_counter()
    ledger = estimate(spec)
    return time.perf_counter() - start, ledger


def timed_fit(model: Path, variant: str) -> tuple[float, object]:
    spec = TrainingSpec(model=str(model), **BASE, **VARIANTS[variant])
    start = time.perf_counter()
    answer = fit(spec, resolve_gpu(FIT_GPU), maximize="batch-size")
    return time.perf_counter() - start, answer


def measure(model: Path, repeats: int, fit_repeats: int) -> dict[str, dict]:
    """Each variant's estimate ``repeats`` times and fit ``fit_repeats`` times, the variants
    taking turns in each round (so a burst of load from elsewhere falls on all of them); the
    fastest of each is the one compared, the others are kept."""
    samples: dict[str, dict[str, list[float]]] = {v: {"estimate": [], "fit": []} for v in VARIANTS}
    last: dict[str, tuple[object, object]] = {}
    for round_ in range(max(repeats, fit_repeats)):
        for variant in VARIANTS:
            ledger = answer = None
            if round_ < repeats:
                seconds, ledger = timed_estimate(model, variant)
                samples[variant]["estimate"].append(round(seconds, 2))
            if round_ < fit_repeats:
                seconds, answer = timed_fit(model, variant)
                samples[variant]["fit"].append(round(seconds, 2))
            previous = last.get(variant, (None, None))
            last[variant] = (ledger or previous[0], answer or previous[1])
    out = {}
    for variant, (ledger, answer) in last.items():
        out[variant] = {
            "variant": variant,
            "estimate_seconds": min(samples[variant]["estimate"]),
            "estimate_samples": samples[variant]["estimate"],
            "trace_seconds": round(ledger.seconds, 2),
            "blocks_extended": ledger.blocks_extended,
            "peak_bytes": ledger.peak_bytes,
            "fit_seconds": min(samples[variant]["fit"]),
            "fit_samples": samples[variant]["fit"],
            "fit_estimates": answer.estimates,
            "fit_answers": [
                {"checkpointing": a.checkpointing, "batch_size": a.batch_size}
                for a in answer.answers
            ],
            "block_notes": [n for n in ledger.notes if "block" in n],
        }
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--repeats", type=int, default=3, help="estimates per variant")
    parser.add_argument("--fit-repeats", type=int, default=2, help="fits per variant")
    compare.add_arguments(parser)
    args = parser.parse_args()
    if (status := compare.against_only(args, IGNORED)) is not None:
        return status
    load_before = load()
    estimate(model=str(WARM_UP), lora=LORA, quantize="nf4", precision="bf16-mixed", seq_len=64)
    rows = []
    for name in args.models.split(","):
        results = measure(MODELS[name], args.repeats, args.fit_repeats)
        full = results["full"]
        for result in results.values():
            result["model"] = name
            result["estimate_ratio"] = round(
                result["estimate_seconds"] / full["estimate_seconds"], 2
            )
            result["fit_ratio"] = round(result["fit_seconds"] / full["fit_seconds"], 2)
            rows.append(result)
    load_after = load()

    table = Table(title=f"LoRA / QLoRA against full fine-tuning ({datetime.date.today()})")
    for col in ("model", "run", "extended", "peak", "estimate", "ratio", "fit", "ratio", "fits"):
        table.add_column(col, justify="left" if col in ("model", "run") else "right")
    for r in rows:
        table.add_row(
            r["model"],
            r["variant"],
            "yes" if r["blocks_extended"] else "no",
            format_bytes(r["peak_bytes"]),
            f"{r['estimate_seconds']} s",
            f"{r['estimate_ratio']}x",
            f"{r['fit_seconds']} s",
            f"{r['fit_ratio']}x",
            str(r["fit_estimates"]),
        )
    console = Console()
    console.print(table)
    adapted = [r for r in rows if r["variant"] != "full"]
    verdicts = {
        kind: all(r[f"{kind}_ratio"] <= TARGET_RATIO for r in adapted)
        for kind in ("estimate", "fit")
    }
    for kind, met in verdicts.items():
        console.print(
            f"target: LoRA/QLoRA {kind} <= {TARGET_RATIO}x full fine-tuning's: "
            + ("met" if met else "missed")
        )
    console.print(f"load average (1, 5, 15 min): before {load_before}, after {load_after}")
    sha = commit()
    record = {
        "date": str(datetime.date.today()),
        "commit": sha,
        "machine": f"{platform.node()} ({platform.machine()}, {os.cpu_count()} cores, shared)",
        "command": f"python benchmarks/adapters_speed.py --models {args.models} "
        f"--repeats {args.repeats} --fit-repeats {args.fit_repeats}",
        "settings": {**BASE, "lora": LORA, "fit_gpu": FIT_GPU},
        "load_before": load_before,
        "load_after": load_after,
        "target_ratio": TARGET_RATIO,
        "targets_met": verdicts,
        "rows": rows,
    }
    out = args.out or (
        ROOT / "benchmarks" / "results" / f"adapters-speed-{datetime.date.today()}-vm-{sha}.json"
    )
    out.write_text(json.dumps(record, indent=2) + "\n")
    console.print(f"written: {out}")
    return compare.after_run(args, out, IGNORED)


if __name__ == "__main__":
    raise SystemExit(main())
