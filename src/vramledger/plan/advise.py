"""``advise``: when a run does not fit, what to change first — least harm to convergence first.

The order follows the source documents and the evidence: changes that leave what training
computes untouched come first — activation checkpointing (more compute), a smaller micro-batch
with gradient accumulation (less throughput), deleting tensors the user's own code keeps alive,
the optimizer's fused implementation (no step scratch), sharding over more GPUs, offloading the
optimizer to host memory — then optimizer-state compression, ranked by the loss gap measured
against AdamW (``data/optimizer_evidence.json``, from ``benchmarks/lowbit.py``: 8-bit AdamW's
gap is smaller than momentum SGD's).

Each change is re-estimated on its own and shown as an alternative (its peak alone, whether it
fits alone). Separately, the changes are combined in that order until the first combination
that fits; then the changes it does not need are dropped, the most harmful first, so every change
it names is needed. Every answer that offloads says how much host memory each node needs, and
with ``host_memory`` one that needs more does not fit.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Any

from vramledger.inputs.categories import MODEL_STATE_CATEGORIES, Category, Phase
from vramledger.inputs.extras import EXTRAS, installed, optimizer_package
from vramledger.inputs.gpus import Gpu
from vramledger.inputs.launch_configs import apply_configs
from vramledger.inputs.notes import Topic, records, tagged
from vramledger.inputs.optimizers import resolve_optimizer
from vramledger.inputs.recipe import resolve
from vramledger.inputs.spec import TrainingSpec
from vramledger.inputs.verdict import DEFAULT_MARGIN, check_margin, verdict
from vramledger.inputs.version import PACKAGE_DIR
from vramledger.ledger.ledger import Ledger
from vramledger.plan.candidates import DEFAULT_GPUS_PER_NODE
from vramledger.predict.step import estimate
from vramledger.record.event_totals import live_at
from vramledger.record.timeline import Timeline
from vramledger.trace.core.blocks import find_block_stack

TOP_TEMPORARIES = 5
MIN_SAVING = 0.005
"""A change joins the combination only if it lowers the peak by at least this share of the
original peak (a change that saves a few MiB of 180 GiB is not worth its cost)."""
MAX_GPUS = 1024
"""Largest world size ``advise`` tries when it looks for more GPUs."""
EVIDENCE_FILE = PACKAGE_DIR / "data" / "optimizer_evidence.json"
EVIDENCE: dict[str, Any] = json.loads(EVIDENCE_FILE.read_text())
"""Measured loss gaps of optimizers against AdamW, with their source."""
STATE_ONLY = frozenset({Category.INPUTS, Category.BUFFERS, *MODEL_STATE_CATEGORIES})


@dataclass(frozen=True, kw_only=True)
class Change:
    name: str
    description: str
    fields: dict[str, Any]
    """TrainingSpec fields the change sets (empty for advice that is not automatic)."""
    behaviour: str = "unchanged"
    """What it does to training: 'unchanged', or the measured loss gap."""
    saves_bytes: int | None = None
    """Peak saved by this change alone (re-estimated)."""
    peak_bytes: int | None = None
    """Peak with this change alone (re-estimated)."""
    host_bytes_per_node: int = 0
    """Host memory one node needs with this change alone (offload)."""
    cumulative_peak_bytes: int | None = None
    """Peak with this change and every earlier helpful one (until the first combination that
    fits; None after it)."""
    fits: bool = False
    """This change alone fits (device and host memory)."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "description": self.description,
            "fields": self.fields,
            "behaviour": self.behaviour,
            "saves_bytes": self.saves_bytes,
            "peak_bytes": self.peak_bytes,
            "host_bytes_per_node": self.host_bytes_per_node,
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
    first_fit_host_bytes_per_node: int = 0
    stray_temporaries: list[dict[str, Any]] = field(default_factory=list)
    """Tensors the training step's forward makes that are still alive after its backward:
    what the user's code (or a module's cache) keeps alive. Empty: there are none."""
    host_memory_bytes: int | None = None
    gpus_per_node: int = DEFAULT_GPUS_PER_NODE
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "budget_bytes": self.budget_bytes,
            "peak_bytes": self.peak_bytes,
            "fits": self.fits,
            "changes": [c.to_dict() for c in self.changes],
            "first_fit": self.first_fit,
            "first_fit_peak_bytes": self.first_fit_peak_bytes,
            "first_fit_host_bytes_per_node": self.first_fit_host_bytes_per_node,
            "stray_temporaries": self.stray_temporaries,
            "host_memory_bytes": self.host_memory_bytes,
            "gpus_per_node": self.gpus_per_node,
            "notes": self.notes,
            "note_records": records(self.notes),
        }


def device_peak(ledger: Ledger) -> int:
    """What has to fit on the device: reserved bytes on CUDA (the caching allocator holds them)."""
    return ledger.reserved_peak_bytes if ledger.target == "cuda" else ledger.allocated_peak_bytes


def host_bytes_per_node(ledger: Ledger, gpus_per_node: int) -> int:
    """Host memory one node needs: each of its ranks' offloaded bytes."""
    return ledger.host_bytes * min(ledger.world_size, gpus_per_node)


def stray_tensors(timeline: Timeline | None) -> list[dict[str, Any]]:
    """Tensors made in the last step's forward (or backward, outside the gradients) that are
    still alive when its backward has ended: autograd frees what it saved as backward consumes
    it, so whatever survives is held by the training code itself (a kept output, a loss history,
    a module's cache). The optimizer's own scratch is not among them."""
    if timeline is None:
        return []
    step = timeline.steps
    marks = [(i, p) for i, s, p in timeline.marks if s == step]
    if not any(p is Phase.BACKWARD for _, p in marks):
        return []
    # the step's last phase mark is the optimizer's, after its (last) backward
    alive = live_at(timeline, max(i for i, p in marks if p is Phase.OPTIMIZER) - 1)
    kept = [
        s
        for s in alive
        if timeline.origin[s][0] == step
        and timeline.origin[s][1] in (Phase.FORWARD, Phase.BACKWARD)
        and timeline.category(s) not in STATE_ONLY
        and not timeline.on_host[s]
    ]
    kept.sort(key=lambda s: -timeline.nbytes[s])
    return [
        {
            "bytes": timeline.nbytes[s],
            "module": timeline.module[s],
            "op": timeline.op[s],
            "phase": timeline.origin[s][1].value,
        }
        for s in kept[:TOP_TEMPORARIES]
    ]


def _gap(name: str) -> str | None:
    row = EVIDENCE["optimizers"].get(name)
    if row is None:
        return None
    return (
        f"final loss {100 * row['final_gap']:+.1f} % vs AdamW (largest gap "
        f"{100 * row['max_gap']:.1f} %; benchmarks/lowbit.py)"
    )


def candidate_changes(spec: TrainingSpec) -> list[Change]:
    """The changes worth trying for ``spec``, least harm first."""
    changes: list[Change] = []
    checkpointing = _checkpointing(spec)
    if checkpointing is not None:
        changes.append(
            Change(
                name="activation checkpointing",
                fields=checkpointing,
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
    choice = resolve_optimizer(spec.optimizer, spec.optimizer_kwargs)
    if choice.package == "torch" and choice.accepts("fused") and not choice.kwargs.get("fused"):
        changes.append(
            Change(
                name=f"fused {choice.cls.__name__}",
                fields={"optimizer_kwargs": {**spec.optimizer_kwargs, "fused": True}},
                description="the fused kernel updates in place: no multi-tensor step scratch",
            )
        )
    nxt = spec.parallelism.next_deepspeed_strategy
    if spec.world_size > 1 and nxt is not None:
        changes.append(
            Change(
                name=f"ZeRO sharding ({nxt})",
                fields={"strategy": nxt},
                description="shard optimizer state (and gradients) over the ranks",
            )
        )
    if spec.world_size > 1 and spec.parallelism.upgrades_to_zero3:
        changes.append(
            Change(
                name="ZeRO-3" if spec.parallelism.is_deepspeed else "FSDP",
                fields={"strategy": "zero3" if spec.parallelism.is_deepspeed else "fsdp"},
                description="shard parameters too",
            )
        )
    if not spec.parallelism.offloads and (spec.world_size > 1 or spec.precision.endswith("-mixed")):
        changes.append(
            Change(
                name="offload optimizer to CPU",
                fields={"offload": "optimizer"},
                description="optimizer state and fp32 master weights in host memory (slower step)",
            )
        )
    ranked = sorted(
        (c for c in COMPRESSIONS if c[1] != spec.optimizer and not _not_installed(c[1])),
        key=lambda c: EVIDENCE["optimizers"][c[1]]["final_gap"],
    )
    for name, optimizer, description in ranked:
        changes.append(
            Change(
                name=name,
                fields={"optimizer": optimizer, "optimizer_kwargs": {}},
                description=description,
                behaviour=_gap(optimizer) or "changes training behaviour",
            )
        )
    return changes


COMPRESSIONS: tuple[tuple[str, str, str], ...] = (
    ("8-bit AdamW states", "adamw8bit", "torchao AdamW8bit: ~2 bytes of state per parameter"),
    ("momentum SGD", "sgd-momentum", "one state tensor instead of two"),
)
"""Optimizer-state compressions advise tries: (change, optimizer, what it keeps)."""


def _not_installed(optimizer: str) -> str | None:
    """The optional package ``optimizer`` needs when it is not installed (extras.py): its
    change is left out, and a note says so."""
    package = optimizer_package(optimizer)
    return package if package is not None and not installed(package) else None


def _untried_notes(spec: TrainingSpec) -> list[str]:
    return [
        f"{name} not tried: {optimizer} needs {package}, which is not installed (pip install "
        f"'vramledger[{EXTRAS[package]}]')"
        for name, optimizer, _ in COMPRESSIONS
        if optimizer != spec.optimizer and (package := _not_installed(optimizer))
    ]


def _checkpointing(spec: TrainingSpec) -> dict[str, Any] | None:
    """How to turn activation checkpointing on: the Hugging Face switch, else checkpointing the
    class of the model's repeated blocks; None when it is on or there are no blocks."""
    if spec.grad_checkpointing or spec.checkpoint_modules:
        return None
    recipe = resolve(spec)
    model = recipe.build_model("meta")
    if recipe.source.supports_hf_checkpointing or getattr(
        model, "supports_gradient_checkpointing", False
    ):
        return {"grad_checkpointing": True}
    stack = find_block_stack(model, min_blocks=1)
    if stack is None:
        return None
    return {"checkpoint_modules": (type(model.get_submodule(stack.fqn)[0]).__name__,)}


@dataclass(frozen=True, kw_only=True)
class _Budget:
    gpu: Gpu
    margin: int
    host: int | None
    gpus_per_node: int

    @property
    def device(self) -> int:
        return self.gpu.memory_bytes - self.margin

    def fits(self, ledger: Ledger) -> bool:
        host_ok = self.host is None or host_bytes_per_node(ledger, self.gpus_per_node) <= self.host
        return verdict(self.gpu, device_peak(ledger), self.margin).fits and host_ok


def advise(
    spec: TrainingSpec,
    gpu: Gpu,
    *,
    margin: int = DEFAULT_MARGIN,
    host_memory: int | None = None,
    gpus_per_node: int = DEFAULT_GPUS_PER_NODE,
    max_gpus: int = MAX_GPUS,
) -> Advice:
    """What to change, least harm first, for ``spec`` to fit on ``gpu`` (and, with
    ``host_memory``, in each node's host memory)."""
    check_margin(gpu, margin)
    spec = replace(spec, gpu=gpu, gpu_memory=None, margin=margin)  # every estimate on this GPU
    spec, _ = apply_configs(spec)  # the launch's config files, once: variants keep their values
    budget = _Budget(gpu=gpu, margin=margin, host=host_memory, gpus_per_node=gpus_per_node)
    base = estimate(spec)
    peak = device_peak(base)
    strays = stray_tensors(base.timeline)
    common = dict(
        budget_bytes=budget.device,
        peak_bytes=peak,
        stray_temporaries=strays,
        host_memory_bytes=host_memory,
        gpus_per_node=gpus_per_node,
    )
    if budget.fits(base):
        return Advice(fits=True, changes=[], first_fit=[], **common)
    results: list[Change] = []
    chosen: list[Change] = []
    applied: dict[str, Any] = {}
    applied_peak = peak
    first_fit: list[str] | None = None
    first_fit_ledger: Ledger | None = None
    changes = candidate_changes(spec)
    stray_bytes = sum(t["bytes"] for t in strays)
    for change in changes:
        alone = estimate(replace(spec, **change.fields))
        result = replace(
            change,
            peak_bytes=device_peak(alone),
            saves_bytes=peak - device_peak(alone),
            host_bytes_per_node=host_bytes_per_node(alone, gpus_per_node),
            fits=budget.fits(alone),
        )
        if first_fit is None:
            trial = {**applied, **change.fields}
            combined = alone if not applied else estimate(replace(spec, **trial))
            if device_peak(combined) < applied_peak - MIN_SAVING * peak:
                applied, applied_peak = trial, device_peak(combined)
                chosen.append(change)
            result = replace(result, cumulative_peak_bytes=applied_peak)
            if chosen and chosen[-1] is change and budget.fits(combined):
                needed, first_fit_ledger = _needed(spec, chosen, budget, combined)
                first_fit = [c.name for c in needed]
        results.append(result)
    notes = []
    if strays:
        notes.append(
            f"the training code keeps {len(strays)} tensors of the forward alive after backward "
            f"(up to {stray_bytes:,} bytes to free by deleting them): see stray_temporaries"
        )
    else:
        notes.append(
            "no stray intermediates: nothing the forward makes outlives the backward (the "
            "temporaries at the peak are the optimizer's or autograd's own)"
        )
    more = _more_gpus(spec, budget, max_gpus)
    if more is not None:
        results.append(more)
    notes.append(f"compression ranked by measured loss gap: {EVIDENCE['source']}")
    notes += _untried_notes(spec)
    return Advice(
        fits=False,
        changes=results,
        first_fit=first_fit,
        first_fit_peak_bytes=device_peak(first_fit_ledger) if first_fit_ledger else None,
        first_fit_host_bytes_per_node=(
            host_bytes_per_node(first_fit_ledger, gpus_per_node) if first_fit_ledger else 0
        ),
        notes=tagged(notes, Topic.PLAN),
        **common,
    )


def _more_gpus(spec: TrainingSpec, budget: _Budget, max_gpus: int) -> Change | None:
    """The fewest GPUs on which the step fits with FSDP2, nothing else changed, found
    by doubling and bisecting with re-estimates (memory per GPU does not grow with the count)."""
    if spec.parallelism.offloads and spec.parallelism.is_single:
        return None
    start = max(2, spec.world_size * 2 if spec.parallelism.shards_params else 2)
    tried: dict[int, Ledger] = {}

    def at(n: int) -> Ledger:
        if n not in tried:
            tried[n] = estimate(
                replace(spec, world_size=n, strategy="fsdp", nodes=None, gpus_per_node=None)
            )
        return tried[n]

    n = start
    while not budget.fits(at(n)):
        if 2 * n > max_gpus:
            return None
        # what sharding cannot shrink (activations) stays: stop once doubling barely helps
        if n > start and device_peak(at(n)) > device_peak(at(n // 2)) * (1 - MIN_SAVING):
            return None
        n *= 2
    lo, hi = max(start, n // 2 + 1), n
    while lo < hi:
        mid = (lo + hi) // 2
        if budget.fits(at(mid)):
            hi = mid
        else:
            lo = mid + 1
    ledger = at(hi)
    return Change(
        name=f"{hi} GPUs with FSDP",
        fields={"world_size": hi, "strategy": "fsdp"},
        description=f"shard parameters, gradients and state over {hi} GPUs (fewest that fit)",
        peak_bytes=device_peak(ledger),
        saves_bytes=None,
        host_bytes_per_node=host_bytes_per_node(ledger, budget.gpus_per_node),
        fits=True,
    )


def _needed(
    spec: TrainingSpec, chosen: list[Change], budget: _Budget, ledger: Ledger
) -> tuple[list[Change], Ledger]:
    """Drop the changes of a fitting combination that it does not need, trying the most harmful
    (the latest in the order) first; the last one, which made it fit, stays."""
    kept = list(chosen)
    for change in reversed(chosen[:-1]):
        rest = [c for c in kept if c is not change]
        fields: dict[str, Any] = {}
        for c in rest:
            fields.update(c.fields)
        without = estimate(replace(spec, **fields))
        if budget.fits(without):
            kept, ledger = rest, without
    return kept, ledger
