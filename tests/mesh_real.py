"""Real gloo runs behind the multi-process tests of ``measure``'s engines (data parallel, FSDP
units, tensor/expert parallel, pipeline): one set of processes per world size runs the cases of
every test file (spawning the processes is most of the time), and each rank's prediction is
compared with the CPU allocator's own count of the real run (``cpu_allocator_count``, every
thread). The storage tracker's count is not the truth: it misses what gloo's worker threads hold
and the scratch CPU kernels allocate inside themselves (oneDNN's, whose size depends on the CPU).
"""

import functools

from vramledger import estimate
from vramledger.parallel.local import measure_on_local_gloo

from .conftest import FIXTURES, MODELS_PY

HUB = FIXTURES / "hub"
LLAMA = str(HUB / "tiny-llama-bf16")  # 4 query heads, 2 kv heads: tp 2
LLAMA_TP4 = str(HUB / "tiny-llama-tp4-bf16")  # 8 query heads, 4 kv heads: tp 4
LLAMA8 = str(HUB / "tiny-llama-8l-bf16")  # 8 layers (4 heads, 2 kv heads): stages, x tp 2
MOE = str(FIXTURES / "moe.py")
TEXT = dict(seq_len=32, target="cpu", precision="bf16-master")
NOISE = "benchmarks/results/noise-2026-12-02-vm.json"
"""Repeated real runs of every case here (``benchmarks/noise.py``): the allowances' sizes."""
EXACT_BYTES = 36
"""Per rank, what the allocator may count above or below the prediction in a case with no
allowance of its own: the README's earlier "within 36 bytes per rank" (it now says "within
0.002 %": :data:`README_RELATIVE`, held too). Small allocations no traced
storage accounts for (gloo's own bookkeeping tensors). In 20 runs of each case (``NOISE``) the
tensor, expert and pipeline cases are 0 to +32 bytes from the prediction (but one run of
``tp2``: :data:`GLOO_TP_BYTES`), DDP and ZeroRedundancyOptimizer 0 bytes, every run."""

README_RELATIVE = 2e-5
"""The README's "within 0.002 %" (tensor, expert and pipeline parallelism, every rank), held
with :data:`EXACT_BYTES` where no allowance names a case: 30 bytes on the smallest ranks here
(1.5 MB), which measure 16."""

TENSOR_PARALLEL = {
    2: {
        "tp2": dict(model=LLAMA, tp=2, batch_size=2, **TEXT),
        "ep2": dict(
            model=f"{MOE}:mixtral_grouped_balanced",
            inputs=f"{MOE}:inputs",
            loss=f"{MOE}:loss",
            dp_shard=2,
            ep=2,
            batch_size=1,
            seq_len=64,
            target="cpu",
        ),
    },
    4: {
        "tp4": dict(model=LLAMA_TP4, tp=4, batch_size=2, **TEXT),
        "tp2-fsdp2": dict(model=LLAMA, tp=2, dp_shard=2, batch_size=2, **TEXT),
    },
}
PIPELINE = {
    2: {
        "1f1b": dict(model=LLAMA8, pp=2, pp_schedule="1f1b", microbatches=4, batch_size=4, **TEXT),
        "gpipe": dict(
            model=LLAMA8, pp=2, pp_schedule="gpipe", microbatches=4, batch_size=4, **TEXT
        ),
        "interleaved": dict(
            model=LLAMA8,
            pp=2,
            pp_schedule="interleaved-1f1b",
            microbatches=4,
            batch_size=4,
            **TEXT,
        ),
    },
    4: {
        "pp4-1f1b": dict(
            model=LLAMA8, pp=4, pp_schedule="1f1b", microbatches=4, batch_size=4, **TEXT
        ),
        "pp2-fsdp2": dict(model=LLAMA8, pp=2, dp_shard=2, microbatches=2, batch_size=2, **TEXT),
        # 2 stages x tensor (and sequence) parallel over 2 ranks: the sequence's halves between
        # stages, loss parallel on the last
        "pp2-tp2": dict(
            model=LLAMA8, pp=2, tp=2, pp_schedule="1f1b", microbatches=2, batch_size=2, **TEXT
        ),
    },
    # All three axes: run by benchmarks/mesh.py, not by the tests (8 processes: about a minute
    # on 2 CPU cores, the suite is near its time budget)
    8: {
        "pp2-tp2-fsdp2": dict(
            model=LLAMA8,
            pp=2,
            tp=2,
            dp_shard=2,
            pp_schedule="1f1b",
            microbatches=2,
            batch_size=2,
            **TEXT,
        ),
    },
}

MLP = dict(
    model=f"{MODELS_PY}:deep_mlp",
    inputs=f"{MODELS_PY}:mlp_inputs",
    loss=f"{MODELS_PY}:mlp_loss",
    optimizer="adamw",
    target="cpu",
    batch_size=8,
)
LINEARS = dict(MLP, model=f"{MODELS_PY}:linear_stack", shard_modules=("Linear",))
"""Plain Linear layers as FSDP2 units (``--shard-modules Linear``; ``tests/test_fsdp_units.py``)."""
ACCELERATE_LLAMA = dict(
    model=str(FIXTURES / "tiny-llama.json"),
    seq_len=32,
    target="cpu",
    accelerate_config=str(FIXTURES / "accelerate" / "fsdp2-llama-bf16.yaml"),
)
"""An HF model wrapped as accelerate wraps it (its FSDP2 config; ``tests/test_fsdp_units.py``)."""


def _data_parallel(world: int) -> dict[str, dict]:
    """DDP, ZeroRedundancyOptimizer and FSDP2 (``tests/test_distributed_real.py``) and named
    FSDP2 units (``tests/test_fsdp_units.py``) on ``world`` processes."""
    cases = {s: dict(MLP, world_size=world, strategy=s) for s in ("ddp", "zero1-torch", "fsdp")}
    cases["fsdp-linear-units"] = dict(LINEARS, world_size=world, strategy="fsdp")
    if world == 2:
        # momentum SGD's foreach step on DTensors (the path CUDA takes by default)
        cases["fsdp-momentum-sgd"] = dict(
            MLP,
            model=f"{MODELS_PY}:wide_mlp",
            optimizer="sgd-momentum",
            optimizer_kwargs={"foreach": True},
            world_size=2,
            strategy="fsdp",
        )
        cases["fsdp-linear-units-keep"] = dict(
            LINEARS, world_size=2, strategy="fsdp", reshard_after_forward=False
        )
        cases["fsdp-accelerate"] = dict(ACCELERATE_LLAMA, world_size=2, strategy="fsdp")
    return cases


DATA_PARALLEL = {w: _data_parallel(w) for w in (2, 4)}

GLOO_FSDP2_BYTES: dict[tuple[int, str], tuple[int, int]] = {
    (2, "fsdp"): (0, 139_528),
    (2, "fsdp-linear-units"): (0, 131_592),
    (2, "fsdp-momentum-sgd"): (0, 2_104_328),
    (2, "fsdp-accelerate"): (0, 121_224),
    (4, "fsdp"): (0, 126_864),
    (4, "fsdp-linear-units"): (4_096, 193_280),
}
"""(world, case) -> (below, above): how far the allocator's count of one real FSDP2 run on gloo
may be from the prediction, on any rank. Measured in ``NOISE`` (groups ``gloo-2``/``gloo-4``,
20 runs of each case, 2 spawns x 10 rounds); each bound is the farthest count seen. Sources,
none in the estimate's model:

- the same few KiB in every run, on every rank: +6,664 bytes (``fsdp``, 2 ranks), +6,672 and
  +5,632 (4 ranks), +5,064 (``fsdp-accelerate``), +1,044 (``fsdp-momentum-sgd``): what gloo's
  collectives allocate on their worker threads, where no dispatch mode (the trace's or the
  tracker's) sees them;
- in some runs, on one rank, FSDP2 buffers a gloo worker thread frees late, still live at the
  peak. Runs of 20 with one, per rank: ``fsdp`` 4 and 4 (2 ranks; up to +139,528), 1, 0, 1, 1
  (4 ranks; up to +126,864); ``fsdp-linear-units`` 1 and 3 (2 ranks; up to +131,592), 1 on
  rank 3 of 4 (+193,280); ``fsdp-momentum-sgd`` 1 and 2 (+2,104,328: a 256 x 1024 fp32
  gradient and its momentum); ``fsdp-accelerate`` 1 and 0 (+85,640), and in a 21st run (the
  clean-clone suite at f6aeaab, the machine otherwise idle) +121,224 on rank 0;
- deterministic, rank 3 of 4 in ``fsdp-linear-units`` holds 4,096 bytes less than the estimate
  in 19 of 20 runs: it holds the short shards of the layers whose rows do not divide by 4, and
  the estimate gives every rank rank 0's ledger (a bound for the others).

DDP, ZeroRedundancyOptimizer, ``reshard_after_forward=False``, tensor parallelism with FSDP2
and the pipeline with FSDP2 need no allowance: the same count in every run, within
:data:`EXACT_BYTES`.
"""
GLOO_TP_BYTES: dict[tuple[int, str], tuple[int, int]] = {(2, "tp2"): (784, 264)}
"""(world, case) -> (below, above) for tensor parallelism on gloo: in 1 run of 20 of ``tp2``
(``NOISE``, group ``gloo-2``), rank 1 counted 264 bytes above the prediction (256 more than in
the other 19, and 256 more than its tracker saw): a small buffer a gloo worker thread freed
late. In a 21st run (the clean-clone suite at f6aeaab on 2026-12-02, the machine otherwise idle)
rank 0 counted 784 bytes below it: a small gloo buffer freed before the peak instead of after.
Every other tensor, expert and pipeline case was within :data:`EXACT_BYTES` in all runs."""
ALLOWANCE_BYTES = {**GLOO_FSDP2_BYTES, **GLOO_TP_BYTES}


@functools.cache
def real_runs(world: int) -> dict[str, dict[int, tuple[int, int]]]:
    """Every case of ``world`` processes, run once per test session."""
    return measure_on_local_gloo(world, world_cases(world))


def world_cases(world: int) -> dict[str, dict]:
    """Every multi-process case of ``world`` processes."""
    return {
        **DATA_PARALLEL.get(world, {}),
        **TENSOR_PARALLEL.get(world, {}),
        **PIPELINE.get(world, {}),
    }


def check_against_real_runs(world: int, cases: dict[str, dict]) -> None:
    """Every rank's prediction within its case's allowance (:data:`ALLOWANCE_BYTES`) of the
    allocator's count of one real run."""
    real = real_runs(world)
    for case, spec in cases.items():
        predicted = estimate(**spec)
        per_rank = {r: ledger.peak_bytes for ids, ledger in predicted.ranks for r in ids}
        assert sorted(per_rank) == sorted(real[case]) == list(range(world))
        named = ALLOWANCE_BYTES.get((world, case))
        below, above = named or (EXACT_BYTES, EXACT_BYTES)
        for rank, (_, counted) in real[case].items():
            want = per_rank[rank]
            assert -below <= counted - want <= above, (case, rank, want, counted, counted - want)
            if named is None:
                assert abs(counted - want) <= README_RELATIVE * counted, (case, rank, want, counted)
