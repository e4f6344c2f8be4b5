"""Per-rank predictions against real multi-process runs (gloo on CPU).

Each rank's real peak is measured as ``measure`` measures it; the dispatch-level tracker's count
is compared (torch.profiler's memory events miss frees made on gloo's worker threads, so its
per-rank total drifts high by up to a few MiB between runs)."""

import os
import socket

import pytest
import torch.multiprocessing as mp

from vramledger import estimate
from vramledger.categories import Phase
from vramledger.parallel.real import shut_down_group

from .conftest import MODELS_PY

pytestmark = pytest.mark.multiprocess
SPEC = dict(
    model=f"{MODELS_PY}:deep_mlp",
    inputs=f"{MODELS_PY}:mlp_inputs",
    loss=f"{MODELS_PY}:mlp_loss",
    optimizer="adamw",
    target="cpu",
    batch_size=8,
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, strategy, spec, port, queue):
    import torch.distributed as dist

    from vramledger.measure import measure

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        m = measure(device="cpu", world_size=world, strategy=strategy, **spec)
        queue.put(
            (
                rank,
                m.ledger.peak_bytes,
                m.measured_peak_bytes,
                {c.value: b for c, b in m.ledger.at_peak.items() if b},
                {p.value: b for p, b in m.ledger.phases.items()},
            )
        )
    finally:
        shut_down_group()


def run_real(
    world: int, strategy: str, spec: dict | None = None
) -> dict[int, tuple[int, int, dict, dict]]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, world, strategy, spec or SPEC, port, queue))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    results = {}
    for _ in procs:
        rank, *result = queue.get(timeout=300)
        results[rank] = tuple(result)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    return results


REAL_RUN_TRIES = 2
"""Real runs taken before a rank off the prediction fails the test. What a real gloo rank holds
at its peak varies between runs with the timing of gloo's worker threads, which free a
collective's buffers when they finish it: with 4 processes on 2 cores, one CI run saw FSDP's
rank 2 hold 94,848 bytes (5.6 %) more than in the runs before and after it."""


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("strategy", ["ddp", "zero1-torch", "fsdp"])
def test_per_rank_prediction_matches_real_processes(world, strategy):
    predicted = estimate(world_size=world, strategy=strategy, **SPEC)
    per_rank = {r: ledger.peak_bytes for ids, ledger in predicted.ranks for r in ids}
    for _ in range(REAL_RUN_TRIES):
        real = run_real(world, strategy)
        off = {
            rank: (per_rank[rank], tracked, at_peak)
            for rank, (tracked, _, at_peak, _) in real.items()
            if abs(per_rank[rank] - tracked) / tracked > 0.03
        }
        if not off:
            break
    assert not off, off
    for tracked, measured, _, _ in real.values():
        assert measured >= tracked  # the allocator sees at least every tensor


def test_fsdp_momentum_sgd_matches_real_processes():
    """Momentum SGD's foreach step takes DTensor's uncached sharding propagation, which allocates
    global-shape tensors under the trace's fake mode; they are not memory on a real rank."""
    spec = {
        **SPEC,
        "model": f"{MODELS_PY}:wide_mlp",
        "optimizer": "sgd-momentum",
        "optimizer_kwargs": {"foreach": True},  # the path CUDA takes by default
    }
    predicted = estimate(world_size=2, strategy="fsdp", **spec)
    per_rank = {r: ledger for ids, ledger in predicted.ranks for r in ids}
    for rank, (_, _, at_peak, phases) in run_real(2, "fsdp", spec).items():
        want = per_rank[rank].phases[Phase.OPTIMIZER]
        got = phases[Phase.OPTIMIZER.value]
        assert abs(want - got) / got <= 0.03, (rank, want, got, at_peak)


def test_measure_under_torchrun_reports_every_rank():
    import json
    import subprocess
    import sys
    from pathlib import Path

    from .conftest import fixture

    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [
        str(torchrun),
        "--nproc-per-node",
        "2",
        "--master-port",
        str(_free_port()),
        "-m",
        "vramledger.cli",
        "measure",
        fixture("tiny-llama.json"),
        "--strategy",
        "fsdp",
        "--target",
        "cpu",
        "--seq-len",
        "32",
        "--json",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    data = json.loads(done.stdout)  # rank 0 alone prints
    assert [r["rank"] for r in data["ranks_measured"]] == [0, 1]
    assert all(
        r["measured_peak_bytes"] >= r["tracked_peak_bytes"] > 0 for r in data["ranks_measured"]
    )
