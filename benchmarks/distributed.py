"""Per-GPU memory of Llama-2-7B on 8 GPUs under every strategy, the ZeRO paper's table per rank,
and how estimates scale.

    python benchmarks/distributed.py            # ~10 minutes on 2 cores
    python benchmarks/distributed.py --verify   # also real gloo runs on CPU, 2 and 4 processes

Llama-2-7B shape (32 layers, hidden 4096), batch 1 x 4096, bf16-master AdamW with activation
checkpointing, target cuda, 8 ranks: per-rank GPU bytes by category (worst rank), host bytes
for offload, and the time each estimate took (zero1/zero2/zero3 run DeepSpeed's own engine,
fsdp FSDP2, zero1-torch PyTorch's ZeroRedundancyOptimizer). Then the ZeRO paper's Figure 1 (a GPT-style
7.5B config, mixed-precision Adam, 64 GPUs): the worst and best rank's model states against
the paper's per-GPU figures. Then a Llama-3-70B-shaped model on 1 and 1024 ranks (FSDP) to show
that ranks are not simulated one by one. ``--verify`` compares each rank's prediction with real
multi-process runs of DDP, ZeroRedundancyOptimizer and FSDP2 (tests/test_distributed_real.py)
and of DeepSpeed ZeRO-1/2/3 (tests/test_deepspeed_real.py: the CPU allocator's own count).
Results go to benchmarks/results/distributed-<date>-<host>.json (``--out``); ``--compare`` an
earlier one (``benchkit/compare.py``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
import warnings
from pathlib import Path

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
warnings.filterwarnings("ignore")

from benchkit import compare  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from vramledger import Category, estimate  # noqa: E402
from vramledger.inputs.units import format_bytes  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
LLAMA2 = ROOT / "examples" / "configs" / "llama-2-7b.json"
LLAMA3_70B = ROOT / "examples" / "configs" / "llama-3-70b.json"
ARGS = dict(
    batch_size=1,
    seq_len=4096,
    optimizer="adamw",
    precision="bf16-master",
    grad_checkpointing=True,
    target="cuda",
)
CASES = [
    ("ddp", "none"),
    ("zero1-torch", "none"),
    ("zero1", "none"),
    ("zero2", "none"),
    ("zero3", "none"),
    ("fsdp", "none"),
    ("zero2", "optimizer"),
    ("fsdp", "optimizer"),
    ("fsdp", "both"),
]
SHOWN = [
    Category.PARAMETERS,
    Category.SHARDED_PARAMETERS,
    Category.GRADIENTS,
    Category.SHARDED_GRADIENTS,
    Category.MASTER_WEIGHTS,
    Category.OPTIMIZER_STATE,
    Category.GRADIENT_BUCKETS,
    Category.ALL_GATHER_BUFFERS,
    Category.REDUCE_SCATTER_BUFFERS,
    Category.ACTIVATIONS,
    Category.TEMPORARIES,
    Category.WORKSPACE,
]


GPT_7_5B = ROOT / "tests" / "fixtures" / "gpt-7.5b.json"
K = 12
PAPER_BYTES_PER_PARAM = {
    "ddp": 2 + 2 + K,
    "zero1-torch": 2 + 2 + K / 64,
    "zero1": 2 + 2 + K / 64,
    "zero2": 2 + (2 + K) / 64,
    "zero3": (2 + 2 + K) / 64,
    "fsdp": (2 + 2 + K) / 64,
}
"""ZeRO (Rajbhandari et al. 2020), Figure 1: model states per GPU, bytes per parameter."""


def gib(n: int) -> str:
    return f"{n / 2**30:.2f}"


def paper_table(console: Console) -> list[dict]:
    """The ZeRO paper's per-GPU model states against every rank's, 7.5B GPT on 64 ranks."""
    table = Table(
        title="ZeRO paper, Figure 1: GPT-style 7.5B, mixed-precision Adam, 64 GPUs; model "
        "states per rank, bytes/parameter"
    )
    for col in ("strategy", "paper", "worst rank", "vs paper", "best rank", "ranks traced", "s"):
        table.add_column(col, justify="right")
    rows = []
    for strategy in PAPER_BYTES_PER_PARAM:
        start = time.perf_counter()
        ledger = estimate(
            model=str(GPT_7_5B),
            batch_size=1,
            seq_len=64,
            precision="bf16-master",
            optimizer="adam",
            world_size=64,
            strategy=strategy,
        )
        seconds = time.perf_counter() - start
        per_rank = {
            r: led.model_state_bytes / ledger.parameters for ids, led in ledger.ranks for r in ids
        }
        worst = max(per_rank.values())
        paper = PAPER_BYTES_PER_PARAM[strategy]
        rows.append(
            {
                "strategy": strategy,
                "parameters": ledger.parameters,
                "paper_bytes_per_param": paper,
                "bytes_per_param_by_rank": per_rank,
                "worst_rank": ledger.worst_rank,
                "ranks_traced": len(ledger.ranks),
                "estimate_seconds": seconds,
            }
        )
        table.add_row(
            strategy,
            f"{paper:.3f}",
            f"{worst:.3f}",
            f"{100 * (worst / paper - 1):+.2f} %",
            f"{min(per_rank.values()):.3f}",
            str(len(ledger.ranks)),
            f"{seconds:.0f}",
        )
        console.print(f"[dim]paper {strategy}: {worst:.3f} B/param in {seconds:.1f} s[/dim]")
    console.print(table)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--verify", action="store_true")
    compare.add_arguments(parser)
    args = parser.parse_args()
    if (status := compare.against_only(args)) is not None:
        return status
    console = Console(width=160)
    rows = []
    table = Table(
        title="Llama-2-7B, 8 GPUs, bf16-master AdamW + checkpointing, batch 1 x 4096: worst rank, GiB"
    )
    table.add_column("strategy")
    table.add_column("offload")
    for c in SHOWN:
        table.add_column(c.value.replace("_", " "), justify="right")
    for col in ("peak", "allocated", "host", "model state", "estimate s"):
        table.add_column(col, justify="right")
    for strategy, offload in CASES:
        start = time.perf_counter()
        ledger = estimate(
            model=str(LLAMA2), world_size=8, strategy=strategy, offload=offload, **ARGS
        )
        seconds = time.perf_counter() - start
        rows.append(
            {
                "strategy": strategy,
                "offload": offload,
                **ledger.to_dict(),
                "estimate_seconds": seconds,
            }
        )
        table.add_row(
            strategy,
            offload,
            *(gib(ledger.at_peak.get(c, 0)) for c in SHOWN),
            gib(ledger.peak_bytes),
            gib(ledger.allocated_peak_bytes),
            gib(ledger.host_bytes),
            gib(ledger.model_state_bytes),
            f"{seconds:.1f}",
        )
        console.print(
            f"[dim]{strategy}/{offload}: {format_bytes(ledger.allocated_peak_bytes)} in {seconds:.1f} s[/dim]"
        )
    console.print(table)

    paper = paper_table(console)

    scale = {}
    for world in (1, 1024):
        start = time.perf_counter()
        ledger = estimate(
            model=str(LLAMA3_70B), world_size=world, strategy="fsdp" if world > 1 else None, **ARGS
        )
        scale[world] = {"seconds": time.perf_counter() - start, "peak": ledger.allocated_peak_bytes}
    console.print(
        f"Llama-3-70B: 1 rank {scale[1]['seconds']:.1f} s ({format_bytes(scale[1]['peak'])}), "
        f"1024 ranks FSDP {scale[1024]['seconds']:.1f} s ({format_bytes(scale[1024]['peak'])} per rank): "
        f"{scale[1024]['seconds'] / scale[1]['seconds']:.1f}x the time"
    )
    verify = []
    if args.verify:
        sys.path.insert(0, str(ROOT))
        from tests import mesh_real

        vt = Table(
            title="prediction vs real gloo processes (deep MLP, AdamW, CPU): per-rank peak, "
            "as the CPU allocator counts it"
        )
        for col in ("strategy", "ranks", "rank", "predicted", "real", "error"):
            vt.add_column(col, justify="right")
        for world in (2, 4):
            real = mesh_real.real_runs(world)
            for strategy in ("ddp", "zero1-torch", "fsdp"):
                predicted = estimate(**mesh_real.DATA_PARALLEL[world][strategy])
                per_rank = {r: ledger for ids, ledger in predicted.ranks for r in ids}
                for rank, (tracked, counted) in sorted(real[strategy].items()):
                    want = per_rank[rank].peak_bytes
                    err = (want - counted) / counted
                    verify.append(
                        {
                            "strategy": strategy,
                            "world": world,
                            "rank": rank,
                            "predicted": want,
                            "tracked": tracked,
                            "counted": counted,
                            "error": err,
                        }
                    )
                    vt.add_row(
                        strategy,
                        str(world),
                        str(rank),
                        format_bytes(want),
                        format_bytes(counted),
                        f"{100 * err:+.3f} %",
                    )
        console.print(vt)
        verify += deepspeed_verify(console)
    out = args.out or (
        ROOT
        / "benchmarks"
        / "results"
        / f"distributed-{datetime.date.today()}-{platform.node() or 'host'}.json"
    )
    out.write_text(
        json.dumps(
            {"llama2_7b_8gpu": rows, "zero_paper": paper, "scale_70b": scale, "verify": verify},
            indent=1,
            default=str,
        )
    )
    console.print(f"[dim]wrote {out}[/dim]")
    return compare.after_run(args, out)


def deepspeed_verify(console: Console) -> list[dict]:
    """DeepSpeed ZeRO-1/2 on gloo against each rank's prediction (tests/test_deepspeed_real.py):
    the peak of every rank as the CPU allocator counts it."""
    import tempfile

    from tests.test_deepspeed_real import CASES as DS_CASES
    from tests.test_deepspeed_real import _configs, _spec
    from tests.test_deepspeed_real import run_real as run_deepspeed

    table = Table(
        title="DeepSpeed ZeRO-1/2 vs real gloo processes (wide-vocabulary Llama, bf16-master "
        "AdamW, CPU): per-rank peak, CPU allocator's count"
    )
    for col in ("case", "ranks", "rank", "predicted", "real", "error", "traced as"):
        table.add_column(col, justify="right")
    out = []
    with tempfile.TemporaryDirectory() as folder:
        configs = _configs(Path(folder))
        for world in (2, 4):
            (real,) = run_deepspeed(world, configs)
            for case in DS_CASES:
                predicted = estimate(_spec(case, world, configs))
                owner = {r: ids[0] for ids, _ in predicted.ranks for r in ids}
                per_rank = {r: led for ids, led in predicted.ranks for r in ids}
                for rank, (tracked, counted, phases) in sorted(real[case].items()):
                    want = per_rank[rank].peak_bytes
                    err = (want - counted) / counted
                    out.append(
                        {
                            "strategy": f"deepspeed {case}",
                            "world": world,
                            "rank": rank,
                            "predicted": want,
                            "tracked": tracked,
                            "counted": counted,
                            "counted_phases": phases,
                            "traced_as": owner[rank],
                            "error": err,
                        }
                    )
                    table.add_row(
                        case,
                        str(world),
                        str(rank),
                        f"{want:,}",
                        f"{counted:,}",
                        f"{100 * err:+.3f} %",
                        "itself" if owner[rank] == rank else f"rank {owner[rank]}",
                    )
    console.print(table)
    return out


if __name__ == "__main__":
    sys.exit(main())
