"""The Ledger: peak memory of a training step, by category and phase, replayed from a Timeline.

:func:`build_ledger` replays the Timeline twice (``replay.py``): in raw tensor bytes and in the
blocks the target's allocator hands out, and keeps the steady-state peak (steps >= 2; step 1
creates the optimizer state lazily) of each, the first step's, each phase's, and what is live
at the peak by category and by module. Every breakdown sums exactly to its total (asserted).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from vramledger.inputs.categories import Category, Phase
from vramledger.inputs.notes import records
from vramledger.inputs.parallelism import engine_of
from vramledger.inputs.verdict import Verdict
from vramledger.ledger.peak_modules import ModuleBytes, modules_at_peak, top_modules
from vramledger.ledger.replay import replay, steady_peak, steady_phase_peaks, steady_reserved_peak
from vramledger.record.allocator import AllocatorModel
from vramledger.record.event_totals import EventTotals
from vramledger.record.timeline import Timeline

TOP_MODULES = 10
"""How many modules the top-activation list and the modules at the peak keep."""


@dataclass(frozen=True, kw_only=True)
class Ledger:
    """Peak memory of one training step and where it goes. Bytes are ints."""

    target: str
    allocator: str
    peak_bytes: int
    """Steady-state step peak (steps >= 2) of live tensor bytes, no allocator rounding."""
    allocated_peak_bytes: int
    """The same counted as the target allocator counts it: CUDA caching-allocator blocks
    (512-byte rounding, unsplit blocks), as ``torch.cuda.max_memory_allocated()``."""
    reserved_peak_bytes: int
    """Steady-state peak of the memory the allocator reserves from the device (segments,
    cached free blocks included), as ``torch.cuda.max_memory_reserved()``; equals
    ``allocated_peak_bytes`` where the allocator caches nothing (CPU)."""
    first_step_peak_bytes: int
    first_step_allocated_peak_bytes: int
    peak_phase: Phase
    first_step_peak_phase: Phase
    at_peak: dict[Category, int]
    """Category -> bytes at the steady-state peak; sums to ``peak_bytes``."""
    allocated_at_peak: dict[Category, int]
    """Category -> allocator bytes at the allocator-view peak; sums to ``allocated_peak_bytes``."""
    first_step_at_peak: dict[Category, int]
    phases: dict[Phase, int]
    """Peak live bytes of each phase in the steady state."""
    allocated_phases: dict[Phase, int]
    step_start_bytes: int
    """Live bytes when the last step began (what it inherits: parameters, state, gradients)."""
    host_bytes: int
    """Peak bytes the target keeps in host memory (not in ``peak_bytes``)."""
    model_state_bytes: int
    """The most model state (parameters, gradients, master weights, optimizer state — sharded
    or not) held at once in a steady-state step: the ZeRO paper's per-GPU model states."""
    parameters: int
    """Parameters of the whole model, counted once where tied (sharded or split, the count is
    the model's, not a rank's); ``trainable_parameters``: those that train. Per-parameter
    figures divide by these."""
    trainable_parameters: int
    stage_parameters: int | None = None
    """Under pipeline parallelism (``--pp``), the parameters of the stage(s) this rank holds, a
    part of ``parameters``; None when each rank holds (a shard of) every layer."""
    top_modules: list[tuple[str, int]]
    """Modules holding the most activation bytes at the end of the forward pass."""
    peak_modules: list[ModuleBytes] = field(default_factory=list)
    """The bytes live at the steady-state peak by the module whose code allocated them (its
    forward, its forward recomputed, its backward; ``peak_modules.py``), largest first; they
    sum to ``peak_bytes``. The JSON keeps the first ``TOP_MODULES`` and sums the rest."""
    optimizer_state_bytes: int
    """Optimizer state at the end of the run (device and host)."""
    optimizer_state_method: str = "traced"
    """How the optimizer's memory is known: 'traced' (its real code ran), a stand-in's
    description (bitsandbytes layout, CPU offload), or 'measured'."""
    spec: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0
    version: str = ""
    timeline: Timeline | None = field(default=None, repr=False, compare=False)
    """The Timeline the ledger was replayed from (not part of the JSON)."""
    world_size: int = 1
    strategy: str = "none"
    worst_rank: int = 0
    """The rank this ledger describes: the one with the largest allocated peak."""
    ranks: list[tuple[list[int], Ledger]] = field(default_factory=list, repr=False, compare=False)
    """One entry per distinct rank ledger: the ranks that share it, and the ledger."""
    mesh_coords: dict[str, int] = field(default_factory=dict)
    """Where the rank this ledger describes sits on the device mesh: ``dp``, ``tp``, ``pp``,
    ``cp``, ``ep`` (``parallel/mesh.py``); empty on one device."""
    warnings: list[str] = field(default_factory=list)
    """What about the request looks unintended (checks.py), said before the numbers."""
    moe_routing_peaks: dict[str, int] = field(default_factory=dict)
    """When the peak depends on how MoE routers route: the allocated peak under each routing
    traced (trace/core/values.py); empty when it does not."""
    blocks_extended: bool = False
    """The timeline was extended from a few of the model's identical blocks (trace/core/blocks.py)
    rather than traced block by block."""
    verdict: Verdict | None = None
    """Whether the step fits the GPU asked for (``--gpu``/``--gpu-memory``), with the margin;
    None when no GPU was given."""

    def __post_init__(self) -> None:
        assert sum(self.at_peak.values()) == self.peak_bytes
        assert sum(self.allocated_at_peak.values()) == self.allocated_peak_bytes
        assert sum(self.first_step_at_peak.values()) == self.first_step_peak_bytes
        assert not self.peak_modules or sum(m.total for m in self.peak_modules) == self.peak_bytes

    @property
    def optimizer_state_bytes_per_param(self) -> float:
        return (
            self.optimizer_state_bytes / self.trainable_parameters
            if self.trainable_parameters
            else 0.0
        )

    @property
    def optimizer_state_bytes_all_ranks(self) -> int:
        """Optimizer state summed over every rank (each distinct rank's times the ranks like
        it); this ledger's own on one device. ``optimizer_state_bytes`` and its per-parameter
        figure are one rank's, divided by the whole model's parameter count."""
        if not self.ranks:
            return self.optimizer_state_bytes
        return sum(len(ids) * ledger.optimizer_state_bytes for ids, ledger in self.ranks)

    def to_dict(self) -> dict[str, Any]:
        """The JSON contract (fields are added, never renamed or removed)."""
        out = self._core_dict()
        out.update(
            optimizer_state_bytes_all_ranks=self.optimizer_state_bytes_all_ranks,
            world_size=self.world_size,
            strategy=self.strategy,
            engine=engine_of(self.strategy),
            worst_rank=self.worst_rank,
            cpu_bytes=self.host_bytes,
            ranks=[
                {"rank_ids": ids, "mesh_coords": _coords(ledger, ids[0]), **ledger._core_dict()}
                for ids, ledger in self.ranks
            ]
            or [
                {
                    "rank_ids": [self.worst_rank],
                    "mesh_coords": _coords(self, self.worst_rank),
                    **self._core_dict(),
                }
            ],
        )
        out.update(
            self.verdict.to_dict()
            if self.verdict
            else {"gpu": None, "margin_bytes": None, "fits": None, "headroom_bytes": None}
        )
        return out

    def _core_dict(self) -> dict[str, Any]:
        return {
            "vramledger_version": self.version,
            "target": self.target,
            "allocator": self.allocator,
            "peak_bytes": self.peak_bytes,
            "allocated_peak_bytes": self.allocated_peak_bytes,
            "reserved_peak_bytes": self.reserved_peak_bytes,
            "first_step_peak_bytes": self.first_step_peak_bytes,
            "first_step_allocated_peak_bytes": self.first_step_allocated_peak_bytes,
            "peak_phase": self.peak_phase.value,
            "first_step_peak_phase": self.first_step_peak_phase.value,
            "at_peak": {c.value: b for c, b in self.at_peak.items()},
            "allocated_at_peak": {c.value: b for c, b in self.allocated_at_peak.items()},
            "first_step_at_peak": {c.value: b for c, b in self.first_step_at_peak.items()},
            "phases": {p.value: b for p, b in self.phases.items()},
            "allocated_phases": {p.value: b for p, b in self.allocated_phases.items()},
            "step_start_bytes": self.step_start_bytes,
            "host_bytes": self.host_bytes,
            "model_state_bytes": self.model_state_bytes,
            "parameters": self.parameters,
            "trainable_parameters": self.trainable_parameters,
            "stage_parameters": self.stage_parameters,
            "optimizer_state_bytes": self.optimizer_state_bytes,
            "optimizer_state_bytes_per_param": round(self.optimizer_state_bytes_per_param, 4),
            "optimizer_state_method": self.optimizer_state_method,
            "top_modules": [{"module": m, "activation_bytes": b} for m, b in self.top_modules],
            "peak_modules": [m.to_dict() for m in top_modules(self.peak_modules, TOP_MODULES)],
            "spec": self.spec,
            "notes": self.notes,
            "note_records": records(self.notes),
            "seconds": round(self.seconds, 3),
            "moe_routing_peaks": dict(self.moe_routing_peaks),
            "warnings": list(self.warnings),
        }


def worst_rank_ledger(
    ranks: list[tuple[list[int], Ledger]], *, world_size: int, strategy: str
) -> Ledger:
    """The ledger of the rank with the highest allocated peak, carrying every distinct rank's
    (``ranks``: the ranks that share a ledger, and it): the one rule by which ``estimate`` and a
    program run as several ranks (``predict/step.py``, ``predict/program.py``) answer for a
    world. The first of a group's ranks is the worst rank named."""
    ids, worst = max(ranks, key=lambda item: item[1].allocated_peak_bytes)
    return replace(worst, world_size=world_size, strategy=strategy, worst_rank=ids[0], ranks=ranks)


def _coords(ledger: Ledger, rank: int) -> dict[str, int]:
    """A rank's mesh coordinates; a data-parallel rank's (dp = the rank) when none were set."""
    return dict(ledger.mesh_coords) or {"dp": rank, "tp": 0, "pp": 0, "cp": 0, "ep": 0}


def build_ledger(
    timeline: Timeline,
    *,
    target: str,
    allocator: AllocatorModel,
    parameters: int,
    trainable_parameters: int,
    optimizer_state_bytes: int,
    optimizer_state_method: str = "traced",
    spec: dict[str, Any] | None = None,
    notes: list[str] | None = None,
    seconds: float = 0.0,
    version: str = "",
) -> Ledger:
    totals = EventTotals(timeline)
    raw = replay(timeline, totals=totals)
    blocks = replay(timeline, allocator, totals=totals)
    peak, first = steady_peak(raw), raw.step_peaks[1]
    alloc_peak, alloc_first = steady_peak(blocks), blocks.step_peaks[1]
    top = sorted(raw.activations_by_module.items(), key=lambda kv: -kv[1])[:TOP_MODULES]
    last_step = timeline.steps
    return Ledger(
        target=target,
        allocator=allocator.name,
        peak_bytes=peak.total,
        allocated_peak_bytes=alloc_peak.total,
        reserved_peak_bytes=steady_reserved_peak(blocks),
        first_step_peak_bytes=first.total,
        first_step_allocated_peak_bytes=alloc_first.total,
        peak_phase=peak.phase,
        first_step_peak_phase=first.phase,
        at_peak=peak.by_category,
        allocated_at_peak=alloc_peak.by_category,
        first_step_at_peak=first.by_category,
        phases=steady_phase_peaks(raw),
        allocated_phases=steady_phase_peaks(blocks),
        step_start_bytes=raw.step_start.get(last_step, 0),
        host_bytes=raw.host_peak,
        model_state_bytes=max((v for k, v in raw.model_state_peaks.items() if k >= 2), default=0),
        parameters=parameters,
        trainable_parameters=trainable_parameters,
        top_modules=top,
        peak_modules=modules_at_peak(timeline, peak.event, peak.total),
        optimizer_state_bytes=optimizer_state_bytes,
        optimizer_state_method=optimizer_state_method,
        spec=spec or {},
        notes=notes or [],
        seconds=seconds,
        version=version,
        timeline=timeline,
    )
