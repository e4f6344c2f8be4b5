"""Low-bit optimizers: how much memory they save, and whether they still train.

    python benchmarks/lowbit.py              # 500 steps per optimizer, ~6 minutes on 2 cores
    python benchmarks/lowbit.py --steps 50   # a quick look

A small GPT-2-shaped byte-level model (4 layers, width 192, 1.9 M parameters, vocab 256)
trained on the Python standard library's own source files (benchmarks/corpus.py; no downloads),
from the same initial weights on the same batches with AdamW (the reference), torchao's
AdamW8bit and AdamW4bit, SGD with momentum, and bitsandbytes' AdamW8bit. Reports, per optimizer,
the measured peak memory of a step, the optimizer state (bytes per parameter), the final-loss gap
and the largest gap along the way. On a CUDA GPU the runs use it (and bitsandbytes' CUDA
kernels). Writes benchmarks/results/lowbit-<date>-<host>.json and .png (``--out``: the JSON,
the plot beside it); ``--compare`` an earlier JSON (``benchkit/compare.py``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import warnings
from pathlib import Path

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
warnings.filterwarnings("ignore")

from benchkit import compare as bench_compare  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn  # noqa: E402

from vramledger import TrainingSpec  # noqa: E402
from vramledger.measure.compare import compare  # noqa: E402
from vramledger.render.plots import comparison_plot  # noqa: E402
from vramledger.render.terminal import comparison_table  # noqa: E402

HERE = Path(__file__).resolve().parent
OPTIMIZERS = [
    "adamw@0.001",
    "adamw8bit@0.001",
    "adamw4bit@0.001",
    "sgd-momentum@0.05",
    "bnb-adamw8bit@0.001",
]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--tolerance", type=float, default=0.05)
    bench_compare.add_arguments(parser)
    args = parser.parse_args()
    if (status := bench_compare.against_only(args)) is not None:
        return status
    spec = TrainingSpec(
        model=str(HERE / "configs" / "gpt2-bytes-small.json"), batch_size=8, seq_len=128
    )
    console = Console(width=130)
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=console, transient=True) as bar:
        tasks: dict[str, int] = {}

        def progress(name: str, step: int, total: int) -> None:
            if name not in tasks:
                tasks[name] = bar.add_task(name, total=total)
            bar.update(tasks[name], completed=step)

        result = compare(
            spec,
            OPTIMIZERS,
            steps=args.steps,
            data=f"{HERE / 'corpus.py'}:batch",
            tolerance=args.tolerance,
            progress=progress,
        )
    console.print(comparison_table(result))
    stem = HERE / "results" / f"lowbit-{datetime.date.today()}-{platform.node() or 'host'}"
    out = args.out or stem.with_suffix(".json")
    out.write_text(json.dumps(result.to_dict(), indent=1))
    comparison_plot(result, out.with_suffix(".png"))
    console.print(f"[dim]wrote {out} and its .png[/dim]")
    return bench_compare.after_run(args, out)


if __name__ == "__main__":
    sys.exit(main())
