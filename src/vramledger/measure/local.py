"""Real multi-process runs on this machine: ``world`` fresh gloo processes, each running a
function as one rank, their results sent back on a queue (:func:`run_on_local_gloo`, the one
harness the multi-process tests and benchmarks use), and the common case of it: each case
measured by ``vramledger.measure`` on every rank (:func:`measure_on_local_gloo`), to check
per-rank predictions against real runs.

Each rank reports its tracked peak (the storage tracker, the estimate's categories) and the
allocator's own count (``measured_peak_bytes``: on CPU ``cpu_allocator_count``, every thread).
The processes are spawned (fresh interpreters), so a case is a dict of ``TrainingSpec`` fields
and the function a rank runs is a module-level function. Each runs with the caller's intra-op
thread count: a CPU kernel's scratch depends on it (``trace/core/cpu_scratch.py``), and a fresh
interpreter would take torch's default instead, which is not the caller's when anything in the
caller changed it (then its estimate and the real run pick different kernels).
"""

from __future__ import annotations

import os
import queue as queues
import socket
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from vramledger.measure import cpu_allocator_count, measure
from vramledger.parallel.real import shut_down_group

RESULT_TIMEOUT_S = 900
"""Longest wait for one rank's result of one case."""
POLL_S = 2
"""How often a wait for results checks that the processes are still alive."""
JOIN_TIMEOUT_S = 120
"""How long a finished process may take to exit before it is killed."""

RankWork = Callable[..., None]
"""``work(rank, world, queue, *args)``: one rank's part, run inside its gloo process group;
it puts its results on ``queue``."""


def free_port() -> int:
    """A TCP port free on this machine now (for ``MASTER_PORT``, torchrun's ``--master-port``)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_on_local_gloo(
    world: int,
    work: RankWork,
    args: Sequence[Any],
    results: int,
    stop_on: Callable[[Any], bool] | None = None,
) -> list[Any]:
    """Run ``work(rank, world, queue, *args)`` on ``world`` spawned processes, each rank in one
    gloo process group (``MASTER_ADDR``/``MASTER_PORT`` on this machine, ``LOCAL_RANK`` set as
    torchrun sets it), and return the ``results`` items the ranks put on the queue, in the
    order they came. Raises at once if a process dies, and if one exits with an error.
    ``stop_on``: an item for which it is true (a rank that failed, while the others may wait
    for it in a collective) ends the wait at once: the processes are killed and the items so
    far returned, that one last."""
    cpu_allocator_count.build()  # compiled once here, loaded by the workers
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(rank, world, port, torch.get_num_threads(), work, tuple(args), queue),
        )
        for rank in range(world)
    ]
    for p in procs:
        p.start()
    out: list[Any] = []
    stopped = False
    try:
        while len(out) < results and not stopped:
            out.append(_next_result(queue, procs))
            stopped = stop_on is not None and stop_on(out[-1])
    finally:
        for p in procs:
            p.join(timeout=0 if stopped else JOIN_TIMEOUT_S)
            if p.is_alive():
                p.kill()
                p.join()
    if stopped:
        return out
    failed = [p.exitcode for p in procs if p.exitcode != 0]
    if failed:
        raise RuntimeError(f"{len(failed)} of {world} processes failed (exit codes {failed})")
    return out


def _rank_main(
    rank: int,
    world: int,
    port: int,
    threads: int,
    work: RankWork,
    args: tuple[Any, ...],
    queue: Any,
) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(rank))
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        work(rank, world, queue, *args)
    finally:
        shut_down_group()


def _next_result(queue: Any, procs: list[Any]) -> Any:
    """The next rank's result; a process that died first is reported at once, not after the
    timeout (its traceback is on its stderr)."""
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


def _measure_cases(rank: int, world: int, queue: Any, cases: dict[str, dict[str, Any]]) -> None:
    for case, spec in cases.items():
        m = measure(device="cpu", **spec)
        queue.put((case, rank, m.ledger.peak_bytes, m.measured_peak_bytes))


def measure_on_local_gloo(
    world: int, cases: dict[str, dict[str, Any]]
) -> dict[str, dict[int, tuple[int, int]]]:
    """Per case and rank: (tracked peak, the allocator's counted peak) of a real run on
    ``world`` gloo processes on this CPU. Raises if a process fails."""
    results: dict[str, dict[int, tuple[int, int]]] = {case: {} for case in cases}
    for case, rank, tracked, counted in run_on_local_gloo(
        world, _measure_cases, (cases,), world * len(cases)
    ):
        results[case][rank] = (tracked, counted)
    return results
