"""DeepSpeed ZeRO-1/2/3 per rank: the estimate (DeepSpeed's engine on fake tensors and a fake
process group) against real multi-process runs of the same engine on gloo.

Each real rank is counted by a counting wrapper around the CPU allocator (``cpu_allocator_count``:
every thread, so gloo's frees on its worker threads are seen, and the scratch CPU kernels take
inside themselves). The per-rank prediction is compared with that count, phase by phase of the
steady step. The storage tracker's count is not compared: it cannot see kernel scratch, whose
size depends on the CPU (oneDNN's bf16 matmul: on this AVX512-BF16 machine the allocator counts
up to ~0.1 MB more than the tracker on these cases, with oneDNN held to AVX-512 without bf16
instructions 247,400 bytes more on rank 0 of the 4-rank small-bucket ZeRO-2 case, which another
machine's run saw as 253,544 and failed on), while the estimate probes the kernels on the
machine it runs on and matched the count on every rank in both."""

import json

import pytest

from vramledger import TrainingSpec, estimate
from vramledger.inputs.categories import Phase
from vramledger.measure import cpu_allocator_count
from vramledger.measure.deepspeed import measure_deepspeed
from vramledger.measure.local import run_on_local_gloo
from vramledger.predict.step import rank_ledger

from .conftest import fixture
from .gloo_noise import (
    DEEPSPEED_DEFAULT_BUCKET_ELEMENTS,
    deepspeed_reduction_bytes,
    late_free_window,
)

pytestmark = pytest.mark.multiprocess
pytest.importorskip("deepspeed")

SPEC = dict(
    # embedding and head 512 Ki elements each, 95 % of the model: on 2 and 4 ranks the
    # partitions cut through them, and the ranks keep different amounts of gradients
    model=fixture("wide-vocab-llama.json"),
    seq_len=8,
    batch_size=1,
    precision="bf16-master",
    optimizer="adamw",
    target="cpu",
)
SMALL_BUCKET = 100_000
"""reduce_bucket_size (elements) of the ``--deepspeed`` cases: several reductions per backward,
so ranks make their kept gradients at different times (DeepSpeed's default, 5e8, allocates a
1 GB bucket that dominates every rank's peak)."""
CASES = {
    "zero1": {},
    "zero2": {},
    "zero3": {},
    "ds-stage1": {},
    "ds-stage2": {"optimizer": "sgd"},
    "ds-stage3": {},
}
"""Case -> spec fields. With plain SGD the step's own buffers (the flat partition, its fp32
copy, each gradient piece in fp64 for the norm) make the peak, and it differs by rank. ZeRO-3
(``zero3``, ``ds-stage3``: DeepSpeed's ``DeepSpeedZeroOptimizer_Stage3``, one traced rank
standing for all) measured 2026-12-07 on this 2-core VM, one run each: the peak exact on every
rank at 2 ranks (1,014,940,561; ds-stage3 15,140,561) and for ds-stage3 at 4 (8,742,765); the
steady backward phase of ``zero3`` +1,624,924 bytes on every rank at 2 and at 4 ranks (so its
4-rank peak, 1,008,542,765 predicted, is counted +1,080,524), ds-stage3's −4,224. The +1.6 MB
is real and on the main thread (the tracked real run sees it too): at the real backward peak,
during the reduce-scatter of the bucket (all 1.07 M gradients, 2,134,336 bytes), a second
2,134,336-byte storage first seen at ``aten.split.Tensor`` is live beside DeepSpeed's
``torch.cat`` of the padded partitions; the fake process group's reduce-scatter makes none (a
gloo-side copy of the collective's input, not traced further). It lies inside the same window
as the other cases (one reduction's input and output, :func:`late_free_window`)."""
PHASES = (Phase.FORWARD, Phase.BACKWARD, Phase.OPTIMIZER)
ZERO3_RANK_PHASE_BYTES = 4_224
"""ZeRO-3 traces one rank for every rank (``Parallelism.rank_independent``). Each rank traced as
itself (2026-12-07, ``predict.step.rank_ledger``): every peak the same; ``zero3`` on 2 ranks,
rank 1's backward phase 4,224 B above rank 0's (1,012,271,261 vs 1,012,267,037; not traced
further); equal on 4 ranks and for ``ds-stage3``, which is held to equality. Under ``zero3``
the untraced rank's phases may exceed the traced one's by this much."""
NOISE = "benchmarks/results/noise-2026-12-02-vm.json"
"""20 real runs of every case here (``benchmarks/noise.py``, groups ``deepspeed-2/4``)."""
EXACT_BYTES = 18
"""Per rank and phase, how far the allocator's count may be from the prediction where no
allowance below names a case: the README's "within 18 bytes"."""
BUCKET_ELEMENTS = {
    "zero1": DEEPSPEED_DEFAULT_BUCKET_ELEMENTS,
    "zero2": DEEPSPEED_DEFAULT_BUCKET_ELEMENTS,
    "zero3": DEEPSPEED_DEFAULT_BUCKET_ELEMENTS,
    "ds-stage1": SMALL_BUCKET,
    "ds-stage2": SMALL_BUCKET,
    "ds-stage3": SMALL_BUCKET,
}
"""Case -> reduce_bucket_size: the largest reduction gloo's worker thread may free late (or
early) is a bucket's worth of gradients (``tests/gloo_noise.py``). Measured in ``NOISE`` (20 runs
of each case in one spawn) and the clean-clone suites: the peak and every phase within
:data:`EXACT_BYTES` in 19-20 runs of 20 per rank; once in 20 on a rank a reduction freed late:
+1,068,668 / +1,066,684 bytes (default bucket, 2 ranks: all 1.1 M gradients in one bucket),
+8,896 … +37,194 (small bucket, backward; seen on 2 and on 4 ranks). The ranks that share a
traced rank's ledger (rank 3 of ``ds-stage1``, rank 0 of ``ds-stage2`` on 4) are 37,184-37,188
bytes below it in the backward pass in every run: the bound holds."""


def _spec(case: str, world: int, configs: dict[str, str]) -> TrainingSpec:
    fields = {**SPEC, **CASES[case]}
    if case in configs:
        return TrainingSpec(world_size=world, deepspeed=configs[case], **fields)
    return TrainingSpec(world_size=world, strategy=case, **fields)


def _configs(folder) -> dict[str, str]:
    """A DeepSpeed config per ``ds-stageN`` case (read by --deepspeed)."""
    out = {}
    for stage in (1, 2, 3):
        path = folder / f"ds_stage{stage}.json"
        zero = {"stage": stage, "reduce_bucket_size": SMALL_BUCKET}
        path.write_text(json.dumps({"zero_optimization": zero, "bf16": {"enabled": True}}))
        out[f"ds-stage{stage}"] = str(path)
    return out


def _rank(rank, world, queue, configs, cases, repeats):
    for round_ in range(repeats):
        for case in cases:
            _measure_case(round_, case, rank, world, configs, queue)


def _measure_case(round_, case, rank, world, configs, queue):
    m = measure_deepspeed(_spec(case, world, configs))
    phases = {
        phase: max(v for (step, p), v in m.counted_phase_peaks.items() if step >= 2 and p == phase)
        for phase in (p.value for p in PHASES)
    }
    queue.put((round_, case, rank, m.ledger.peak_bytes, m.counted_peak_bytes, phases))


def run_real(
    world: int, configs: dict[str, str], cases: tuple[str, ...] = tuple(CASES), repeats: int = 1
) -> list[dict[str, dict[int, tuple[int, int, dict]]]]:
    """One spawn of ``world`` processes running ``cases`` ``repeats`` times in turn: per round,
    case and rank, (tracked peak, counted peak, counted peak of each steady phase)."""
    results: list[dict[str, dict[int, tuple[int, int, dict]]]] = [
        {case: {} for case in cases} for _ in range(repeats)
    ]
    args = (configs, list(cases), repeats)
    for round_, case, rank, *result in run_on_local_gloo(
        world, _rank, args, world * len(cases) * repeats
    ):
        results[round_][case][rank] = tuple(result)
    return results


@pytest.mark.parametrize("world", [2, 4])
def test_deepspeed_per_rank_prediction_matches_real_processes(world, tmp_path):
    configs = _configs(tmp_path)
    (real,) = run_real(world, configs)
    for case in CASES:
        predicted = estimate(_spec(case, world, configs))
        per_rank = {r: ledger for ids, ledger in predicted.ranks for r in ids}
        traced = {ids[0] for ids, _ in predicted.ranks}
        for rank, (_, counted, phases) in real[case].items():
            ledger = per_rank[rank]
            if rank not in traced:  # its group's first rank's ledger is its bound from above;
                # traced as itself, it is exact (4 ranks: ds-stage1's rank 3 37,184 B and
                # ds-stage2's rank 0 37,188 B in backward below their bounds; zero1/zero2 equal)
                bound, ledger = ledger, rank_ledger(_spec(case, world, configs), rank=rank)
                slack = ZERO3_RANK_PHASE_BYTES if case == "zero3" else 0
                assert ledger.peak_bytes <= bound.peak_bytes, (case, rank)
                assert all(ledger.phases[p] <= bound.phases[p] + slack for p in PHASES), (
                    case,
                    rank,
                    {p.value: ledger.phases[p] - bound.phases[p] for p in PHASES},
                )
            reduction = deepspeed_reduction_bytes(ledger, BUCKET_ELEMENTS[case])
            below, above = late_free_window(EXACT_BYTES, reduction)

            def close(want: int, got: int, below: int = below, above: int = above) -> bool:
                return -below <= got - want <= above

            assert close(ledger.peak_bytes, counted), (case, rank, ledger.peak_bytes, counted)
            for phase in PHASES:
                got = phases[phase.value]
                assert close(ledger.phases[phase], got), (case, rank, phase, got)
    # the ranks differ, and each is predicted as itself: in the optimizer step, where the
    # partitions' gradients are (the peak itself may be a CPU kernel's scratch, the same on all)
    step = {phases[Phase.OPTIMIZER.value] for _, _, phases in real["ds-stage2"].values()}
    assert len(step) > 1, step


def test_cpu_allocator_count_sees_every_thread():
    """The count behind these checks: allocations and frees on other threads are counted (the
    profiler's memory events miss gloo's), and storages from before ``install`` are not."""
    import subprocess
    import sys

    cpu_allocator_count.build()
    code = """
import threading, torch
from vramledger.measure import cpu_allocator_count as count
early = torch.empty(1000)
count.install()
assert count.live() == 0
kept = []
t = threading.Thread(target=lambda: kept.append(torch.empty(250_000)))
t.start(); t.join()
assert count.live() == 1_000_000, count.live()
t = threading.Thread(target=kept.clear)
t.start(); t.join()
del early
assert count.live() == 0 and count.peak() == 1_000_000, (count.live(), count.peak())
count.reset_peak()
assert count.peak() == 0
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
