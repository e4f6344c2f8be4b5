"""Where one 70B estimate's seconds go: the same FSDP2 estimate at several micro-batches in one
process, each phase timed with a wall clock around the function that makes it.

    python benchmarks/estimate_phases.py           # ~20 s on the 2-CPU development VM

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

import collections
import os
import time
from dataclasses import replace
from pathlib import Path

from rich.console import Console
from rich.table import Table

os.environ["VRAMLEDGER_NO_CACHE"] = "1"  # every estimate traced

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "examples" / "configs" / "llama-3-70b.json"
SIZES = (2, 3, 4, 5)
"""The micro-batches a cold 70B ``fit`` estimates (two to derive from, the answer, the next)."""


def main() -> None:
    from vramledger import TrainingSpec, predict, training
    from vramledger.parallel import engines

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
    spec = TrainingSpec(
        model=str(MODEL),
        seq_len=4096,
        precision="bf16-master",
        world_size=64,
        strategy="fsdp",
        grad_checkpointing=True,
        gpu="h100-80gb",
    )
    table = Table(title="one Llama-3-70B FSDP2-64 estimate, by phase (seconds)")
    phases = ("fully_shard", "step 1", "step 2", "ledger")
    for column in ("batch", "blocks traced", "total", *phases, "rest"):
        table.add_column(column, justify="right")
    for i, size in enumerate(SIZES):
        spent.clear()
        start = time.perf_counter()
        predict.estimate(replace(spec, batch_size=size), blocks_verified=i > 0)
        total = time.perf_counter() - start
        rest = total - sum(spent[p] for p in phases)
        table.add_row(
            str(size),
            "4 and 5" if i == 0 else "4",
            f"{total:.2f}",
            *(f"{spent[p]:.2f}" for p in phases),
            f"{rest:.2f}",
        )
    Console().print(table)


if __name__ == "__main__":
    main()
