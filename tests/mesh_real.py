"""Real gloo runs behind the multi-process tests of ``measure``'s engines (data parallel, FSDP
units, tensor/expert parallel, pipeline): one set of processes per world size runs the cases of
every test file (spawning the processes is most of the time), and each rank's prediction is
compared with the CPU allocator's own count of the real run (``cpu_allocator_count``, every
thread). The storage tracker's count is not the truth: it misses what gloo's worker threads hold
and the scratch CPU kernels allocate inside themselves (oneDNN's, whose size depends on the CPU).
"""

import functools

from vramledger import estimate
from vramledger.measure.local import measure_on_local_gloo

from .conftest import FIXTURES, MODELS_PY
from .gloo_noise import largest_transient_collective, late_free_window

HUB = FIXTURES / "hub"
LLAMA = str(HUB / "tiny-llama-bf16")  # 4 query heads, 2 kv heads: tp 2
LLAMA_TP4 = str(HUB / "tiny-llama-tp4-bf16")  # 8 query heads, 4 kv heads: tp 4
LLAMA8 = str(HUB / "tiny-llama-8l-bf16")  # 8 layers (4 heads, 2 kv heads): stages, x tp 2
MOE = str(FIXTURES / "moe.py")
TEXT = dict(seq_len=32, target="cpu", precision="bf16-master")
NOISE = "benchmarks/results/noise-2026-12-02-vm.json"
"""Repeated real runs of every case here (``benchmarks/noise.py``): the allowances' sizes."""
EXACT_BYTES = 36
"""Per rank, what the allocator may count above or below the prediction where the step has no
transient collective (DDP, ZeroRedundancyOptimizer, the pipeline's stages), and the base of the
window where it has one (``tests/gloo_noise.py``): the README's "within 36 bytes per rank".
Small allocations no traced storage accounts for (gloo's own bookkeeping tensors). In 20 runs
of each case (``NOISE``) the tensor, expert and pipeline cases are 0 to +32 bytes from the
prediction but for one late free, DDP and ZeroRedundancyOptimizer 0 bytes, every run."""

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
    """Every rank's prediction within its window (``tests/gloo_noise.py``) of the allocator's
    count of one real run: :data:`EXACT_BYTES`, widened by one collective's buffers where the
    rank's step has a transient collective (a gloo worker thread may free them late or early).
    Where it has none, the README's relative bound holds too."""
    real = real_runs(world)
    for case, spec in cases.items():
        predicted = estimate(**spec)
        per_rank = {r: ledger for ids, ledger in predicted.ranks for r in ids}
        assert sorted(per_rank) == sorted(real[case]) == list(range(world))
        for rank, (_, counted) in real[case].items():
            ledger = per_rank[rank]
            collective = largest_transient_collective(ledger)
            below, above = late_free_window(EXACT_BYTES, collective)
            want = ledger.peak_bytes
            assert -below <= counted - want <= above, (case, rank, want, counted, counted - want)
            if collective == 0:
                assert abs(counted - want) <= README_RELATIVE * counted, (case, rank, want, counted)
