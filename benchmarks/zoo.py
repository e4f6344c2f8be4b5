"""Sweep the transformers model zoo: every architecture's estimate against its real CPU run.

    python benchmarks/zoo.py                       # everything, 2 workers (~1 h on 2 cores)
    python benchmarks/zoo.py --sample 12 --no-distributed      # a deterministic sample (CI)
    python benchmarks/zoo.py --only llama,bert --tasks causal-lm,masked-lm
    python benchmarks/zoo.py --precisions fp32,bf16-master --dtype-variants none
    python benchmarks/zoo.py --retriage benchmarks/results/zoo-DATE-HOST.json   # no runs
    python benchmarks/zoo.py --cases llama:causal-lm --compare OLD.json   # same answers?

Every model type of the installed transformers with a causal-LM, masked-LM, seq2seq-LM,
image-classification, sequence-classification or audio (audio classification, CTC, speech
seq2seq) head in transformers' own auto mappings (``--tasks token-classification,
image-text-to-text`` adds those) is built from its config class's defaults, shrunk generically
(2 layers, width 64, 4 heads, feed-forward 128, vocabulary 1024, 4 experts, 64-pixel images;
``shrink``; LayerDrop off, ``LAYERDROP_SUFFIX``), and saved as transformers saves it
(``save_pretrained``) twice: with a declared checkpoint dtype (``"dtype": "bfloat16"``) and
without one. For each precision and config variant,
``vramledger.estimate(model=config.json, task=HEAD, target="cpu")`` of the steady-state step peak
(``peak_bytes``) is compared with the real CPU run of the same step (``vramledger.measure``; its
``measured_peak_bytes`` is the CPU allocator's own count): error = (estimate - measured) /
measured. Batch 2 x 32 tokens, AdamW. Each (architecture, head)
runs in its own subprocess, with a timeout per run.

Before vramledger sees a config, the head's model built from it takes one plain PyTorch
training step (``plain_step``); a shrink level whose model cannot is replaced by the next
(``SHRINK_LEVELS``), and where none can, vramledger's failure with the same error is put down to
the model or its inputs, not to vramledger. Only what cannot be built from a config at all is
skipped, and counted with the reason.

A per-rank sample: DDP and FSDP estimates (``world_size=2``) of a few architectures against real
2-process gloo runs (``torchrun -m vramledger.cli measure ... --json``, ``ranks_measured``),
every rank compared.

Targets: >= 95 % of the runs estimated without error, >= 90 % within 0.5 % of the real run.
Output: a table, the totals and every failure grouped by cause, written to
benchmarks/results/zoo-<date>-<host>.{json,txt}; ``--compare`` an earlier JSON compares every
answer, not the times (``benchkit/compare.py``).

This file is the command line; the sweep lives in ``benchkit/zoo/`` (``settings``,
``shrink_keys`` and ``shrink``, ``cases``, ``build``, ``worker``, ``sweep``, ``results``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

from benchkit import compare
from benchkit.zoo.cases import (
    DISTRIBUTED_SAMPLE,
    DISTRIBUTED_STRATEGIES,
    HEADS,
    Case,
    enumerate_cases,
    select_cases,
)
from benchkit.zoo.results import distributed_table, environment, summary, table, totals, triage
from benchkit.zoo.settings import (
    BATCH_SIZE,
    DTYPE_VARIANTS,
    MAX_PARAMETERS,
    OPTIMIZER,
    PRECISIONS,
    RESULTS,
    RUN_TIMEOUT_S,
    SEQ_LEN,
    TARGET,
    THREADS_PER_WORKER,
    WORKERS,
)
from benchkit.zoo.shrink_keys import (
    EXPERTS,
    EXPERTS_PER_TOKEN,
    HIDDEN,
    IMAGE_SIZE,
    INTERMEDIATE,
    KV_HEADS,
    LAYERS,
    NUM_HEADS,
    PATCH_SIZE,
    POSITIONS,
    VOCAB,
)
from benchkit.zoo.sweep import Options, judge_distributed, run_distributed, sweep
from benchkit.zoo.worker import distributed_worker, worker


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--workers", type=int, default=WORKERS, help=f"parallel cases (default {WORKERS})"
    )
    p.add_argument("--only", help="architectures (model types), comma-separated")
    p.add_argument(
        "--tasks",
        help="heads, comma-separated (default: all but those marked *): "
        + ", ".join(h.task + ("" if h.default else "*") for h in HEADS),
    )
    p.add_argument("--sample", type=int, help="a deterministic sample of N cases")
    p.add_argument(
        "--cases", help="these cases only, comma-separated ARCH:HEAD (e.g. llama:causal-lm)"
    )
    p.add_argument(
        "--precisions",
        default=",".join(PRECISIONS),
        help=f"comma-separated vramledger precisions (default {','.join(PRECISIONS)})",
    )
    p.add_argument(
        "--dtype-variants",
        default=",".join(DTYPE_VARIANTS),
        help="config.json declares no dtype (none) and/or this dtype (default none,bfloat16)",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=RUN_TIMEOUT_S,
        help=f"seconds per run (default {RUN_TIMEOUT_S})",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=THREADS_PER_WORKER,
        help=f"torch threads per worker (default {THREADS_PER_WORKER})",
    )
    p.add_argument("--no-distributed", action="store_true", help="skip the per-rank sample")
    p.add_argument("--distributed-only", action="store_true", help="only the per-rank sample")
    p.add_argument(
        "--out", type=Path, help="JSON output (default benchmarks/results/zoo-DATE-HOST.json)"
    )
    p.add_argument("--list", action="store_true", help="list the cases and exit")
    p.add_argument(
        "--retriage",
        type=Path,
        metavar="ZOO.json",
        help="recompute the totals, triage and text of an earlier result (no runs)",
    )
    compare.add_arguments(p, out=False)
    return p.parse_args(argv)


def _csv(text: str | None) -> list[str]:
    """Comma-separated names, in order."""
    return [t.strip() for t in text.split(",") if t.strip()] if text else []


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--_worker"]:
        arch, task, cls, folder, *runs = argv[1:]
        worker(Case(arch, task, cls), [tuple(r.split("/")) for r in runs], Path(folder))
        return 0
    if argv[:1] == ["--_distributed"]:
        arch, task, cls, strategy, folder = argv[1:]
        distributed_worker(Case(arch, task, cls), strategy, Path(folder))
        return 0
    args = parse_args(argv)
    if (status := compare.against_only(args)) is not None:
        return status
    if args.retriage:
        out = args.out or args.retriage
        return retriage(args.retriage, out) or compare.after_run(args, out)
    from vramledger.inputs.precision import PRECISIONS as KNOWN_PRECISIONS

    tasks = set(_csv(args.tasks)) | {n.split(":", 1)[-1] for n in _csv(args.cases)}
    for option, given, known in (
        ("--tasks", tasks, {h.task for h in HEADS}),
        ("--precisions", set(_csv(args.precisions)), set(KNOWN_PRECISIONS)),
        ("--dtype-variants", set(_csv(args.dtype_variants)), set(DTYPE_VARIANTS)),
    ):
        if given - known:
            raise SystemExit(f"{option}: unknown {sorted(given - known)}; use {sorted(known)}")
    cases = select_cases(
        enumerate_cases(tasks), set(_csv(args.only)), args.sample, _csv(args.cases)
    )
    if args.list:
        print("\n".join(c.name for c in cases))
        return 0
    options = Options(
        precisions=tuple(_csv(args.precisions)),
        variants=tuple(_csv(args.dtype_variants)),
        timeout_s=args.timeout,
        threads=args.threads,
    )
    start = time.perf_counter()
    records = [] if args.distributed_only else sweep(cases, options, args.workers)
    dist_results = []
    if not args.no_distributed:
        chosen = args.only or args.tasks or args.cases or args.sample is not None
        wanted = {c.name for c in cases} if chosen else None
        dist_cases = [
            c
            for c in enumerate_cases()
            if (c.arch, c.task) in DISTRIBUTED_SAMPLE and (wanted is None or c.name in wanted)
        ]
        for c in dist_cases:
            for strategy in DISTRIBUTED_STRATEGIES:
                r = run_distributed(c, strategy, options)
                print(f"per-rank {c.name} {strategy}: {r['status']}", flush=True)
                dist_results.append(r)
    result = {
        "benchmark": "zoo",
        "command": " ".join([Path(sys.argv[0]).name, *argv]),
        "environment": environment(),
        "step": {
            "batch_size": BATCH_SIZE,
            "seq_len": SEQ_LEN,
            "optimizer": OPTIMIZER,
            "target": TARGET,
            "precisions": list(options.precisions),
            "dtype_variants": list(options.variants),
            "compared": "estimate.peak_bytes vs measure(...).measured_peak_bytes "
            "(CPU allocator's count, torch.profiler memory events)",
        },
        "shrink": {
            "layers": LAYERS,
            "hidden": HIDDEN,
            "heads": NUM_HEADS,
            "kv_heads": KV_HEADS,
            "intermediate": INTERMEDIATE,
            "vocab": VOCAB,
            "positions": POSITIONS,
            "experts": EXPERTS,
            "experts_per_token": EXPERTS_PER_TOKEN,
            "image_size": IMAGE_SIZE,
            "patch_size": PATCH_SIZE,
            "max_parameters": MAX_PARAMETERS,
        },
        "workers": args.workers,
        "threads_per_worker": options.threads,
        "seconds": time.perf_counter() - start,
        "records": records,
        "distributed": dist_results,
    }
    out = args.out or RESULTS / f"zoo-{datetime.date.today()}-{platform.node() or 'host'}.json"
    report(result, out)
    return compare.after_run(args, out)


def report(result: dict[str, Any], out: Path) -> None:
    """Totals and triage from the records; print the table, totals and failures; write the
    JSON and the text beside it."""
    records, dist_results = result["records"], result["distributed"]
    result["totals"] = totals(records)
    result["triage"] = triage(records)
    text = "\n\n".join(
        ([table(records), summary(result)] if records else [])
        + ([distributed_table(dist_results)] if dist_results else [])
    )
    print(text)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1, default=str) + "\n")
    out.with_suffix(".txt").write_text(text + "\n")
    print(f"\nwritten: {out} and {out.with_suffix('.txt').name}")


def retriage(path: Path, out: Path | None) -> int:
    result = json.loads(path.read_text())
    result["distributed"] = [judge_distributed(r) for r in result.get("distributed", [])]
    report(result, out or path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
