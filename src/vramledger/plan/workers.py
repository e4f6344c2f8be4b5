"""The worker processes that trace and estimate beside the planner and ``fit``.

Workers are fresh processes forked from a fork server that imported what they need
(``worker_preload.py``: nothing but imports has run in it, so forking it is safe; the process
asking already runs threads, so forking it is not), or spawned where there is no fork server
(Windows). They copy the asking process's logger levels and warning filters: a CLI run silences
libraries' import-time chatter, and so do its workers.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.forkserver
import os
import warnings
from concurrent.futures import ProcessPoolExecutor
from typing import Any

WORKERS_AT_ONCE_PARAMETERS = 1_000_000_000
"""Models this large start workers before their first trace has timed them: their traces take
seconds each, so the workers always repay their start-up
(``benchmarks/results/README-startup.md``)."""


def available_cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def start_pool(workers: int, preload: tuple[str, ...] = ()) -> ProcessPoolExecutor:
    """``workers`` worker processes, started now. This returns when the first has started: after
    the fork server's imports (``preload``: modules to import there beside
    ``worker_preload.py``'s, such as the model's own code). Start it in a thread for that to
    overlap other work (``fit_estimates.py``)."""
    pool = ProcessPoolExecutor(
        workers,
        mp_context=_worker_context(preload),
        initializer=_quiet_like,
        initargs=_quiet_settings(),
    )
    # The pool starts a process per task submitted: start them all now.
    for _ in range(workers):
        pool.submit(_started)
    return pool


def start_fork_server(preload: tuple[str, ...] = ()) -> None:
    """Start the fork server now, without waiting for its imports: a pool started later
    (``start_pool``) forks its workers from it, ready sooner. Nothing where there is no fork
    server."""
    if "forkserver" in multiprocessing.get_all_start_methods():
        _worker_context(preload)
        multiprocessing.forkserver.ensure_running()


def _worker_context(preload: tuple[str, ...]) -> Any:
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    # A process has one fork server: the preload it was started with (by start_fork_server or
    # the first pool) is the one it keeps.
    context.set_forkserver_preload([f"{__package__}.worker_preload", *preload])
    return context


def _started() -> None:
    """A worker's first task: nothing (it makes the pool start the process)."""


def _quiet_settings() -> tuple[dict[str, int], list[Any]]:
    """This process's logger levels and warning filters, for the workers to copy."""
    levels = {
        name: logger.level
        for name, logger in logging.root.manager.loggerDict.items()
        if isinstance(logger, logging.Logger) and logger.level
    }
    return levels, list(warnings.filters)


def _quiet_like(levels: dict[str, int], filters: list[Any]) -> None:
    for name, level in levels.items():
        logging.getLogger(name).setLevel(level)
    warnings.filters[:] = filters
