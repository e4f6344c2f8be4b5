"""``fit``'s estimates: made once each, the block extension checked once per configuration, and
the next one made ahead in a worker process while this one makes the one it needs now.

``fit`` asks for estimates in pairs whose members do not depend on each other: the two traced
sizes it derives from, then the derived answer and the next size up. On a large model each is
seconds of tracing, so the second of a pair is handed to a worker (``workers.py``) and made
alongside the first; the answers are the same with or without workers, only the wall time
changes.

The sizes of one configuration (optimizer, checkpointing) are the same run at other shapes:
once one of them has verified that its identical blocks extend exactly (``trace/core/blocks.py``),
the others trace only the smaller of the two shallow models (``runner.extension_family`` with
``sizes_alike``), as the planner's re-estimates at other data-parallel degrees do. The first
pair's second estimate is handed to the worker before the first (made here) has checked it:
the worker traces the smaller model only, and its answer is kept if the check holds (else it is
made again here, with the check).
"""

from __future__ import annotations

from collections.abc import Iterable
from concurrent.futures import Future, ProcessPoolExecutor, ThreadPoolExecutor

from vramledger.inputs.recipe import count_parameters, resolve
from vramledger.inputs.spec import TrainingSpec
from vramledger.ledger.ledger import Ledger
from vramledger.plan.runner import extension_family, verifies_extension
from vramledger.plan.workers import WORKERS_AT_ONCE_PARAMETERS, available_cpus, start_pool
from vramledger.predict.step import estimate


def workers_for(spec: TrainingSpec) -> tuple[int, tuple[str, ...]]:
    """Worker processes beside this one: one per other CPU for a model of
    ``WORKERS_AT_ONCE_PARAMETERS`` or more (counted on the meta device), none for smaller ones,
    whose estimates do not repay a worker's start-up; and the model's modelling module when it
    is a library's (transformers'), for the fork server to import once for every worker."""
    model = resolve(spec).build_model("meta")
    if count_parameters(model)[0] < WORKERS_AT_ONCE_PARAMETERS:
        return 0, ()
    module = type(model).__module__
    return available_cpus() - 1, (module,) if module.startswith("transformers.") else ()


class FitEstimates:
    """The estimates of one ``fit``, by spec."""

    def __init__(self, workers: int, preload: tuple[str, ...] = ()) -> None:
        """``workers``: processes beside this one (0: every estimate is made here); ``preload``:
        modules their fork server imports (``workers.start_pool``)."""
        self.workers = workers
        self._ledgers: dict[str, Ledger] = {}
        """Estimates made, by the spec's ``repr`` (a spec holds dicts: it does not hash)."""
        self._running: dict[str, tuple[Future[Ledger], bool]] = {}
        """Estimates in the workers, and whether each was told its blocks were verified."""
        self._queued: dict[str, TrainingSpec] = {}
        self._verified: set[str] = set()
        """Families (``extension_family`` with sizes alike) whose blocks were verified to
        extend."""
        self._unverified: set[str] = set()
        """Families an estimate checked, whose blocks did not extend."""
        self._threads: ThreadPoolExecutor | None = None
        """Starts the workers, then waits on each estimate handed to them (one thread each), so
        that this process goes on meanwhile: a worker's start waits for the fork server's
        imports, seconds."""
        self._pool: Future[ProcessPoolExecutor] | None = None
        if workers > 0:
            self._threads = ThreadPoolExecutor(workers + 1, thread_name_prefix="fit-estimates")
            self._pool = self._threads.submit(start_pool, workers, preload)

    def ledger(self, spec: TrainingSpec) -> Ledger:
        """``spec``'s estimate: made before, taken from the worker making it, or made here."""
        key = repr(spec)
        if key not in self._ledgers:
            self._queued.pop(key, None)
            running = self._running.pop(key, None)
            if running is not None and self._valid(spec, *running):
                self._keep(spec, running[0].result(), running[1])
            else:
                verified = self._is_verified(spec)
                self._keep(spec, estimate(spec, blocks_verified=verified), verified)
            self._pump()
        return self._ledgers[key]

    def ahead(self, specs: Iterable[TrainingSpec]) -> None:
        """Make these estimates ahead, in this order, in the workers (nothing without)."""
        if self._pool is None:
            return
        for spec in specs:
            key = repr(spec)
            if key not in self._ledgers and key not in self._running:
                self._queued.setdefault(key, spec)
        self._pump()

    def _pump(self) -> None:
        while self._pool is not None and self._queued and len(self._running) < self.workers:
            key = next(iter(self._queued))
            spec = self._queued.pop(key)
            # Told verified before the check is made (a guess that this process's estimate of
            # the same configuration, made meanwhile, verifies it; kept only if it does).
            family = extension_family(spec, sizes_alike=True)
            verified = family is not None and family not in self._unverified
            assert self._threads is not None
            self._running[key] = (self._threads.submit(self._in_worker, spec, verified), verified)

    def _in_worker(self, spec: TrainingSpec, verified: bool) -> Ledger:
        assert self._pool is not None
        return self._pool.result().submit(estimate, spec, blocks_verified=verified).result()

    def _valid(self, spec: TrainingSpec, future: Future[Ledger], verified: bool) -> bool:
        """Whether a worker's estimate holds: made with the check (not ``verified``), or without
        it once the check was made and held, or without it to no effect (no block extended)."""
        if not verified or self._is_verified(spec):
            return True
        ledger = future.result()
        return not any(rank.blocks_extended for _, rank in ledger.ranks)

    def _is_verified(self, spec: TrainingSpec) -> bool:
        family = extension_family(spec, sizes_alike=True)
        return family is not None and family in self._verified

    def _keep(self, spec: TrainingSpec, ledger: Ledger, blocks_verified: bool) -> None:
        self._ledgers[repr(spec)] = ledger
        family = extension_family(spec, sizes_alike=True)
        if family is None or blocks_verified:
            return
        (self._verified if verifies_extension(ledger, False) else self._unverified).add(family)

    def close(self) -> None:
        if self._pool is not None and self._threads is not None:
            self._queued.clear()
            self._threads.shutdown(wait=True)
            self._pool.result().shutdown(wait=True, cancel_futures=True)
            self._pool = self._threads = None

    def __enter__(self) -> FitEstimates:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
