"""Parallel strategies: what each keeps on a rank, and which engine the trace runs for it.

=============  ===================================  ===========================================
strategy       memory on each rank                  how it is traced
=============  ===================================  ===========================================
``ddp``        everything, plus gradient buckets    the single-process step, plus DDP's buckets
                                                    from its own bucket assignment (the reducer
                                                    cannot run on fake tensors)
``zero1``      full parameters and gradients;       DeepSpeed's own engine (``DeepSpeedEngine``,
               fp32 master weights and optimizer    ``DeepSpeedZeroOptimizer`` stage 1) on a fake
               state of its even 1/N partition of   process group (``deepspeed_engine.py``):
               the flat parameters; a reduce        its flat even partition, its buckets, its
               bucket                               step
``zero2``      full parameters; gradients of the    the same, stage 2
               parameters overlapping its
               partition, fp32 master weights and
               optimizer state of its partition; a
               reduce bucket
``zero3``      each parameter's even 1/N slice     the same, stage 3 (``DeepSpeedZeroOptimizer_
               (padded), its gradients' slices,     Stage3``): its own partitioning, its module
               fp32 master weights and optimizer    hooks that gather and release each module's
               state of the slices; each module's   parameters, its prefetch and bucket limits
               parameters gathered for its compute; (``deepspeed_zero3.py``)
               a reduce bucket
``fsdp``       parameters, gradients and optimizer  FSDP2 ``fully_shard`` on a fake process group
               state sharded; layers' parameters
               gathered for their compute
``zero1-       full parameters and gradients;       DDP as above, the optimizer (and fp32 master
torch``        optimizer state (and fp32 master     weights) over this rank's whole parameters
               weights) of whole parameters         from ``ZeroRedundancyOptimizer``'s own
               (largest first, to the rank with     partitioning: uneven when one parameter (an
               the fewest elements)                 embedding) is large
=============  ===================================  ===========================================

Offload (DeepSpeed ZeRO-Offload / FSDP2 CPU offload): ``optimizer`` keeps optimizer state, fp32
master weights and their gradients in host memory (the step runs on the CPU, so its temporaries
are host memory too); ``params`` keeps
sharded parameters there; ``both`` does both. It is applied to the traced timeline by category
(the copies' staging buffers are not modelled).

Under ``zero3`` offload is applied by category as for ZeRO-1/2 (DeepSpeed's own offload path
needs its CPU Adam extension and pinned memory, which a fake trace cannot run): ``optimizer``
moves the fp32 partition, the optimizer state and the gradient slices to the host, ``params``
the bf16 parameter slices.

Under FSDP (``fsdp``) with master-weight precision (``bf16-master``) the traced fp32 shards are
the master weights (FSDP2's MixedPrecisionPolicy). ``optimizer`` offload is then DeepSpeed's ZeRO-3
``offload_optimizer`` layout (FSDP2 has no optimizer-only offload): the fp32 shards in host
memory with the optimizer state, and a half-precision copy of each shard on the GPU
(DeepSpeed's ``fp16_partitioned_groups``). ``both`` is FSDP2's CPUOffloadPolicy: the fp32
shards in host memory, nothing persistent on the GPU.
"""

from __future__ import annotations

from collections import defaultdict

from vramledger.inputs.categories import Category, Phase
from vramledger.inputs.parallelism import Parallelism
from vramledger.inputs.precision import PrecisionPolicy
from vramledger.record.timeline import Timeline

FP32_ITEMSIZE = 4

OFFLOADED: dict[str, frozenset[Category]] = {
    "none": frozenset(),
    "optimizer": frozenset(
        {Category.OPTIMIZER_STATE, Category.MASTER_WEIGHTS, Category.SHARDED_GRADIENTS}
    ),
    "params": frozenset({Category.SHARDED_PARAMETERS}),
    "both": frozenset(
        {
            Category.OPTIMIZER_STATE,
            Category.MASTER_WEIGHTS,
            Category.SHARDED_GRADIENTS,
            Category.SHARDED_PARAMETERS,
        }
    ),
}
"""Categories an offload setting keeps in host memory."""

STEP_ON_HOST = frozenset({"optimizer", "both"})
"""Offload settings under which the optimizer step runs on the CPU (DeepSpeed's CPU Adam, FSDP2's
CPUOffloadPolicy): the step's temporaries (and fp32 copies of the gradients) are host memory."""


def master_shard_fraction(parallelism: Parallelism, precision: PrecisionPolicy) -> float | None:
    """Under FSDP2 with master-weight precision: the bytes of a half-precision copy of a
    shard per byte of its fp32 shard (``apply_offload``'s ``half_shard_fraction``); else None."""
    if not parallelism.is_fsdp or not precision.master_weights:
        return None
    return half_shard_fraction(precision.param_dtype.itemsize)


def half_shard_fraction(itemsize: int) -> float:
    """Bytes of a half-precision copy of an fp32 shard per byte of the shard."""
    return itemsize / FP32_ITEMSIZE


def apply_offload(
    timeline: Timeline, offload: str, *, half_shard_fraction: float | None = None
) -> dict[int, int]:
    """Mark what ``offload`` keeps in host memory. Returns the half-precision copies it added
    (copy's sid -> its shard's sid), each of ``half_shard_fraction`` of its shard's bytes.

    ``half_shard_fraction``: the traced sharded parameters are fp32 master weights (FSDP2 with
    master-weight precision); ``optimizer`` offload moves them to the host and keeps a
    half-precision copy of that fraction of their bytes (2/4 for bf16) on the GPU."""
    copies: dict[int, int] = {}
    if half_shard_fraction is not None and offload == "optimizer":
        copies = _master_shards_to_host(timeline, half_shard_fraction)
    offloaded = OFFLOADED[offload]
    step_on_host = offload in STEP_ON_HOST
    if not offloaded and not step_on_host:
        return copies
    for sid in range(timeline.num_storages):
        category = timeline.category(sid)
        if category in offloaded or (
            step_on_host
            and category is Category.TEMPORARIES
            and timeline.origin[sid][1] is Phase.OPTIMIZER
        ):
            timeline.on_host[sid] = True
    return copies


def _master_shards_to_host(timeline: Timeline, fraction: float) -> dict[int, int]:
    """Re-tag the fp32 shards as master weights in host memory, each with a half-precision copy
    on the GPU for as long as it lives; returns the copies (copy's sid -> its shard's sid)."""
    shards = [
        sid
        for sid in range(timeline.num_storages)
        if timeline.category(sid) is Category.SHARDED_PARAMETERS
    ]
    if not shards:
        return {}
    lifetimes = timeline.lifetimes(set(shards))
    insertions: dict[int, list[int]] = defaultdict(list)
    copies: dict[int, int] = {}
    for sid in shards:
        copy = timeline.add_storage(
            round(timeline.nbytes[sid] * fraction), Category.SHARDED_PARAMETERS, like=sid
        )
        copies[copy] = sid
        timeline.tags[sid] = Category.MASTER_WEIGHTS
        timeline.on_host[sid] = True
        allocated, freed = lifetimes[sid]
        insertions[allocated + 1].append(copy)
        if freed is not None:
            insertions[freed + 1].append(~copy)
    timeline.insert_events(insertions)
    return copies
