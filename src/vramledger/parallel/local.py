"""Real multi-process runs on this machine: each case measured on ``world`` local gloo processes
(``vramledger.measure`` on every rank), to check per-rank predictions against real runs.

Each rank reports its tracked peak (the storage tracker, the estimate's categories) and the
allocator's own count (``measured_peak_bytes``: on CPU ``cpu_allocator_count``, every thread).
The processes are spawned (fresh interpreters), so a case is a dict of ``TrainingSpec`` fields.
"""

from __future__ import annotations

import os
import socket
from typing import Any

RESULT_TIMEOUT_S = 900
"""Longest wait for one rank's result of one case."""
POLL_S = 2
"""How often a wait for results checks that the processes are still alive."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, cases: dict[str, dict[str, Any]], queue: Any) -> None:
    import torch.distributed as dist

    from ..measure import measure
    from .real import shut_down_group

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        for case, spec in cases.items():
            m = measure(device="cpu", **spec)
            queue.put((case, rank, m.ledger.peak_bytes, m.measured_peak_bytes))
    finally:
        shut_down_group()


def measure_on_local_gloo(
    world: int, cases: dict[str, dict[str, Any]]
) -> dict[str, dict[int, tuple[int, int]]]:
    """Per case and rank: (tracked peak, the allocator's counted peak) of a real run on
    ``world`` gloo processes on this CPU. Raises if a process fails."""
    import torch.multiprocessing as mp

    from .. import cpu_allocator_count

    cpu_allocator_count.build()  # compiled once here, loaded by the workers
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, cases, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results: dict[str, dict[int, tuple[int, int]]] = {case: {} for case in cases}
    try:
        for _ in range(world * len(cases)):
            case, rank, tracked, counted = _next_result(queue, procs)
            results[case][rank] = (tracked, counted)
    finally:
        for p in procs:
            p.join(timeout=120)
            if p.is_alive():
                p.kill()
    failed = [p.exitcode for p in procs if p.exitcode != 0]
    if failed:
        raise RuntimeError(f"{len(failed)} of {world} processes failed (exit codes {failed})")
    return results


def _next_result(queue: Any, procs: list[Any]) -> tuple[str, int, int, int]:
    """The next rank's result; a process that died first is reported at once, not after the
    timeout (its traceback is on its stderr)."""
    import queue as queues
    import time

    deadline = time.monotonic() + RESULT_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            return queue.get(timeout=POLL_S)
        except queues.Empty:
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if dead:
                raise RuntimeError(
                    f"a gloo process died (exit codes {dead}); see its stderr"
                ) from None
    raise TimeoutError(f"no result from the gloo processes in {RESULT_TIMEOUT_S} s")
