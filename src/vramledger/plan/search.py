"""``plan``: the fewest GPUs of a kind on which a training run fits, per optimizer, and the
trade-offs around it — every configuration shown agreeing with ``estimate``.

The search covers optimizer, precision, activation checkpointing, micro-batch (halving it and
accumulating gradients keeps the batch), strategy (DDP, ZeRO-1/2/3), optimizer offload and GPU
count. One fake-tensor trace is made per (optimizer, precision, checkpointing, micro-batch) on
one GPU; strategies and GPU counts are derived from it (``derive.py``: the bytes the caching
allocator reserves, as re-estimates report them) and the smallest GPU count of each
configuration found by bisection (memory per GPU never grows with the count), on the cheaper
tensor bytes first.

Then every configuration the plan shows is re-estimated with the real engines (``runner.py``
memoises them and runs them in worker processes): each optimizer's answer (with and without
offload) at its count and one fewer, moved until it fits and one fewer does not; and the Pareto
front, recomputed from re-estimated configurations until every one on it is re-estimated (within
``FRONT_ESTIMATES``; what remains derived is marked so, with the derivation error this plan
measured). The fewest-GPU answers are the front's best for each optimizer, so the two tables
agree. An answer that fits with little headroom says how much a checkpointed variant would have.

A configuration fits when its peak plus ``margin`` is at most the GPU's memory and, when it
offloads and ``host_memory`` is given, its host bytes per node (each rank's, times the ranks on
a node) are at most ``host_memory``. The margin is explicit: the CUDA context and libraries
(several hundred MiB), allocator fragmentation beyond the modelled caching allocator, and
communication buffers (NCCL) are not in the trace.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from ..allocator import CUDA_CACHING_ALLOCATOR
from ..config_depth import config_depth
from ..errors import InputError
from ..event_totals import EventTotals
from ..gpus import Gpu
from ..ledger import steady_peaks, steady_tensor_peak
from ..optimizers import resolve_optimizer
from ..parallelism import Parallelism
from ..recipe import resolve
from ..spec import TrainingSpec
from ..timeline import Timeline
from ..trace.blocks import find_block_stack
from ..units import GIB, format_bytes
from ..verdict import DEFAULT_MARGIN, MARGIN_SOURCE, check_margin
from .candidates import (
    DEFAULT_GPUS_PER_NODE,
    DERIVED,
    ESTIMATED,
    PLANNED_OFFLOADS,
    PLANNED_STRATEGIES,
    Candidate,
    Configuration,
    behaviour,
    costs,
    pareto,
    preference,
)
from .derive import (
    DerivedLayout,
    ModelFacts,
    derive,
    derive_layout,
)
from .layouts import (
    Layout,
    LayoutResult,
    auto_tp_degrees,
    layout_costs,
    layout_pairs,
    likely_layouts,
    search_layouts,
)
from .runner import Runner

Progress = Callable[[str, int, int], None]

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
WORKERS_AT_ONCE_PARAMETERS = 1_000_000_000
"""Models this large start the planner's workers before the first trace (whose time otherwise
decides it, ``runner.py``): their traces take seconds each, so the workers always repay their
start-up (``benchmarks/results/README-startup.md``).
"""


@dataclass(frozen=True, kw_only=True)
class Plan:
    gpu: Gpu
    margin_bytes: int
    margin_source: str
    max_gpus: int
    fewest_gpus: dict[str, Candidate | None]
    fewest_gpus_without_offload: dict[str, Candidate | None]
    front: list[Candidate]
    configurations: int
    traces: int
    seconds: float
    search_seconds: float = 0.0
    """Tracing and deriving every configuration (the rest re-estimates what is shown)."""
    estimates: int = 0
    """Re-estimates with the real engines made to check what is shown."""
    workers: int = 1
    """Processes the traces after the first and the re-estimates ran in (1: this one)."""
    host_memory_bytes: int | None = None
    gpus_per_node: int = DEFAULT_GPUS_PER_NODE
    notes: list[str] = field(default_factory=list)
    layouts: dict[str, list[LayoutResult]] = field(default_factory=dict)
    """Per optimizer, the model-parallel layouts (tp x pp x FSDP over dp) searched from its
    answer without offload, each re-estimated (``layouts.py``)."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "gpu": {
                "name": self.gpu.name,
                "memory_bytes": self.gpu.memory_bytes,
                "source": self.gpu.source,
            },
            "margin_bytes": self.margin_bytes,
            "margin_source": self.margin_source,
            "max_gpus": self.max_gpus,
            "host_memory_bytes": self.host_memory_bytes,
            "gpus_per_node": self.gpus_per_node,
            "fewest_gpus": {k: (v.to_dict() if v else None) for k, v in self.fewest_gpus.items()},
            "fewest_gpus_without_offload": {
                k: (v.to_dict() if v else None) for k, v in self.fewest_gpus_without_offload.items()
            },
            "front": [c.to_dict() for c in self.front],
            "configurations": self.configurations,
            "traces": self.traces,
            "seconds": round(self.seconds, 2),
            "search_seconds": round(self.search_seconds, 2),
            "estimates": self.estimates,
            "workers": self.workers,
            "notes": self.notes,
            "layouts": {k: [r.to_dict() for r in v] for k, v in self.layouts.items()},
        }


def model_facts(spec: TrainingSpec) -> ModelFacts:
    recipe = resolve(spec)
    model = recipe.build_model("meta")
    params = [p for p in model.parameters() if p.requires_grad]
    stack = find_block_stack(model, min_blocks=1)
    total = sum(p.numel() for p in params)
    block = (
        sum(p.numel() for p in model.get_submodule(stack.fqn)[0].parameters())
        if stack is not None
        else total
    )
    return ModelFacts(
        parameter_bytes=sum(p.numel() * p.element_size() for p in params),
        parameter_itemsize=params[0].element_size() if params else 2,
        trainable_parameters=total,
        block_parameters=block,
        root_parameters=total - block * stack.length if stack is not None else 0,
    )


def _micro_batches(batch: int) -> list[tuple[int, int]]:
    out, micro = [], batch
    while micro >= 1:
        if batch % micro == 0:
            out.append((micro, batch // micro))
        if micro == 1:
            break
        micro //= 2
    return out


class DerivedPeaks:
    """Derived peaks of one configuration at any GPU count (memoised): the bytes the caching
    allocator reserves (what re-estimates check), the tensor bytes (a cheaper lower bound) and
    the host bytes per rank."""

    def __init__(self, timeline: Timeline, facts: ModelFacts, strategy: str, offload: str):
        self.facts = facts
        self._base = timeline
        self._strategy, self._offload = strategy, offload
        self._layout: tuple[DerivedLayout, EventTotals] | None = None
        self._tensors: dict[int, int] = {}
        self._reserved: dict[int, int] = {}
        self._host: dict[int, int] = {}

    def _derive(self, n: int) -> tuple[Timeline, EventTotals | None]:
        """The derived timeline at ``n`` GPUs, and its events' totals when they are shared by
        every count (rank-independent strategies: derived once, resized per count)."""
        if not Parallelism(strategy=self._strategy).rank_independent:
            return derive(self._base, self.facts, self._strategy, n, self._offload), None
        if self._layout is None:
            layout = derive_layout(self._base, self.facts, self._strategy, self._offload)
            self._layout = layout, EventTotals(layout.timeline)
        layout, totals = self._layout
        return layout.at(n), totals

    def tensors(self, n: int) -> int:
        if n not in self._tensors:
            self._tensors[n] = steady_tensor_peak(*self._derive(n))
        return self._tensors[n]

    def reserved(self, n: int) -> int:
        if n not in self._reserved:
            timeline, totals = self._derive(n)
            peaks = steady_peaks(timeline, CUDA_CACHING_ALLOCATOR, totals)
            self._reserved[n] = peaks.reserved
            self._host[n] = peaks.host
        return self._reserved[n]

    def host(self, n: int) -> int:
        self.reserved(n)
        return self._host[n]


def fewest(
    peak: Callable[[int], int],
    capacity: int,
    lo: int,
    hi: int,
    lower_bound: Callable[[int], int] | None = None,
) -> int | None:
    """Smallest n in [lo, hi] with peak(n) <= capacity (peak never grows with n).

    ``lower_bound`` (never above ``peak``, cheaper) is searched first: the answer is at least
    its answer, and is looked for upward from there in doubling steps, then bisected."""
    if lower_bound is not None:
        start = fewest(lower_bound, capacity, lo, hi)
        if start is None:
            return None
        if peak(start) <= capacity:
            return start
        known_over, step = start, 1
        while True:
            probe = min(known_over + step, hi)
            if peak(probe) <= capacity:
                lo, hi = known_over + 1, probe
                break
            if probe == hi:
                return None
            known_over, step = probe, 2 * step
    elif peak(hi) > capacity:
        return None
    while lo < hi:
        mid = (lo + hi) // 2
        if peak(mid) <= capacity:
            hi = mid
        else:
            lo = mid + 1
    return lo


def _likely_counts(config: Configuration | None, max_gpus: int) -> list[Configuration]:
    """The re-estimates an answer most likely needs: its derived count and one fewer (an answer
    rests on both; one more is needed only when the derived count does not fit, and run ahead
    it would hold a worker the others need)."""
    if config is None:
        return []
    if not config.parallelism.shards_optimizer_state:  # the count does not change its memory
        return [config]
    counts = (config.gpus, config.gpus - 1)
    return [replace(config, gpus=n) for n in counts if 2 <= n <= max_gpus]


def _derived_key(cfg: Configuration) -> tuple[str, str, bool, int, str, str]:
    return (
        cfg.optimizer,
        cfg.precision,
        cfg.checkpointing,
        cfg.micro_batch,
        cfg.strategy,
        cfg.offload,
    )


class _Planner:
    """The state of one plan: derived peaks, re-estimates, and what was learned from them."""

    def __init__(
        self,
        spec: TrainingSpec,
        gpu: Gpu,
        *,
        capacity: int,
        max_gpus: int,
        host_memory: int | None,
        gpus_per_node: int,
        runner: Runner,
        reference: str,
    ) -> None:
        self.spec = spec
        self.gpu = gpu
        self.capacity = capacity
        self.max_gpus = max_gpus
        self.host_memory = host_memory
        self.gpus_per_node = gpus_per_node
        self.runner = runner
        self.reference = reference
        self.derived: dict[tuple[str, str, bool, int, str, str], DerivedPeaks] = {}
        self.candidates: list[Candidate] = []
        self.verified: dict[Configuration, Candidate] = {}
        self.errors: list[float] = []
        """Derived / re-estimated reserved peak - 1, at every count re-estimated."""
        self.notes: list[str] = []

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


def plan(
    spec: TrainingSpec,
    gpu: Gpu,
    *,
    optimizers: Sequence[str],
    max_gpus: int = 1024,
    margin: int = DEFAULT_MARGIN,
    margin_source: str = MARGIN_SOURCE,
    precisions: Sequence[str] | None = None,
    checkpointing: Sequence[bool] = (False, True),
    offloads: Sequence[str] = PLANNED_OFFLOADS,
    verify: bool = True,
    workers: int | None = None,
    host_memory: int | None = None,
    gpus_per_node: int = DEFAULT_GPUS_PER_NODE,
    progress: Progress | None = None,
    tp_degrees: Sequence[int] | None = None,
    pp_degrees: Sequence[int] = (),
) -> Plan:
    """``workers``: processes for the traces after the first and for the re-estimates
    (``runner.py``); None: one per CPU when the first trace takes long enough to repay starting
    them, else none. ``host_memory``: bytes of host memory per node of ``gpus_per_node`` GPUs.
    ``verify=False`` stops after the search: everything is derived (and marked so).
    ``tp_degrees`` / ``pp_degrees``: the model-parallel layouts searched from each optimizer's
    answer without offload (``layouts.py``); ``tp_degrees=None``: 2, 4, 8 when an answer spans
    more than one node of ``gpus_per_node`` GPUs, else none; pipeline layouts only when
    asked."""
    if max_gpus < 1:
        raise InputError(f"--max-gpus must be at least 1, not {max_gpus}")
    if workers is not None and workers < 1:
        raise InputError(f"--workers must be at least 1, not {workers}")
    if gpus_per_node < 1:
        raise InputError(f"--gpus-per-node must be at least 1, not {gpus_per_node}")
    if not optimizers:
        raise InputError("no optimizers to plan for", hint="pass --optimizers adamw,sgd-momentum")
    for name in optimizers:  # a misspelt name is refused before any tracing
        resolve_optimizer(name, spec.optimizer_kwargs)
    check_margin(gpu, margin)
    # every trace and re-estimate emulates this GPU (its compute capability's CUDA decisions)
    spec = replace(spec, gpu=gpu, gpu_memory=None, margin=margin)
    start = time.perf_counter()
    precisions = list(precisions or [spec.precision])
    micro = _micro_batches(spec.batch_size * spec.grad_accum)
    bases = [
        replace(
            spec,
            optimizer=optimizer,
            precision=precision,
            grad_checkpointing=ckpt,
            batch_size=micro_batch,
            grad_accum=accum,
            world_size=1,
            nodes=None,
            gpus_per_node=None,
            strategy=None,
            offload="none",
            target="cuda",
        )
        for optimizer in optimizers
        for precision in precisions
        for ckpt in checkpointing
        for micro_batch, accum in micro
    ]
    traces = configurations = 0
    facts_cache: dict[tuple[str, bool], ModelFacts] = {}
    fewest_gpus: dict[str, Candidate | None] = {}
    on_gpu: dict[str, Candidate | None] = {}
    with Runner(workers) as runner:
        if bases:
            first = (bases[0].precision, bases[0].grad_checkpointing)
            facts_cache[first] = model_facts(bases[0])
            if facts_cache[first].trainable_parameters >= WORKERS_AT_ONCE_PARAMETERS:
                runner.start_workers()  # their start-up overlaps the first trace
        planner = _Planner(
            spec,
            gpu,
            capacity=gpu.memory_bytes - margin,
            max_gpus=max_gpus,
            host_memory=host_memory,
            gpus_per_node=gpus_per_node,
            runner=runner,
            reference=optimizers[0],
        )
        ranked: dict[str, list[Candidate]] = {name: [] for name in optimizers}
        left = {name: sum(b.optimizer == name for b in bases) for name in optimizers}
        for base, timeline in runner.traces(bases):
            key = (base.precision, base.grad_checkpointing)
            if key not in facts_cache:
                facts_cache[key] = model_facts(base)
            traces += 1
            if progress is not None:
                progress("traces", traces, len(bases))
            configurations += planner.add(base, timeline, facts_cache[key], offloads)
            left[base.optimizer] -= 1
            if not left[base.optimizer]:
                name = base.optimizer
                ranked[name] = sorted(
                    (c for c in planner.candidates if c.configuration.optimizer == name),
                    key=preference,
                )
                if verify:  # its answers' re-estimates start while the others are derived
                    plain = [c for c in ranked[name] if c.configuration.offload == "none"]
                    runner.ahead(
                        (cfg, cfg.spec(spec))
                        for best in (ranked[name][:1], plain[:1])
                        for cfg in _likely_counts(best[0].configuration if best else None, max_gpus)
                    )
        searched = time.perf_counter()
        if verify:
            for name in optimizers:
                if progress is not None:
                    progress("re-estimating answers", optimizers.index(name), len(optimizers))
                fewest_gpus[name] = planner.answer(ranked[name])
                on_gpu[name] = planner.answer(
                    [c for c in ranked[name] if c.configuration.offload == "none"]
                )
                # its layouts' re-estimates start while the other optimizers are settled
                _layouts_ahead(planner, on_gpu[name], tp_degrees, pp_degrees)
            front = planner.front()
            # the answers are the front's best per optimizer: the tables agree
            for table in (fewest_gpus, on_gpu):
                for name in table:
                    better = [
                        c
                        for c in planner.current()
                        if c.configuration.optimizer == name
                        and c.method == ESTIMATED
                        and (table is fewest_gpus or c.configuration.offload == "none")
                    ]
                    if better:
                        table[name] = min(better, key=preference)
            planner.notes += [
                note for note in (planner.roomier(c) for c in fewest_gpus.values() if c) if note
            ]
            layouts = _layouts(spec, planner, on_gpu, tp_degrees, pp_degrees, facts_cache, progress)
        else:
            error = "not re-estimated (--no-verify)"
            for name in optimizers:
                fewest_gpus[name] = ranked[name][0] if ranked[name] else None
                plain = [c for c in ranked[name] if c.configuration.offload == "none"]
                on_gpu[name] = plain[0] if plain else None
            front = [replace(c, error=error) for c in pareto(planner.candidates)]
            layouts = {}
        return Plan(
            gpu=gpu,
            margin_bytes=margin,
            margin_source=margin_source,
            max_gpus=max_gpus,
            fewest_gpus=fewest_gpus,
            fewest_gpus_without_offload=on_gpu,
            front=front,
            configurations=configurations,
            traces=traces,
            seconds=time.perf_counter() - start,
            search_seconds=searched - start,
            estimates=runner.estimates,
            workers=runner.workers or 1,
            host_memory_bytes=host_memory,
            gpus_per_node=gpus_per_node,
            notes=list(dict.fromkeys(planner.notes)),
            layouts=layouts,
        )


def _layouts_ahead(
    planner: _Planner,
    answer: Candidate | None,
    tp_degrees: Sequence[int] | None,
    pp_degrees: Sequence[int],
) -> None:
    """Run ahead the layout re-estimates one optimizer's answer without offload will most likely
    need (``_layouts`` searches them once every answer is settled)."""
    cfg = answer.configuration if answer is not None else None
    if cfg is None:
        return
    pairs = _layout_pairs(planner, {"": cfg}, tp_degrees, pp_degrees)
    planner.runner.ahead((x, x.spec(planner.spec)) for x in likely_layouts(cfg, pairs))


def _layout_pairs(
    planner: _Planner,
    configs: dict[str, Configuration | None],
    tp_degrees: Sequence[int] | None,
    pp_degrees: Sequence[int],
) -> list[tuple[int, int]]:
    """The (tp, pp) layouts searched for these answers (tensor-parallel degrees by default when
    one spans more than a node, ``auto_tp_degrees``)."""
    tps = auto_tp_degrees(configs, planner.gpus_per_node) if tp_degrees is None else tp_degrees
    return layout_pairs(planner.gpus_per_node, planner.max_gpus, tps, pp_degrees)


def _layouts(
    spec: TrainingSpec,
    planner: _Planner,
    answers: dict[str, Candidate | None],
    tp_degrees: Sequence[int] | None,
    pp_degrees: Sequence[int],
    facts_cache: dict[tuple[str, bool], ModelFacts],
    progress: Progress | None,
) -> dict[str, list[LayoutResult]]:
    """The model-parallel layouts of each answer without offload (``layouts.py``), every one
    re-estimated through the plan's runner."""
    configs = {k: (c.configuration if c else None) for k, c in answers.items()}
    pairs = _layout_pairs(planner, configs, tp_degrees, pp_degrees)
    if not pairs or not any(c is not None and c.gpus > 1 for c in configs.values()):
        return {}
    if progress is not None:
        progress("model-parallel layouts", 0, 1)
    config = resolve(spec).source.config
    text = config.get_text_config() if config is not None else None
    hidden = getattr(text, "hidden_size", 0) or 0
    layers = config_depth(config) or 1

    def estimated(layout: Layout) -> tuple[int, int]:
        return planner.runner.reserved(layout, layout.spec(planner.spec))

    results, notes = search_layouts(
        configs,
        pairs,
        estimated=estimated,
        ahead=lambda items: planner.runner.ahead((x, x.spec(planner.spec)) for x in items),
        capacity=planner.capacity,
        max_gpus=planner.max_gpus,
        cost=lambda x: layout_costs(
            x,
            spec.seq_len,
            hidden,
            layers,
            facts_cache[(x.precision, x.checkpointing)].parameter_bytes,
        ),
    )
    planner.notes += notes
    for name, found in results.items():
        best = next((r for r in found if r.fits), None)
        answer = answers.get(name)
        if best is not None and answer is not None and best.layout.gpus < answer.configuration.gpus:
            planner.notes.append(
                f"{name}: tp {best.layout.tp} x pp {best.layout.pp} x dp {best.layout.dp} fits on "
                f"{best.layout.gpus} GPUs, fewer than data parallelism alone "
                f"({answer.configuration.gpus})"
            )
    return results
