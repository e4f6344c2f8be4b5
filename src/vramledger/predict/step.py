"""``estimate``: the peak memory of a training step, predicted by tracing it on fake tensors.

On several ranks, each distinct rank is traced once (ranks are symmetric under DDP, FSDP and
DeepSpeed's ZeRO-3; ZeRO-1/2's partitions differ) and the worst rank's ledger is returned with
all of them in ``ranks``.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from vramledger.inputs.checks import request_warnings
from vramledger.inputs.gpus import precision_warnings
from vramledger.inputs.launch_configs import apply_configs
from vramledger.inputs.notes import Note, Topic
from vramledger.inputs.recipe import resolve
from vramledger.inputs.spec import TrainingSpec
from vramledger.inputs.units import format_bytes
from vramledger.inputs.verdict import verdict
from vramledger.inputs.version import __version__
from vramledger.ledger.ledger import Ledger, build_ledger, worst_rank_ledger
from vramledger.parallel.deepspeed_engine import DeepSpeedZero, deepspeed_config
from vramledger.parallel.deepspeed_layout import REDUCE_BUCKET_ELEMENTS
from vramledger.parallel.deepspeed_layout import rank_groups as deepspeed_rank_groups
from vramledger.parallel.engines import DataParallel, zero1_partition
from vramledger.parallel.mesh import MeshParallel, mesh_coords, mesh_rank_groups, uses_mesh
from vramledger.parallel.pipeline import (
    PipelineParallel,
    pipeline_rank_groups,
    whole_model_parameters,
)
from vramledger.trace.core.cpu_scratch import ScratchCache
from vramledger.trace.core.fake import trace
from vramledger.trace.core.values import CONCRETE_ROUTINGS
from vramledger.trace.emulation.target_policy import policy_for

__all__ = ["as_spec", "estimate", "policy_for", "rank_groups", "rank_ledger"]


def as_spec(spec: TrainingSpec | None, fields: dict[str, Any]) -> TrainingSpec:
    if spec is None:
        return TrainingSpec(**fields)
    if fields:
        return replace(spec, **fields)
    return spec


def estimate(
    spec: TrainingSpec | None = None, /, *, blocks_verified: bool = False, **fields: Any
) -> Ledger:
    """Predict the peak memory of ``spec``'s training step on its target device.

    ``estimate(TrainingSpec(model="config.json", ...))`` or ``estimate(model=..., ...)``. With
    ``world_size`` > 1 the ledger is the worst rank's, and ``ledger.ranks`` holds every distinct
    rank's. ``blocks_verified``: the block extension was verified exact on this run at another
    data-parallel or tensor-parallel degree, offload setting, micro-batch or sequence length
    (``trace/core/fake.py``; the planner's re-estimates, fit's sizes): the values are the same, the
    check's smaller trace is not made again.
    """
    spec, notes = apply_configs(as_spec(spec, fields))
    warnings = request_warnings(resolve(spec))
    gpu = spec.gpu_kind()
    if gpu is not None:
        warnings += precision_warnings(gpu, spec.precision)
    groups = rank_groups(spec)
    scratch = ScratchCache()  # CPU kernels probed once for all the ranks traced here
    ledgers = [
        (
            r,
            replace(
                _estimate_rank(spec, r[0], notes, blocks_verified, scratch),
                mesh_coords=mesh_coords(r[0], spec),
            ),
        )
        for r in groups
    ]
    worst = worst_rank_ledger(ledgers, world_size=spec.world_size, strategy=spec.strategy or "none")
    return replace(
        worst,
        warnings=warnings,
        verdict=verdict(gpu, worst.reserved_peak_bytes, spec.margin_bytes) if gpu else None,
    )


def rank_ledger(spec: TrainingSpec | None = None, /, *, rank: int, **fields: Any) -> Ledger:
    """Rank ``rank``'s own ledger, traced as itself. ``estimate`` traces the first rank of each
    group of :func:`rank_groups` and gives the others its ledger, a bound from above under
    ZeRO-1/2 (``deepspeed_layout.rank_groups``); this is the rank's exact one."""
    spec, notes = apply_configs(as_spec(spec, fields))
    if not 0 <= rank < spec.world_size:
        raise ValueError(f"rank {rank} is not one of the {spec.world_size} ranks")
    return replace(_estimate_rank(spec, rank, notes), mesh_coords=mesh_coords(rank, spec))


def rank_groups(spec: TrainingSpec) -> list[list[int]]:
    """Ranks that share one ledger. Only ZeRO-1/2's partitions make ranks differ: DeepSpeed's
    (``zero1``, ``zero2``) by the sizes its partitioning gives each rank (its own code on meta
    tensors, ``deepspeed_layout.py``), ZeroRedundancyOptimizer's (``zero1-torch``) by the
    parameters each rank owns. The first rank of each group is the one traced."""
    everyone = list(range(spec.world_size))
    if spec.pp > 1:
        return pipeline_rank_groups(spec)
    if uses_mesh(spec):
        return mesh_rank_groups(spec)
    if not spec.parallelism.partitions_optimizer:
        return [everyone]
    model = resolve(spec).build_model("meta")
    params = [p for p in model.parameters() if p.requires_grad]
    if spec.parallelism.is_deepspeed:
        zero = deepspeed_config(spec)["zero_optimization"]
        return deepspeed_rank_groups(
            [p.numel() for p in params],
            spec.world_size,
            stage=zero["stage"],
            reduce_bucket_size=int(zero.get("reduce_bucket_size", REDUCE_BUCKET_ELEMENTS)),
            round_robin=bool(zero.get("round_robin_gradients", False)),
        )
    partition = zero1_partition(params, spec.world_size)
    groups: dict[tuple[tuple[int, ...], ...], list[int]] = {}
    for rank, owned in enumerate(partition):
        signature = tuple(sorted(tuple(params[i].shape) for i in owned))
        groups.setdefault(signature, []).append(rank)
    return list(groups.values())


def _engine(spec: TrainingSpec, rank: int = 0) -> Any:
    """The pipeline engine (rank ``rank``'s stages) when the layers are split into stages; the
    N-D mesh's engine when the model is split (tensor, context, expert parallel);
    DeepSpeed's engine for zero0..zero3; torch.distributed's for the others."""
    if spec.pp > 1:
        return PipelineParallel(spec, rank)
    if uses_mesh(spec):
        return MeshParallel(spec)
    return DeepSpeedZero(spec) if spec.parallelism.is_deepspeed else DataParallel(spec)


def _estimate_rank(
    spec: TrainingSpec,
    rank: int,
    notes: list[str],
    blocks_verified: bool = False,
    scratch: ScratchCache | None = None,
) -> Ledger:
    """One rank's ledger. When the memory depends on how an MoE router routes (a value-dependent
    operator read the routing), every routing is traced and the answer is the asked one's —
    the largest for ``worst`` — with each routing's peak in ``moe_routing_peaks``."""
    first = spec.moe_routing if spec.moe_routing in CONCRETE_ROUTINGS else "balanced"
    ledger, dependent = _trace_ledger(spec, rank, notes, first, blocks_verified, scratch)
    if not dependent:
        return ledger
    ledgers = {first: ledger}
    for routing in CONCRETE_ROUTINGS:
        if routing not in ledgers:
            traced, _ = _trace_ledger(spec, rank, notes, routing, blocks_verified, scratch)
            ledgers[routing] = traced
    peaks = {r: ledgers[r].allocated_peak_bytes for r in CONCRETE_ROUTINGS}
    chosen = max(peaks, key=peaks.get) if spec.moe_routing == "worst" else first
    band = ", ".join(f"{r} {format_bytes(b)}" for r, b in peaks.items())
    note = Note(
        Topic.VALUES,
        f"the peak depends on MoE routing ({', '.join(sorted(dependent))} read the experts' "
        f"token counts): {band}; answered for {chosen}"
        + (" (the largest: --moe-routing worst)" if spec.moe_routing == "worst" else ""),
    )
    answer = ledgers[chosen]
    return replace(answer, notes=[*answer.notes, note], moe_routing_peaks=peaks)


def _trace_ledger(
    spec: TrainingSpec,
    rank: int,
    notes: list[str],
    routing: str,
    blocks_verified: bool = False,
    scratch: ScratchCache | None = None,
) -> tuple[Ledger, dict[str, str]]:
    policy = policy_for(spec, scratch)
    result = trace(
        spec,
        policy,
        rank=rank,
        extend_blocks=spec.parallelism.extends_blocks,
        routing=routing,
        engine=_engine(spec, rank),
        blocks_verified=blocks_verified,
    )
    parameters, trainable = result.parameters, result.trainable_parameters
    if spec.pp > 1:  # the trace ran this rank's stage(s); the ledger counts the whole model
        parameters, trainable = whole_model_parameters(resolve(spec))
    ledger = build_ledger(
        result.timeline,
        target=spec.target,
        allocator=policy.allocator,
        parameters=parameters,
        trainable_parameters=trainable,
        optimizer_state_bytes=result.optimizer_state_bytes,
        optimizer_state_method=result.optimizer_state_method,
        spec=spec.summary(),
        notes=notes + result.notes,
        seconds=result.seconds,
        version=__version__,
    )
    stage = result.parameters if spec.pp > 1 else None
    return (
        replace(ledger, blocks_extended=result.extended, stage_parameters=stage),
        result.routing_dependent,
    )
