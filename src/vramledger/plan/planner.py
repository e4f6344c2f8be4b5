"""The state of one plan (``search.py``): every configuration's derived peaks, the candidates
found from them, their re-estimates with the real engines and what was learned from them: the
answers, moved until they fit and one GPU fewer does not, and the Pareto front."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from vramledger.inputs.gpus import Gpu
from vramledger.inputs.spec import TrainingSpec
from vramledger.inputs.units import GIB, format_bytes
from vramledger.plan.candidates import (
    DERIVED,
    ESTIMATED,
    PLANNED_STRATEGIES,
    Candidate,
    Configuration,
    behaviour,
    costs,
    pareto,
    preference,
)
from vramledger.plan.derive import ModelFacts
from vramledger.plan.derived_peaks import DerivedPeaks, fewest
from vramledger.plan.runner import Runner
from vramledger.record.timeline import Timeline

VERIFY_TRIES = 4
"""Re-estimates allowed per answer when moving its GPU count."""
ANSWER_TRIES = 3
"""Derived candidates re-estimated per answer before giving up."""
FRONT_ESTIMATES = 24
"""Front members re-estimated at most (each at its own count) before the rest are shown as
derived."""
THIN_HEADROOM = 0.05
"""An answer whose headroom is below this share of the budget is compared with its checkpointed
variant at the same GPU count."""
ROOMIER = GIB
"""...and the variant is named when it leaves at least this much more headroom."""


def _derived_key(cfg: Configuration) -> tuple[str, str, bool, int, str, str]:
    return (
        cfg.optimizer,
        cfg.precision,
        cfg.checkpointing,
        cfg.micro_batch,
        cfg.strategy,
        cfg.offload,
    )


@dataclass(kw_only=True, eq=False)
class Planner:
    """The state of one plan: derived peaks, re-estimates, and what was learned from them."""

    spec: TrainingSpec
    gpu: Gpu
    capacity: int
    max_gpus: int
    host_memory: int | None
    gpus_per_node: int
    runner: Runner
    reference: str
    derived: dict[tuple[str, str, bool, int, str, str], DerivedPeaks] = field(default_factory=dict)
    candidates: list[Candidate] = field(default_factory=list)
    verified: dict[Configuration, Candidate] = field(default_factory=dict)
    errors: list[float] = field(default_factory=list)
    """Derived / re-estimated reserved peak - 1, at every count re-estimated."""
    notes: list[str] = field(default_factory=list)

    # -- fitting -------------------------------------------------------------------------------
    def host_per_node(self, per_rank: int, gpus: int) -> int:
        return per_rank * min(gpus, self.gpus_per_node)

    def host_fits(self, per_rank: int, gpus: int) -> bool:
        return self.host_memory is None or self.host_per_node(per_rank, gpus) <= self.host_memory

    def candidate(self, cfg: Configuration, peak: int, host: int, method: str) -> Candidate:
        peaks = self.derived[_derived_key(cfg)]
        return Candidate(
            configuration=cfg,
            peak_bytes_per_gpu=peak,
            headroom_bytes=self.capacity - peak,
            host_bytes_per_node=self.host_per_node(host, cfg.gpus),
            costs=costs(cfg, peaks.facts.parameter_bytes, behaviour(cfg.optimizer, self.reference)),
            method=method,
        )

    # -- search --------------------------------------------------------------------------------
    def add(
        self, base: TrainingSpec, timeline: Timeline, facts: ModelFacts, offloads: Sequence[str]
    ) -> int:
        """Derive every strategy and offload of one traced base; returns configurations seen."""
        seen = 0
        for strategy in PLANNED_STRATEGIES:
            for offload in offloads:
                seen += 1
                peaks = DerivedPeaks(timeline, facts, strategy, offload)
                cfg = Configuration(
                    optimizer=base.optimizer,
                    precision=base.precision,
                    checkpointing=base.grad_checkpointing,
                    micro_batch=base.batch_size,
                    grad_accum=base.grad_accum,
                    strategy=strategy,
                    offload=offload,
                    gpus=1,
                )
                self.derived[_derived_key(cfg)] = peaks
                parallelism = cfg.parallelism
                # Strategies that keep every trainable parameter on each GPU whatever the count
                # (ZeRO-1/2 partition only the optimizer's side; no planned offload moves
                # parameters): a model whose parameters alone exceed a GPU cannot fit under them,
                # which is known before deriving any count.
                if not parallelism.shards_params and facts.parameter_bytes > self.capacity:
                    continue
                # One GPU runs without a strategy; strategies start at two.
                lo, hi = (1, 1) if parallelism.is_single else (2, self.max_gpus)
                if not parallelism.shards_optimizer_state:
                    hi = lo  # DDP's memory does not depend on the GPU count
                n = fewest(peaks.reserved, self.capacity, lo, hi, peaks.tensors)
                while n is not None and n <= hi and not self.host_fits(peaks.host(n), n):
                    n = n + 1 if n < hi else None
                if n is None:
                    continue
                cfg = replace(cfg, gpus=n)
                self.candidates.append(
                    self.candidate(cfg, peaks.reserved(n), peaks.host(n), DERIVED)
                )
        return seen

    # -- re-estimates --------------------------------------------------------------------------
    def estimated(self, cfg: Configuration) -> tuple[int, int]:
        """(reserved peak, host bytes per rank) of ``cfg`` re-estimated with the real engines."""
        return self.runner.reserved(cfg, cfg.spec(self.spec))

    def verify(self, c: Candidate) -> Candidate:
        """Re-estimate a derived candidate and move its GPU count until it fits and one fewer
        does not (memoised per derived configuration)."""
        if c.configuration in self.verified:
            return self.verified[c.configuration]
        cfg = c.configuration
        peaks = self.derived[_derived_key(cfg)]
        scalable = cfg.parallelism.shards_optimizer_state
        lowest = 2 if scalable else 1
        known: dict[int, tuple[int, int]] = {}

        def at(n: int) -> tuple[int, int]:
            if n not in known:
                known[n] = self.estimated(replace(cfg, gpus=n))
                self.errors.append(peaks.reserved(n) / max(1, known[n][0]) - 1)
            return known[n]

        def fits(n: int) -> bool:
            peak, host = at(n)
            return peak <= self.capacity and self.host_fits(host, n)

        n = cfg.gpus
        if scalable:
            ratio = at(n)[0] / max(1, peaks.reserved(n))
            guess = fewest(
                lambda k: round(peaks.reserved(k) * ratio),
                self.capacity,
                lowest,
                self.max_gpus,
                lambda k: round(peaks.tensors(k) * min(1.0, ratio)),
            )
            n = guess if guess is not None else self.max_gpus
            # the largest count known not to fit and the smallest known to fit: bisect between
            # them (memory per GPU never grows with the count); one step at a time from the
            # guess while only one side is known (the guess is rarely far off)
            lo = max((k for k in known if not fits(k)), default=None)
            hi = min((k for k in known if fits(k)), default=None)
            for _ in range(VERIFY_TRIES):
                if fits(n):
                    hi = n if hi is None else min(hi, n)
                else:
                    lo = n if lo is None else max(lo, n)
                if hi is not None and (hi == lowest or hi - 1 == lo):
                    break
                if hi is None:
                    if lo >= self.max_gpus:
                        break
                    n = lo + 1
                else:
                    n = hi - 1 if lo is None else (lo + hi) // 2
            n = hi if hi is not None else n
        peak, host = at(n)
        moved = replace(cfg, gpus=n)
        ok = fits(n)
        settled = not scalable or n == lowest or (n - 1 in known and not fits(n - 1))
        if not ok:
            self.notes.append(
                f"{cfg.optimizer}: {cfg.strategy} on {cfg.gpus} GPUs (derived) does not fit when "
                f"re-estimated with the real engines, up to {n} GPUs"
            )
        elif not settled:
            self.notes.append(f"{cfg.optimizer}: {n - 1} GPUs not re-estimated (out of tries)")
        result = self.candidate(
            moved, peak, host, ESTIMATED if ok else f"{ESTIMATED} (does not fit)"
        )
        self.verified[c.configuration] = result
        return result

    def answer(self, ranked: list[Candidate]) -> Candidate | None:
        """The best of ``ranked`` (derived, in preference order) that holds when re-estimated:
        candidates are re-estimated in order while one could still beat the best that holds."""
        holding: Candidate | None = None
        for candidate in ranked[:ANSWER_TRIES]:
            if holding is not None and candidate.configuration.gpus >= holding.configuration.gpus:
                break
            checked = self.verify(candidate)
            if checked.fits and (holding is None or preference(checked) < preference(holding)):
                holding = checked
        return holding

    def current(self) -> list[Candidate]:
        """Every candidate as best known: re-estimated where it was, derived otherwise (one per
        configuration; re-estimates that do not fit left out)."""
        out: dict[Configuration, Candidate] = {}
        for c in self.candidates:
            known = self.verified.get(c.configuration, c)
            if known.fits:
                out.setdefault(known.configuration, known)
        return list(out.values())

    def check(self, c: Candidate) -> Candidate:
        """A derived candidate re-estimated at its own count: kept there if it fits (what it
        shows is then what ``estimate`` says), else moved like an answer."""
        if c.configuration in self.verified:
            return self.verified[c.configuration]
        cfg = c.configuration
        peak, host = self.estimated(cfg)
        self.errors.append(self.derived[_derived_key(cfg)].reserved(cfg.gpus) / max(1, peak) - 1)
        if peak <= self.capacity and self.host_fits(host, cfg.gpus):
            self.verified[cfg] = self.candidate(cfg, peak, host, ESTIMATED)
            return self.verified[cfg]
        return self.verify(c)

    def front(self) -> list[Candidate]:
        """The Pareto front of the current candidates, re-estimating its derived members (each
        at its count) until none is left or ``FRONT_ESTIMATES`` are spent; what remains derived
        is marked with the derivation error this plan measured."""
        spent = 0
        while True:
            front = pareto(self.current())
            pending = [c for c in front if c.method == DERIVED]
            if not pending or spent >= FRONT_ESTIMATES:
                break
            batch = pending[: FRONT_ESTIMATES - spent]
            self.runner.ahead((c.configuration, c.configuration.spec(self.spec)) for c in batch)
            for c in batch:
                self.check(c)
                spent += 1
        error = self.error_text()
        return [replace(c, error=error) if c.method == DERIVED else c for c in front]

    def error_text(self) -> str | None:
        if not self.errors:
            return None
        lo, hi = min(self.errors), max(self.errors)
        return (
            f"derived peaks were {100 * lo:+.1f} % to {100 * hi:+.1f} % off the re-estimates in "
            f"this plan ({len(self.errors)} counts re-estimated)"
        )

    def roomier(self, c: Candidate) -> str | None:
        """A note when an answer fits with thin headroom and its checkpointed variant at the same
        GPU count (re-estimated) leaves much more."""
        cfg = c.configuration
        if cfg.checkpointing or c.headroom_bytes >= THIN_HEADROOM * self.capacity:
            return None
        variant = replace(cfg, checkpointing=True)
        if _derived_key(variant) not in self.derived:
            return None
        peak, host = self.estimated(variant)
        headroom = self.capacity - peak
        if headroom - c.headroom_bytes < ROOMIER or not self.host_fits(host, cfg.gpus):
            return None
        return (
            f"{cfg.optimizer} on {cfg.gpus} GPUs fits with only {format_bytes(c.headroom_bytes)} "
            f"of headroom; with activation checkpointing it leaves {format_bytes(headroom)} "
            "(+~33 % compute)"
        )
