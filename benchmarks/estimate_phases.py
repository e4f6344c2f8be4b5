"""Where one 70B estimate's seconds go: the same FSDP2 estimate at several micro-batches in one
process, each phase timed with a wall clock around the function that makes it.

    python benchmarks/estimate_phases.py                   # ~20 s on the 2-CPU development VM
    python benchmarks/estimate_phases.py --sizes 2-11      # and the median of the nine after the first

Llama-3-70B, FSDP2 over 64 GPUs, bf16-master, sequence 4096, activation checkpointing (the
estimate a cold ``fit`` makes four times, ``benchmarks/cache_speed.py``). The first estimate
imports transformers' model code and checks the block extension (4 and 5 blocks traced); the
others trace 4 blocks (``blocks_verified``, as fit's later sizes do). Phases: ``fully_shard``
(FSDP2 sharding each parameter 64 ways on fake tensors), ``step 1`` and ``step 2`` (the training
steps on fake tensors: the first also creates the optimizer state), ``ledger`` (replaying the
timeline through the allocator model), and what is left (building the model on the meta
device, extending the timeline, the trace cache, which is off here). Prints a table; nothing is
written.
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import time
from dataclasses import replace

from rich.console import Console
from rich.table import Table

os.environ["VRAMLEDGER_NO_CACHE"] = "1"  # every estimate traced

from fit import MODELS

SIZES = "2-5"
"""The micro-batches a cold 70B ``fit`` estimates (two to derive from, the answer, the next)."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--sizes", default=SIZES, help=f"micro-batches FIRST-LAST (default {SIZES})"
    )
    first, last = (int(n) for n in parser.parse_args().sizes.split("-"))

    from vramledger import TrainingSpec
    from vramledger.inputs import training
    from vramledger.parallel import engines
    from vramledger.predict import step as predict
    from vramledger.trace.core.blocks import SMALL

    spent: collections.Counter[str] = collections.Counter()

    def timed(owner: object, name: str, phase: str) -> None:
        original = getattr(owner, name)

        def wrapper(*args: object, **kwargs: object) -> object:
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                spent[phase] += time.perf_counter() - start

        setattr(owner, name, wrapper)

    timed(engines, "apply_fully_shard", "fully_shard")
    timed(predict, "build_ledger", "ledger")
    step = training.TrainingRun.step

    def timed_step(self: training.TrainingRun, n: int, observer: object) -> None:
        start = time.perf_counter()
        step(self, n, observer)
        spent[f"step {min(n, 2)}"] += time.perf_counter() - start

    training.TrainingRun.step = timed_step  # type: ignore[method-assign]
    model, gpus = MODELS["70b"]
    spec = TrainingSpec(
        model=str(model),
        seq_len=4096,
        precision="bf16-master",
        world_size=gpus,
        strategy="fsdp",
        grad_checkpointing=True,
        gpu="h100-80gb",
    )
    table = Table(title="one Llama-3-70B FSDP2-64 estimate, by phase (seconds)")
    phases = ("fully_shard", "step 1", "step 2", "ledger")
    for column in ("batch", "blocks traced", "total", *phases, "rest"):
        table.add_column(column, justify="right")
    rows = []
    for size in range(first, last + 1):
        spent.clear()
        start = time.perf_counter()
        predict.estimate(replace(spec, batch_size=size), blocks_verified=size > first)
        total = time.perf_counter() - start
        row = [total, *(spent[p] for p in phases), total - sum(spent[p] for p in phases)]
        rows.append(row)
        blocks = f"{SMALL}" if size > first else f"{SMALL} and {SMALL + 1}"
        table.add_row(str(size), blocks, *(f"{x:.2f}" for x in row))
    if len(rows) > 2:
        medians = [statistics.median(column) for column in zip(*rows[1:], strict=True)]
        table.add_row("median", f"{SMALL}", *(f"{x:.2f}" for x in medians))
    Console().print(table)


if __name__ == "__main__":
    main()
