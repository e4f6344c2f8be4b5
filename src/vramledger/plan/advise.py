"""``advise``: when a run does not fit, what to change first — least harm to convergence first.

The order is the source documents' (and the usual practice): activation checkpointing ->
smaller micro-batch with gradient accumulation -> freeing stray intermediates -> optimizer-state
compression (momentum SGD, 8-bit states, ZeRO sharding, offload). Each change is re-estimated
on its own (the bytes it saves) and in combination with the ones before it, in that order, until
the first combination that fits; then the changes that combination no longer needs are dropped,
the most harmful first (offloading the optimizer can make switching it unnecessary), so every
change it names is needed. Stray intermediates cannot be freed automatically: ``advise``
points at the largest temporaries alive at the peak and the modules and operators that made them.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from ..categories import Category
from ..gpus import Gpu
from ..ledger import Ledger, live_at, replay, steady_peak
from ..predict import estimate
from ..spec import TrainingSpec
from .search import DEFAULT_MARGIN

TOP_TEMPORARIES = 5
MIN_SAVING = 0.005
"""A change joins the combination only if it lowers the peak by at least this share of the
original peak (a change that saves a few MiB of 180 GiB is not worth its cost)."""


@dataclass(frozen=True, kw_only=True)
class Change:
    name: str
    description: str
    fields: dict[str, Any]
    """TrainingSpec fields the change sets (empty for advice that is not automatic)."""
    saves_bytes: int | None = None
    """Peak saved by this change alone (re-estimated)."""
    cumulative_peak_bytes: int | None = None
    """Peak with this change and every earlier helpful one applied (until the first combination
    that fits; None after it)."""
    fits: bool = False
    """The combination up to here fits (after the first fit: this change alone fits)."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "description": self.description,
            "fields": self.fields,
            "saves_bytes": self.saves_bytes,
            "cumulative_peak_bytes": self.cumulative_peak_bytes,
            "fits": self.fits,
        }


@dataclass(frozen=True, kw_only=True)
class Advice:
    budget_bytes: int
    peak_bytes: int
    fits: bool
    changes: list[Change]
    first_fit: list[str] | None
    """Names of the changes, in order, of the first combination that fits, each of them needed
    (without any one of them it does not fit)."""
    first_fit_peak_bytes: int | None = None
    """Peak of the first fitting combination (re-estimated), None when none fits."""
    stray_temporaries: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "budget_bytes": self.budget_bytes,
            "peak_bytes": self.peak_bytes,
            "fits": self.fits,
            "changes": [c.to_dict() for c in self.changes],
            "first_fit": self.first_fit,
            "first_fit_peak_bytes": self.first_fit_peak_bytes,
            "stray_temporaries": self.stray_temporaries,
        }


def _peak(ledger: Ledger) -> int:
    return ledger.reserved_peak_bytes if ledger.target == "cuda" else ledger.allocated_peak_bytes


def candidate_changes(spec: TrainingSpec) -> list[Change]:
    changes: list[Change] = []
    if not spec.grad_checkpointing and not spec.checkpoint_modules:
        changes.append(
            Change(
                name="activation checkpointing",
                fields={"grad_checkpointing": True},
                description="recompute each block's activations in backward (+~33 % compute)",
            )
        )
    micro, accum = spec.batch_size, spec.grad_accum
    while micro > 1:
        micro //= 2
        accum *= 2
        changes.append(
            Change(
                name=f"micro-batch {micro} x {accum} accumulation steps",
                fields={"batch_size": micro, "grad_accum": accum},
                description="same batch, smaller micro-batches, gradients accumulated",
            )
        )
    changes.append(
        Change(
            name="free stray intermediates",
            fields={},
            description="delete tensors the training loop keeps alive (see the largest temporaries)",
        )
    )
    if spec.optimizer not in ("sgd", "sgd-momentum"):
        changes.append(
            Change(
                name="momentum SGD",
                fields={"optimizer": "sgd-momentum"},
                description="one state tensor instead of two (changes training behaviour)",
            )
        )
    if "8bit" not in str(spec.optimizer):
        changes.append(
            Change(
                name="8-bit AdamW states",
                fields={"optimizer": "adamw8bit"},
                description="torchao AdamW8bit: ~2 bytes of state per parameter",
            )
        )
    if spec.world_size > 1 and spec.strategy in ("ddp", "zero1"):
        nxt = {"ddp": "zero1", "zero1": "zero2"}[spec.strategy]
        changes.append(
            Change(
                name=f"ZeRO sharding ({nxt})",
                fields={"strategy": nxt},
                description="shard optimizer state (and gradients) over the ranks",
            )
        )
    if spec.world_size > 1 and spec.strategy in ("ddp", "zero1", "zero2"):
        changes.append(
            Change(
                name="ZeRO-3 / FSDP",
                fields={"strategy": "zero3"},
                description="shard parameters too",
            )
        )
    if spec.offload == "none" and (spec.world_size > 1 or spec.precision.endswith("-mixed")):
        changes.append(
            Change(
                name="offload optimizer to CPU",
                fields={"offload": "optimizer"},
                description="optimizer state and fp32 master weights in host memory (slower step)",
            )
        )
    return changes


def stray_temporaries(ledger: Ledger) -> list[dict[str, Any]]:
    """The largest temporaries alive at the peak, with the module and operator that made them."""
    tl = ledger.timeline
    if tl is None:
        return []
    alive = live_at(tl, steady_peak(replay(tl)).event)
    temps = [s for s in alive if tl.category(s) is Category.TEMPORARIES and not tl.on_host[s]]
    temps.sort(key=lambda s: -tl.nbytes[s])
    return [
        {
            "bytes": tl.nbytes[s],
            "module": tl.module[s],
            "op": tl.op[s],
            "phase": tl.origin[s][1].value,
        }
        for s in temps[:TOP_TEMPORARIES]
    ]


def advise(spec: TrainingSpec, gpu: Gpu, *, margin: int = DEFAULT_MARGIN) -> Advice:
    budget = gpu.memory_bytes - margin
    base = estimate(spec)
    peak = _peak(base)
    strays = stray_temporaries(base)
    if peak <= budget:
        return Advice(
            budget_bytes=budget,
            peak_bytes=peak,
            fits=True,
            changes=[],
            first_fit=[],
            stray_temporaries=strays,
        )
    results: list[Change] = []
    chosen: list[Change] = []
    applied: dict[str, Any] = {}
    applied_peak = peak
    names: list[str] = []
    first_fit: list[str] | None = None
    first_fit_peak: int | None = None
    for change in candidate_changes(spec):
        if not change.fields:  # advice only: nothing to re-estimate
            results.append(change)
            continue
        alone = _peak(estimate(replace(spec, **change.fields)))
        if first_fit is not None:  # the rest are listed with what each saves on its own
            results.append(replace(change, saves_bytes=peak - alone, fits=alone <= budget))
            continue
        trial = {**applied, **change.fields}
        cumulative = alone if not applied else _peak(estimate(replace(spec, **trial)))
        if cumulative < applied_peak - MIN_SAVING * peak:  # keep changes that help, in order
            applied, applied_peak = trial, cumulative
            names.append(change.name)
            chosen.append(change)
        fits = applied_peak <= budget
        results.append(
            replace(change, saves_bytes=peak - alone, cumulative_peak_bytes=applied_peak, fits=fits)
        )
        if fits:
            needed, first_fit_peak = _needed(spec, chosen, budget, applied_peak)
            first_fit = [c.name for c in needed]
    return Advice(
        budget_bytes=budget,
        peak_bytes=peak,
        fits=False,
        changes=results,
        first_fit=first_fit,
        first_fit_peak_bytes=first_fit_peak,
        stray_temporaries=strays,
    )


def _needed(
    spec: TrainingSpec, chosen: list[Change], budget: int, peak: int
) -> tuple[list[Change], int]:
    """Drop the changes of a fitting combination (of ``peak``) that it does not need, trying the
    most harmful (the latest in the order) first; the last one, which made it fit, stays.
    Returns the changes kept and their peak."""
    kept = list(chosen)
    for change in reversed(chosen[:-1]):
        rest = [c for c in kept if c is not change]
        fields: dict[str, Any] = {}
        for c in rest:
            fields.update(c.fields)
        without = _peak(estimate(replace(spec, **fields)))
        if without <= budget:
            kept, peak = rest, without
    return kept, peak
