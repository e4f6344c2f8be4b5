"""Where the planner's traces and re-estimates run: here, or ahead in worker processes.

A plan of a 70B model makes a few single-GPU traces and a dozen or more re-estimates with the
real engines, seconds each, most of them independent. The first trace runs here and times the
model: if it took long enough to repay starting workers, the other traces run in worker
processes (forked from a fork server that imported what they need, ``worker_preload.py``;
nothing shared with this one) while the search works
through those already back, and the re-estimates the answers will most likely need run ahead
there in the order the planner will ask for them. The values are the same with or without
workers; only the wall time changes.

Re-estimates that differ only in their data-parallel or tensor-parallel degree (an answer at
``n`` GPUs and at ``n - 1``, a layout at ``dp`` and ``dp - 1``, at tp 2 and tp 8) are the same run
with other shard sizes, and those that differ only in their offload the same trace with other
storages marked as host memory afterwards: once one of them has verified that its identical
blocks extend exactly (``trace/core/blocks.py``), the others trace only the smaller of the two shallow
models (``blocks_verified``; about half the tracing). Such
re-estimates are handed to the workers one at a time, at most one per worker, so each can use
what those before it verified: the first of a family waits for no one, and a second of a family
whose first is still running waits for it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable, Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import fields
from typing import Any

from vramledger.inputs.spec import TrainingSpec
from vramledger.ledger.ledger import Ledger
from vramledger.plan.workers import available_cpus, start_pool
from vramledger.predict.step import estimate
from vramledger.record.timeline import Timeline
from vramledger.trace.core.fake import trace
from vramledger.trace.emulation.target_policy import policy_for

WORKER_MIN_TRACE_SECONDS = 1.0
"""Workers start only when the first trace took at least this long: starting them costs the
fork server's imports, a few seconds of one CPU (``worker_preload.py``;
``benchmarks/results/README-startup.md``), which small models do not repay."""


def traced_timeline(spec: TrainingSpec) -> Timeline:
    """The single-GPU fake-tensor trace the search derives strategies from (on the spec's GPU)."""
    return trace(spec, policy_for(spec)).timeline


def _extensible_alike(spec: TrainingSpec) -> bool:
    """Whether the traced step has the same events at every data-parallel and tensor-parallel
    degree, only other shard sizes (none, DDP, FSDP2 on a 1-D mesh or the data-parallel axis of
    the N-D one; ``parallelize_module``'s plan on the tensor-parallel axis): whether its identical
    blocks extend exactly does not depend on the degree. Not where blocks never extend
    (``Parallelism.extends_blocks``: ZeRO-1/2, zero1-torch, DeepSpeed's engine), nor pipelines
    (stages change)."""
    return spec.parallelism.extends_blocks and spec.pp == 1


def extension_family(spec: TrainingSpec, *, sizes_alike: bool = False) -> str | None:
    """What ``spec`` shares with the re-estimates that differ from it only in their
    data-parallel or tensor-parallel degree (degrees of two and more alike: one rank or sharded)
    or in their offload (the engines mark what it keeps in host memory on the finished
    timeline, ``trace.engine.Engine.finish``: the traced events are the same), or None when
    the block extension must be checked on every such run. ``sizes_alike``: the micro-batch and
    sequence length may differ too (``fit``'s sizes): every block runs the same operators on
    the same shapes at any size, so a size changes every block's events alike, as a degree
    does."""
    if not _extensible_alike(spec):
        return None
    alike = {
        "world_size": min(spec.world_size, 2),
        "dp_shard": None if spec.dp_shard is None else min(spec.dp_shard, 2),
        "tp": min(spec.tp, 2),
        "offload": None,
    }
    if sizes_alike:
        alike.update(batch_size=None, seq_len=None)
    return repr([(f.name, alike.get(f.name, getattr(spec, f.name))) for f in fields(spec)])


def reserved_peak(spec: TrainingSpec, blocks_verified: bool = False) -> tuple[int, int, bool]:
    """What the real engines say ``spec`` reserves on its worst GPU, that rank's host bytes
    (what it offloads), and whether this run verified its block extension (every traced rank's
    blocks extended after the check; False when the check was skipped, ``blocks_verified``)."""
    ledger = estimate(spec, blocks_verified=blocks_verified)
    return (
        ledger.reserved_peak_bytes,
        ledger.host_bytes,
        verifies_extension(ledger, blocks_verified),
    )


def verifies_extension(ledger: Ledger, blocks_verified: bool) -> bool:
    """Whether the estimate that made ``ledger`` verified its block extension: every traced
    rank's blocks extended after the check (not skipped with ``blocks_verified``)."""
    extended = all(rank.blocks_extended for _, rank in ledger.ranks) if ledger.ranks else False
    return extended and not blocks_verified


class Runner:
    """Traces and memoised re-estimates (reserved peak bytes) for one plan."""

    def __init__(self, workers: int | None):
        """``workers``: processes to use; None: one per CPU if the first trace is slow enough."""
        self.workers = workers
        self._values: dict[Hashable, tuple[int, int]] = {}
        self._errors: dict[Hashable, BaseException] = {}
        self._asked: set[Hashable] = set()
        self._queued: dict[Hashable, TrainingSpec] = {}
        """Re-estimates run ahead, not yet handed to a worker, in the order to hand them."""
        self._running: dict[Future[tuple[int, int, bool]], tuple[Hashable, TrainingSpec]] = {}
        self._verified: set[str] = set()
        """Extension families (``extension_family``) whose blocks were verified to extend."""
        self._unverifiable: set[str] = set()
        """Families whose first re-estimate did not verify an extension (blocks that differ, a
        model too shallow to extend, an error): the others need not wait for one."""
        self._pool: ProcessPoolExecutor | None = None
        self._starting: Future[ProcessPoolExecutor] | None = None
        """The pool ``start_workers`` is starting in a thread: its start waits for the fork
        server's imports (seconds), which overlap the first trace."""
        self._lock = threading.Condition(threading.RLock())
        """Guards the queue, the running re-estimates and their answers: workers' answers are
        taken in the pool's thread, as they come back, and the next one handed out there."""

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

    def start_workers(self) -> None:
        """Start the workers now (one per CPU unless told), before any trace has timed the
        model, in a thread: this returns at once, and the pool is taken when first needed."""
        if self.workers is None:
            self.workers = available_cpus()
        if self._pool is None and self._starting is None and self.workers > 1:
            starter = ThreadPoolExecutor(1, thread_name_prefix="plan-workers")
            self._starting = starter.submit(start_pool, self.workers)
            starter.shutdown(wait=False)

    # -- re-estimates ------------------------------------------------------------------------
    def ahead(self, items: Iterable[tuple[Hashable, TrainingSpec]]) -> None:
        """Queue these re-estimates (a key and its spec) for the workers, in this order (nothing
        without workers)."""
        if self._started_pool() is None:
            return
        with self._lock:
            for key, spec in items:
                if not self._known(key) and not self._is_running(key):
                    self._queued.setdefault(key, spec)
            self._pump()

    def reserved(self, key: Hashable, spec: TrainingSpec) -> tuple[int, int]:
        """Reserved peak bytes of ``spec`` on its worst GPU and that rank's host bytes,
        estimated once per ``key``."""
        self._asked.add(key)
        if self._started_pool() is None:
            if not self._known(key):
                self._record(key, spec, lambda: reserved_peak(spec, self._is_verified(spec)))
        else:
            with self._lock:
                if not self._known(key) and not self._is_running(key):
                    # The planner waits for this one: it goes first to the next free worker.
                    self._queued.pop(key, None)
                    self._queued = {key: spec, **self._queued}
                    self._pump()
                self._lock.wait_for(lambda: self._known(key))
        if key in self._errors:
            raise self._errors[key]
        return self._values[key]

    def _known(self, key: Hashable) -> bool:
        return key in self._values or key in self._errors

    def _is_verified(self, spec: TrainingSpec) -> bool:
        family = extension_family(spec)
        return family is not None and family in self._verified

    def _record(
        self, key: Hashable, spec: TrainingSpec, outcome: Callable[[], tuple[int, int, bool]]
    ) -> None:
        """Keep a re-estimate's ``outcome()`` (``reserved_peak``'s) or the error it raised."""
        try:
            peak, host, verified = outcome()
        except Exception as exc:  # the planner decides what an engine's refusal means
            self._errors[key], verified = exc, False
        else:
            self._values[key] = (peak, host)
        family = extension_family(spec)
        if family is not None and family not in self._verified:
            (self._verified if verified else self._unverifiable).add(family)

    def _is_running(self, key: Hashable) -> bool:
        return any(k == key for k, _ in self._running.values())

    def _finished(self, future: Future[tuple[int, int, bool]]) -> None:
        """A worker is back (in the pool's thread): keep its answer, hand it the next one."""
        with self._lock:
            try:
                key, spec = self._running.pop(future)
                self._record(key, spec, future.result)
                self._pump()
            finally:
                self._lock.notify_all()

    def _pump(self) -> None:
        """Hand queued re-estimates to free workers, in the queue's order (the one the planner
        waits for is at its head); but none whose family's first is still running and may verify
        its extension (it waits for it, then traces half as much; a worker left idle meanwhile
        leaves its CPU to the planner)."""
        while self._pool is not None and self._queued and len(self._running) < (self.workers or 1):
            key = next((k for k, spec in self._queued.items() if self._ready(spec)), None)
            if key is None:
                return
            spec = self._queued.pop(key)
            try:
                future = self._pool.submit(reserved_peak, spec, self._is_verified(spec))
            except Exception as exc:  # a broken pool: whoever waits for it hears why
                self._errors[key] = exc
                continue
            self._running[future] = (key, spec)
            future.add_done_callback(self._finished)

    def _ready(self, spec: TrainingSpec) -> bool:
        """Whether ``spec`` may start now: no re-estimate of its family that may verify the
        extension is running."""
        family = extension_family(spec)
        if family is None or family in self._verified or family in self._unverifiable:
            return True
        return all(extension_family(s) != family for _, s in self._running.values())

    @property
    def estimates(self) -> int:
        """Re-estimates the plan used (not those run ahead and never asked for)."""
        return len(self._asked)

    # -- workers -----------------------------------------------------------------------------
    def _started_pool(self) -> ProcessPoolExecutor | None:
        """The workers' pool once started (waiting for ``start_workers``' thread), or None."""
        if self._starting is not None:
            self._pool, self._starting = self._starting.result(), None
        return self._pool

    def _start(self) -> None:
        if self._started_pool() is None and (self.workers or 1) > 1:
            self._pool = start_pool(self.workers or 1)

    def _submit(self, fn: Any, *args: Any) -> Future[Any] | None:
        return self._pool.submit(fn, *args) if self._pool is not None else None

    def close(self) -> None:
        if self._started_pool() is not None:
            with self._lock:
                self._queued.clear()
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def __enter__(self) -> Runner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
