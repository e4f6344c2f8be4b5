"""``plan``: the fewest GPUs of a kind on which a training run fits, per optimizer, and the
trade-offs around it.

The search covers optimizer, precision, activation checkpointing, micro-batch (halving it and
accumulating gradients keeps the batch), strategy (DDP, ZeRO-1/2/3), optimizer offload and GPU
count. One fake-tensor trace is made per (optimizer, precision, checkpointing, micro-batch) on
one GPU; strategies and GPU counts are derived from it (``derive.py``: the bytes the caching
allocator reserves, as re-estimates report them) and the smallest GPU count of each
configuration found by bisection (memory per GPU never grows with the count), on the cheaper
tensor bytes first. The answer for each optimizer is then re-estimated with the real engines at
that count and one fewer, and moved if they disagree, so what ``plan`` answers is what
``estimate`` says; the next derived candidates are re-estimated too while one of them could
still need fewer GPUs than the best that holds (a re-estimate can move a count up: ZeRO-1/2's
whole-parameter partition is uneven, FSDP's gathers fragment the allocator's cache). Traces and
re-estimates of large models run in worker processes (``runner.py``).

A configuration fits when its peak plus ``margin`` is at most the GPU's memory. The margin is
explicit: the CUDA context and libraries (several hundred MiB), allocator fragmentation beyond
the modelled caching allocator, and communication buffers (NCCL) are not in the trace.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from ..allocator import CUDA_CACHING_ALLOCATOR
from ..errors import InputError
from ..gpus import Gpu
from ..ledger import replay, steady_peak, steady_reserved_peak
from ..optimizers import resolve_optimizer
from ..recipe import resolve
from ..spec import STRATEGIES, TrainingSpec
from ..timeline import Timeline
from ..trace.blocks import find_block_stack
from ..units import GIB, format_bytes
from .derive import ModelFacts, derive
from .runner import Runner

DEFAULT_MARGIN = 2 * GIB
MARGIN_SOURCE = (
    "default: CUDA context and libraries (~0.5-1 GiB on recent GPUs), NCCL buffers and "
    "fragmentation beyond the modelled caching allocator"
)
RECOMPUTE_FRACTION = 1 / 3
"""Activation checkpointing recomputes the forward pass: about a third more compute."""
NUMERICS = {"bf16-pure": "bf16 weights and optimizer state, no fp32 master copy"}
"""Precision modes that change what training computes beyond mixed precision's usual rounding."""
PLANNED_STRATEGIES = tuple(s for s in STRATEGIES if s != "fsdp")
"""Strategies the plan searches (fsdp is zero3's layout under another name)."""
PLANNED_OFFLOADS = ("none", "optimizer")
STRATEGY_RANK = {s: i for i, s in enumerate(PLANNED_STRATEGIES)}

Progress = Callable[[str, int, int], None]


@dataclass(frozen=True, kw_only=True)
class Configuration:
    optimizer: str
    precision: str
    checkpointing: bool
    micro_batch: int
    grad_accum: int
    strategy: str
    offload: str
    gpus: int

    def to_dict(self) -> dict[str, Any]:
        return dict(vars(self))

    def spec(self, base: TrainingSpec) -> TrainingSpec:
        strategy = self.strategy if self.gpus > 1 or self.strategy != "none" else None
        return replace(
            base,
            optimizer=self.optimizer,
            precision=self.precision,
            grad_checkpointing=self.checkpointing and not base.checkpoint_modules,
            batch_size=self.micro_batch,
            grad_accum=self.grad_accum,
            world_size=self.gpus,
            strategy=strategy if self.gpus > 1 else None,
            offload=self.offload,
            target="cuda",
        )


@dataclass(frozen=True, kw_only=True)
class Candidate:
    configuration: Configuration
    peak_bytes_per_gpu: int
    headroom_bytes: int
    costs: dict[str, Any]
    method: str
    """'derived' from a single-GPU trace, or 'estimated' with the real engines."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "gpus": self.configuration.gpus,
            "configuration": self.configuration.to_dict(),
            "peak_bytes_per_gpu": self.peak_bytes_per_gpu,
            "headroom_bytes": self.headroom_bytes,
            "costs": self.costs,
            "method": self.method,
        }


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
    """Tracing and deriving every configuration (the rest re-estimates the answers)."""
    estimates: int = 0
    """Re-estimates with the real engines made to check the answers."""
    workers: int = 1
    """Processes the traces after the first and the re-estimates ran in (1: this one)."""
    notes: list[str] = field(default_factory=list)

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
        }


def costs(
    config: Configuration, facts: ModelFacts, optimizer_changes: str | None
) -> dict[str, Any]:
    """What a configuration costs besides memory (per step, per GPU)."""
    grads = facts.parameter_bytes
    comm = {
        "none": 0,
        "ddp": 2 * grads,
        "zero1": 2 * grads + facts.parameter_bytes,
        "zero2": 2 * grads,
        "zero3": 3 * facts.parameter_bytes,
    }[config.strategy]
    if config.gpus == 1:
        comm = 0
    host_traffic = (
        2 * (grads + facts.parameter_bytes) // max(1, config.gpus)
        if config.offload != "none"
        else 0
    )
    return {
        "recompute_fraction": RECOMPUTE_FRACTION if config.checkpointing else 0.0,
        "grad_accum_steps": config.grad_accum,
        "communication_bytes_per_step": comm,
        "host_transfer_bytes_per_step": host_traffic,
        "optimizer_behaviour": optimizer_changes or "unchanged",
        "numerics": NUMERICS.get(config.precision, "unchanged"),
    }


def _behaviour(name: str, reference: str) -> str | None:
    if name == reference:
        return None
    key = name.lower()
    if "8bit" in key or "4bit" in key or "fp8" in key:
        return "quantized optimizer states"
    return f"a different optimizer than {reference}"


def _facts(spec: TrainingSpec) -> ModelFacts:
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
    progress: Progress | None = None,
) -> Plan:
    """``workers``: processes for the traces after the first and for the re-estimates
    (``runner.py``); None: one per CPU when the first trace takes long enough to repay starting
    them, else none."""
    if max_gpus < 1:
        raise InputError(f"--max-gpus must be at least 1, not {max_gpus}")
    if workers is not None and workers < 1:
        raise InputError(f"--workers must be at least 1, not {workers}")
    if not optimizers:
        raise InputError("no optimizers to plan for", hint="pass --optimizers adamw,sgd-momentum")
    for name in optimizers:  # a misspelt name is refused before any tracing
        resolve_optimizer(name, spec.optimizer_kwargs)
    if margin < 0 or margin >= gpu.memory_bytes:
        raise InputError(
            f"the margin ({format_bytes(margin)}) leaves nothing of {gpu.name}'s "
            f"{format_bytes(gpu.memory_bytes)}",
            hint="pass a smaller --margin",
        )
    start = time.perf_counter()
    capacity = gpu.memory_bytes - margin
    precisions = list(precisions or [spec.precision])
    policy_cc = gpu.compute_capability or (9, 0)
    micro = _micro_batches(spec.batch_size * spec.grad_accum)
    reference = optimizers[0]
    candidates: list[Candidate] = []
    traces = configurations = 0
    notes: list[str] = []
    facts_cache: dict[tuple[str, bool], ModelFacts] = {}
    derived: dict[tuple[str, str, bool, int, str, str], DerivedPeaks] = {}
    fewest: dict[str, Candidate | None] = {}
    on_gpu: dict[str, Candidate | None] = {}
    verified: dict[Configuration, Candidate] = {}
    bases = [
        replace(
            spec,
            optimizer=optimizer,
            precision=precision,
            grad_checkpointing=ckpt,
            batch_size=micro_batch,
            grad_accum=accum,
            world_size=1,
            strategy=None,
            offload="none",
            target="cuda",
        )
        for optimizer in optimizers
        for precision in precisions
        for ckpt in checkpointing
        for micro_batch, accum in micro
    ]
    with Runner(policy_cc, workers) as runner:
        for base, timeline in runner.traces(bases):
            optimizer, precision, ckpt = base.optimizer, base.precision, base.grad_checkpointing
            micro_batch, accum = base.batch_size, base.grad_accum
            if (precision, ckpt) not in facts_cache:
                facts_cache[(precision, ckpt)] = _facts(base)
            facts = facts_cache[(precision, ckpt)]
            traces += 1
            if progress is not None:
                progress("traces", traces, len(bases))
            for strategy in PLANNED_STRATEGIES:
                for offload in offloads:
                    configurations += 1
                    peaks = DerivedPeaks(timeline, facts, strategy, offload)
                    derived[(optimizer, precision, ckpt, micro_batch, strategy, offload)] = peaks
                    # One GPU runs without a strategy; strategies start at two.
                    lo, hi = (1, 1) if strategy == "none" else (2, max_gpus)
                    if strategy == "ddp":
                        hi = lo  # DDP's memory does not depend on the GPU count
                    gpus = _fewest(peaks.reserved, capacity, lo, hi, peaks.tensors)
                    if gpus is None:
                        continue
                    config = Configuration(
                        optimizer=optimizer,
                        precision=precision,
                        checkpointing=ckpt,
                        micro_batch=micro_batch,
                        grad_accum=accum,
                        strategy=strategy,
                        offload=offload,
                        gpus=gpus,
                    )
                    value = peaks.reserved(gpus)
                    candidates.append(
                        Candidate(
                            configuration=config,
                            peak_bytes_per_gpu=value,
                            headroom_bytes=gpu.memory_bytes - margin - value,
                            costs=costs(config, facts, _behaviour(optimizer, reference)),
                            method="derived",
                        )
                    )
        searched = time.perf_counter()
        tasks = []
        for optimizer in optimizers:
            mine = [c for c in candidates if c.configuration.optimizer == optimizer]
            on_gpu_only = [c for c in mine if c.configuration.offload == "none"]
            tasks += [
                (fewest, optimizer, sorted(mine, key=_preference)),
                (on_gpu, optimizer, sorted(on_gpu_only, key=_preference)),
            ]
        if verify:
            runner.ahead(
                (config, config.spec(spec))
                for _, _, ranked in tasks
                for config in _likely_counts(ranked[0].configuration if ranked else None, max_gpus)
            )
        for table, optimizer, ranked in tasks:
            best = ranked[0] if ranked else None
            if verify and ranked:
                # Re-estimate candidates in order while one could still beat the best that
                # holds (its derived count is lower): a re-estimate can move a count up.
                holding: Candidate | None = None
                for candidate in ranked[:ANSWER_TRIES]:
                    if holding is not None and (
                        candidate.configuration.gpus >= holding.configuration.gpus
                    ):
                        break
                    if candidate.configuration not in verified:
                        if progress is not None:
                            progress("re-estimating answers", len(verified), len(verified) + 1)
                        verified[candidate.configuration] = _verified(
                            candidate, capacity, max_gpus, derived, notes, runner, spec
                        )
                    checked = verified[candidate.configuration]
                    if checked.method == "estimated" and (
                        holding is None or checked.configuration.gpus < holding.configuration.gpus
                    ):
                        holding = checked
                best = holding or verified[ranked[0].configuration]
            table[optimizer] = best
    return Plan(
        gpu=gpu,
        margin_bytes=margin,
        margin_source=margin_source,
        max_gpus=max_gpus,
        fewest_gpus=fewest,
        fewest_gpus_without_offload=on_gpu,
        front=pareto(candidates),
        configurations=configurations,
        traces=traces,
        seconds=time.perf_counter() - start,
        search_seconds=searched - start,
        estimates=runner.estimates,
        workers=runner.workers or 1,
        notes=notes,
    )


def _preference(c: Candidate) -> tuple[Any, ...]:
    """Fewest GPUs; then least harm: no recompute, fewer accumulation steps, simpler strategy,
    no offload, more headroom."""
    cfg = c.configuration
    return (
        cfg.gpus,
        cfg.checkpointing,
        cfg.grad_accum,
        cfg.offload != "none",
        STRATEGY_RANK[cfg.strategy],
        -c.headroom_bytes,
    )


class DerivedPeaks:
    """Derived peaks of one configuration at any GPU count (memoised): the bytes the caching
    allocator reserves (what re-estimates check), and the tensor bytes, a cheaper lower bound."""

    def __init__(self, timeline: Timeline, facts: ModelFacts, strategy: str, offload: str):
        self.facts = facts
        self._derive = lambda n: derive(timeline, facts, strategy, n, offload)
        self._tensors: dict[int, int] = {}
        self._reserved: dict[int, int] = {}

    def tensors(self, n: int) -> int:
        if n not in self._tensors:
            self._tensors[n] = steady_peak(replay(self._derive(n))).total
        return self._tensors[n]

    def reserved(self, n: int) -> int:
        if n not in self._reserved:
            derived = replay(self._derive(n), CUDA_CACHING_ALLOCATOR)
            self._reserved[n] = steady_reserved_peak(derived)
        return self._reserved[n]


def _fewest(
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
        start = _fewest(lower_bound, capacity, lo, hi)
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
    """The re-estimates an answer most likely needs: its derived count and the counts either
    side (an answer rests on its count and one fewer, and derived peaks are a little off the
    real engines' reserved bytes, which also hold the caching allocator's free blocks)."""
    if config is None:
        return []
    if config.strategy in ("none", "ddp"):
        return [config]
    counts = (config.gpus, config.gpus - 1, config.gpus + 1)
    return [replace(config, gpus=n) for n in counts if 2 <= n <= max_gpus]


VERIFY_TRIES = 4
"""Re-estimates allowed per answer when moving its GPU count."""
ANSWER_TRIES = 3
"""Derived candidates re-estimated per answer before giving up (the derivation treats ZeRO-1/2's
whole-parameter partition as even; the largest parameter's step temporaries are not)."""


def _verified(
    c: Candidate,
    capacity: int,
    max_gpus: int,
    derived_peaks: dict[tuple[str, str, bool, int, str, str], DerivedPeaks],
    notes: list[str],
    runner: Runner,
    base: TrainingSpec,
) -> Candidate:
    """Re-estimate a derived answer with the real engines (reserved bytes, as the caching
    allocator holds them) and move its GPU count until it fits and one fewer does not.

    The derived peaks are calibrated by the first re-estimate (real / derived at the same count)
    to guess where to look; every count the answer rests on is re-estimated."""
    cfg = c.configuration
    scalable = cfg.strategy not in ("none", "ddp")
    lowest = 2 if scalable else 1
    derived = derived_peaks[
        (
            cfg.optimizer,
            cfg.precision,
            cfg.checkpointing,
            cfg.micro_batch,
            cfg.strategy,
            cfg.offload,
        )
    ]

    def peak_at(n: int) -> int:
        at_n = replace(cfg, gpus=n)
        return runner.reserved(at_n, at_n.spec(base))  # memoised for every answer of the plan

    known: dict[int, int] = {cfg.gpus: peak_at(cfg.gpus)}
    if scalable:
        ratio = known[cfg.gpus] / max(1, derived.reserved(cfg.gpus))
        guess = _fewest(
            lambda n: round(derived.reserved(n) * ratio),
            capacity,
            lowest,
            max_gpus,
            lambda n: round(derived.tensors(n) * min(1.0, ratio)),
        )
        n = guess if guess is not None else max_gpus
        for _ in range(VERIFY_TRIES):
            if n not in known:
                known[n] = peak_at(n)
            if known[n] > capacity:
                if n >= max_gpus:
                    break
                n += 1
            elif n == lowest:
                break
            else:
                if n - 1 not in known:
                    known[n - 1] = peak_at(n - 1)
                if known[n - 1] > capacity:
                    break
                n -= 1
        if n not in known:  # out of tries while moving up
            known[n] = peak_at(n)
        cfg = replace(cfg, gpus=n)
    value = known[cfg.gpus]
    fits = value <= capacity
    settled = not scalable or cfg.gpus == lowest or known.get(cfg.gpus - 1, capacity + 1) > capacity
    if not fits:
        notes.append(
            f"{cfg.optimizer}: {cfg.strategy} on {c.configuration.gpus} GPUs (derived) does not "
            f"fit when re-estimated with the real engines, up to {cfg.gpus} GPUs"
        )
    elif not settled:
        notes.append(f"{cfg.optimizer}: {cfg.gpus - 1} GPUs not re-estimated (out of tries)")
    return replace(
        c,
        configuration=cfg,
        peak_bytes_per_gpu=value,
        headroom_bytes=capacity - value,
        costs=costs(cfg, derived.facts, c.costs["optimizer_behaviour"]),
        method="estimated" if fits else "estimated (does not fit)",
    )


def pareto(candidates: list[Candidate]) -> list[Candidate]:
    """Configurations not beaten on all of GPU count, memory per GPU, recompute, communication
    and optimizer behaviour by another one."""

    def key(c: Candidate) -> tuple[float, ...]:
        k = c.costs
        return (
            c.configuration.gpus,
            c.peak_bytes_per_gpu,
            k["recompute_fraction"],
            k["communication_bytes_per_step"] + k["host_transfer_bytes_per_step"],
            0.0 if k["optimizer_behaviour"] == "unchanged" else 1.0,
            0.0 if k["numerics"] == "unchanged" else 1.0,
            k["grad_accum_steps"],
        )

    keyed = [(key(c), c) for c in candidates]
    front = []
    for ka, a in keyed:
        dominated = any(
            all(x <= y for x, y in zip(kb, ka, strict=True)) and kb != ka for kb, _ in keyed
        )
        if not dominated:
            front.append(a)
    front.sort(key=lambda c: (c.configuration.gpus, c.peak_bytes_per_gpu))
    return front
