"""``estimate``: the peak memory of a training step, predicted by tracing it on fake tensors.

On several ranks, each distinct rank is traced once (ranks are symmetric under DDP and FSDP;
ZeRO-1's partitions differ) and the worst rank's ledger is returned with all of them in ``ranks``.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from .checks import request_warnings
from .ledger import Ledger, build_ledger
from .parallel.deepspeed import apply_deepspeed
from .parallel.engines import DataParallel, zero1_partition
from .recipe import resolve
from .spec import TrainingSpec
from .trace.cuda_policy import CudaPolicy
from .trace.fake import trace
from .trace.policy import CpuPolicy, DevicePolicy
from .trace.values import CONCRETE_ROUTINGS
from .units import format_bytes
from .version import __version__


def policy_for(target: str) -> DevicePolicy:
    return CudaPolicy() if target == "cuda" else CpuPolicy()


def as_spec(spec: TrainingSpec | None, fields: dict[str, Any]) -> TrainingSpec:
    if spec is None:
        return TrainingSpec(**fields)
    if fields:
        return replace(spec, **fields)
    return spec


def estimate(spec: TrainingSpec | None = None, /, **fields: Any) -> Ledger:
    """Predict the peak memory of ``spec``'s training step on its target device.

    ``estimate(TrainingSpec(model="config.json", ...))`` or ``estimate(model=..., ...)``. With
    ``world_size`` > 1 the ledger is the worst rank's, and ``ledger.ranks`` holds every distinct
    rank's.
    """
    spec, notes = apply_deepspeed(as_spec(spec, fields))
    warnings = request_warnings(resolve(spec))
    groups = rank_groups(spec)
    ledgers = [(ranks, _estimate_rank(spec, ranks[0], notes)) for ranks in groups]
    ranks, worst = max(ledgers, key=lambda item: item[1].allocated_peak_bytes)
    return replace(
        worst,
        world_size=spec.world_size,
        strategy=spec.strategy or "none",
        worst_rank=ranks[0],
        ranks=ledgers,
        warnings=warnings,
    )


def rank_groups(spec: TrainingSpec) -> list[list[int]]:
    """Ranks that share one ledger. Only ZeRO-1/2's partitions make ranks differ."""
    everyone = list(range(spec.world_size))
    if spec.strategy not in ("zero1", "zero2"):
        return [everyone]
    model = resolve(spec).build_model("meta")
    params = [p for p in model.parameters() if p.requires_grad]
    partition = zero1_partition(params, spec.world_size)
    groups: dict[tuple[tuple[int, ...], ...], list[int]] = {}
    for rank, owned in enumerate(partition):
        signature = tuple(sorted(tuple(params[i].shape) for i in owned))
        groups.setdefault(signature, []).append(rank)
    return list(groups.values())


def _estimate_rank(spec: TrainingSpec, rank: int, notes: list[str]) -> Ledger:
    """One rank's ledger. When the memory depends on how an MoE router routes (a value-dependent
    operator read the routing), every routing is traced and the answer is the asked one's —
    the largest for ``worst`` — with each routing's peak in ``moe_routing_peaks``."""
    first = spec.moe_routing if spec.moe_routing in CONCRETE_ROUTINGS else "balanced"
    ledger, dependent = _trace_ledger(spec, rank, notes, first)
    if not dependent:
        return ledger
    ledgers = {first: ledger}
    for routing in CONCRETE_ROUTINGS:
        if routing not in ledgers:
            ledgers[routing] = _trace_ledger(spec, rank, notes, routing)[0]
    peaks = {r: ledgers[r].allocated_peak_bytes for r in CONCRETE_ROUTINGS}
    chosen = max(peaks, key=peaks.get) if spec.moe_routing == "worst" else first
    band = ", ".join(f"{r} {format_bytes(b)}" for r, b in peaks.items())
    note = (
        f"the peak depends on MoE routing ({', '.join(sorted(dependent))} read the experts' "
        f"token counts): {band}; answered for {chosen}"
        + (" (the largest: --moe-routing worst)" if spec.moe_routing == "worst" else "")
    )
    answer = ledgers[chosen]
    return replace(answer, notes=[*answer.notes, note], moe_routing_peaks=peaks)


def _trace_ledger(
    spec: TrainingSpec, rank: int, notes: list[str], routing: str
) -> tuple[Ledger, dict[str, str]]:
    policy = policy_for(spec.target)
    # Under ZeRO-1/2 a rank owns different parameters in each block: not identical blocks.
    result = trace(
        spec,
        policy,
        rank=rank,
        extend_blocks=spec.strategy not in ("zero1", "zero2"),
        routing=routing,
        engine=DataParallel(spec),
    )
    ledger = build_ledger(
        result.timeline,
        target=spec.target,
        allocator=policy.allocator,
        parameters=result.parameters,
        trainable_parameters=result.trainable_parameters,
        optimizer_state_bytes=result.optimizer_state_bytes,
        optimizer_state_method=result.optimizer_state_method,
        spec=spec.summary(),
        notes=notes + result.notes,
        seconds=result.seconds,
        version=__version__,
    )
    return ledger, result.routing_dependent
