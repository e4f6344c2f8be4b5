"""Accuracy of the estimate against real CPU runs.

    python benchmarks/accuracy.py            # all cases, a few minutes on 2 cores
    python benchmarks/accuracy.py --quick    # the first 4

For each case: the fake-tensor estimate (``--target cpu``) of the steady-state step peak, the
real CPU run's peak as the CPU allocator reports it to ``torch.profiler`` (memory events), and
the relative error. The real run is a plain one (``measure``: no dispatch mode or tensor
subclass active while the step runs); the tracker's view of a second, tracked run is shown
beside it. Targets (issue 2): median |error| <= 0.05 %, worst <= 0.5 %. Results are also
written to benchmarks/results/accuracy-<date>-<host>-<commit>.json (``--out``) with the date,
commit and machine; ``--compare`` an earlier one (``benchkit/compare.py``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import warnings
from pathlib import Path

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
warnings.filterwarnings("ignore")

from benchkit import compare, provenance  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from vramledger.inputs.units import format_bytes  # noqa: E402
from vramledger.measure import measure  # noqa: E402

HERE = Path(__file__).parent
C = HERE / "configs"
M = f"{HERE / 'models.py'}"

CASES: list[tuple[str, dict]] = [
    (
        "gpt2 adamw foreach",
        dict(
            model=C / "gpt2-2l.json",
            batch_size=2,
            seq_len=256,
            optimizer="adamw",
            optimizer_kwargs={"foreach": True},
        ),
    ),
    (
        "gpt2 adamw for-loop ckpt",
        dict(
            model=C / "gpt2-2l.json",
            batch_size=2,
            seq_len=256,
            optimizer="adamw",
            optimizer_kwargs={"foreach": False},
            grad_checkpointing=True,
        ),
    ),
    (
        "llama bf16-master adamw",
        dict(
            model=C / "tinyllama-2l.json",
            batch_size=1,
            seq_len=256,
            optimizer="adamw",
            precision="bf16-master",
        ),
    ),
    (
        "llama bf16-mixed sgd-mom ckpt",
        dict(
            model=C / "tinyllama-2l.json",
            batch_size=1,
            seq_len=256,
            optimizer="sgd-momentum",
            precision="bf16-mixed",
            grad_checkpointing=True,
        ),
    ),
    ("bert adam", dict(model=C / "bert-base-2l.json", batch_size=4, seq_len=128, optimizer="adam")),
    (
        "bert sgd bf16-mixed",
        dict(
            model=C / "bert-base-2l.json",
            batch_size=4,
            seq_len=128,
            optimizer="sgd",
            precision="bf16-mixed",
        ),
    ),
    ("t5 adamw", dict(model=C / "t5-small-2l.json", batch_size=2, seq_len=128, optimizer="adamw")),
    (
        "t5 adagrad bf16-master ckpt",
        dict(
            model=C / "t5-small-2l.json",
            batch_size=2,
            seq_len=128,
            optimizer="adagrad",
            precision="bf16-master",
            grad_checkpointing=True,
        ),
    ),
    ("vit adamw", dict(model=C / "vit-base-2l.json", batch_size=4, optimizer="adamw")),
    (
        "vit sgd-mom bf16-mixed",
        dict(
            model=C / "vit-base-2l.json",
            batch_size=4,
            optimizer="sgd-momentum",
            precision="bf16-mixed",
        ),
    ),
    (
        "mlp rmsprop",
        dict(
            model=f"{M}:mlp",
            inputs=f"{M}:mlp_inputs",
            loss=f"{M}:classify_loss",
            optimizer="rmsprop",
        ),
    ),
    (
        "mlp adamw bf16-master ckpt",
        dict(
            model=f"{M}:mlp",
            inputs=f"{M}:mlp_inputs",
            loss=f"{M}:classify_loss",
            optimizer="adamw",
            precision="bf16-master",
            checkpoint_modules=("MLPBlock",),
        ),
    ),
    (
        "cnn sgd-mom",
        dict(
            model=f"{M}:cnn",
            inputs=f"{M}:cnn_inputs",
            loss=f"{M}:classify_loss",
            optimizer="sgd-momentum",
        ),
    ),
    (
        "cnn adamw ckpt",
        dict(
            model=f"{M}:cnn",
            inputs=f"{M}:cnn_inputs",
            loss=f"{M}:classify_loss",
            optimizer="adamw",
            checkpoint_modules=("ResBlock",),
        ),
    ),
]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    compare.add_arguments(parser)
    args = parser.parse_args()
    if (status := compare.against_only(args)) is not None:
        return status
    cases = CASES[:4] if args.quick else CASES
    # the code this run loads: read before it runs, others may commit meanwhile
    commit = provenance.commit()
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    console = Console(width=130)
    table = Table(
        title="estimate (fake tensors, --target cpu) vs real CPU run: steady-state step peak"
    )
    for col in ("case", "precision", "estimate", "measured", "error", "tracked real", "untracked"):
        table.add_column(col, justify="left" if col in ("case", "precision") else "right")
    rows = []
    for name, kwargs in cases:
        kwargs = {**kwargs, "model": str(kwargs["model"])}
        m = measure(target="cpu", compare=True, **kwargs)
        err = m.error()
        rows.append(
            {
                "case": name,
                "precision": kwargs.get("precision", "fp32"),
                "estimate_bytes": m.estimate.peak_bytes,
                "measured_bytes": m.measured_peak_bytes,
                "tracked_real_bytes": m.ledger.peak_bytes,
                "error": err,
                "method": m.method,
            }
        )
        table.add_row(
            name,
            kwargs.get("precision", "fp32"),
            format_bytes(m.estimate.peak_bytes),
            format_bytes(m.measured_peak_bytes),
            f"{100 * err:+.4f} %",
            format_bytes(m.ledger.peak_bytes),
            format_bytes(m.untracked_bytes),
        )
        console.print(f"[dim]{name}: error {100 * err:+.4f} %[/dim]")
    console.print(table)
    errors = [abs(r["error"]) for r in rows]
    median, worst = statistics.median(errors), max(errors)
    ok = median <= 0.0005 and worst <= 0.005
    console.print(
        f"median |error| {100 * median:.4f} % (target 0.05 %), worst {100 * worst:.4f} % (target 0.5 %): "
        + ("[green]targets met[/green]" if ok else "[red]TARGET MISSED[/red]")
    )
    out = args.out or provenance.result_path("accuracy", commit)
    out.write_text(
        json.dumps(
            {
                "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "started": started,
                "commit": commit,
                "machine": provenance.machine(),
                "measured_run": m.measured_run,
                "cases": rows,
                "median_abs_error": median,
                "worst_abs_error": worst,
                "targets_met": ok,
            },
            indent=2,
        )
    )
    console.print(f"[dim]wrote {out}[/dim]")
    return compare.after_run(args, out) or (0 if ok else 1)


if __name__ == "__main__":
    sys.exit(main())
