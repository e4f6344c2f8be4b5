"""Where the planner's traces and re-estimates run: here, or ahead in worker processes.

A plan of a 70B model makes a few single-GPU traces and a dozen or more re-estimates with the
real engines, seconds each, most of them independent. The first trace runs here and times the
model: if it took long enough to repay starting workers, the other traces run in worker
processes (``spawn``: fresh interpreters, nothing shared with this one) while the search works
through those already back, and the re-estimates the answers will most likely need run ahead
there in the order the planner will ask for them. The values are the same with or without
workers; only the wall time changes.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import time
import warnings
from collections.abc import Hashable, Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from typing import Any

from ..spec import TrainingSpec
from ..timeline import Timeline

WORKER_MIN_TRACE_SECONDS = 1.0
"""Workers start only when the first trace took at least this long: starting one costs about a
second here (an interpreter importing torch), which small models do not repay."""


def traced_timeline(spec: TrainingSpec) -> Timeline:
    """The single-GPU fake-tensor trace the search derives strategies from (on the spec's GPU)."""
    from ..predict import policy_for
    from ..trace.fake import trace

    return trace(spec, policy_for(spec)).timeline


def reserved_peak(spec: TrainingSpec) -> tuple[int, int]:
    """What the real engines say ``spec`` reserves on its worst GPU, and that rank's host bytes
    (what it offloads)."""
    from ..predict import estimate

    ledger = estimate(spec)
    return ledger.reserved_peak_bytes, ledger.host_bytes


def available_cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


class Runner:
    """Traces and memoised re-estimates (reserved peak bytes) for one plan."""

    def __init__(self, workers: int | None):
        """``workers``: processes to use; None: one per CPU if the first trace is slow enough."""
        self.workers = workers
        self._values: dict[Hashable, tuple[int, int]] = {}
        self._pending: dict[Hashable, tuple[TrainingSpec, Future[tuple[int, int]]]] = {}
        self._pool: ProcessPoolExecutor | None = None

    # -- traces ------------------------------------------------------------------------------
    def traces(self, specs: list[TrainingSpec]) -> Iterator[tuple[TrainingSpec, Timeline]]:
        """The single-GPU trace of each spec, in order."""
        if not specs:
            return
        start = time.perf_counter()
        first = traced_timeline(specs[0])
        seconds = time.perf_counter() - start
        if self.workers is None:
            self.workers = available_cpus() if seconds >= WORKER_MIN_TRACE_SECONDS else 1
        self._start()
        rest = [self._submit(traced_timeline, s) for s in specs[1:]]
        yield specs[0], first
        for spec, future in zip(specs[1:], rest, strict=True):
            yield (
                spec,
                (future.result() if future else traced_timeline(spec)),
            )

    # -- re-estimates ------------------------------------------------------------------------
    def ahead(self, items: Iterable[tuple[Hashable, TrainingSpec]]) -> None:
        """Start these re-estimates (a key and its spec) in the workers, in this order (nothing
        without workers)."""
        for key, spec in items:
            if key not in self._values and key not in self._pending:
                future = self._submit(reserved_peak, spec)
                if future is not None:
                    self._pending[key] = (spec, future)

    def reserved(self, key: Hashable, spec: TrainingSpec) -> tuple[int, int]:
        """Reserved peak bytes of ``spec`` on its worst GPU and that rank's host bytes,
        estimated once per ``key``."""
        if key not in self._values:
            _, future = self._pending.pop(key, (spec, None))
            if future is None and self._pool is not None:
                # With workers the CPUs are theirs: run it there, before what runs ahead.
                queued = [(k, sf[0]) for k, sf in self._pending.items() if sf[1].cancel()]
                for k, _ in queued:
                    del self._pending[k]
                future = self._submit(reserved_peak, spec)
                self.ahead(queued)
            self._values[key] = future.result() if future else reserved_peak(spec)
        return self._values[key]

    @property
    def estimates(self) -> int:
        """Re-estimates the plan used (not those run ahead and never asked for)."""
        return len(self._values)

    # -- workers -----------------------------------------------------------------------------
    def _start(self) -> None:
        if self._pool is None and (self.workers or 1) > 1:
            self._pool = ProcessPoolExecutor(
                self.workers,
                mp_context=multiprocessing.get_context("spawn"),
                initializer=_quiet_like,
                initargs=_quiet_settings(),
            )

    def _submit(self, fn: Any, *args: Any) -> Future[Any] | None:
        return self._pool.submit(fn, *args) if self._pool is not None else None

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def __enter__(self) -> Runner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _quiet_settings() -> tuple[dict[str, int], list[Any]]:
    """This process's logger levels and warning filters, for the workers to copy (a CLI run
    silences libraries' import-time chatter; so should its workers)."""
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
