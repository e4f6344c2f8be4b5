"""Parallel strategies: what each keeps on a rank, and which engine the trace runs for it.

============  =====================================  =============================================
strategy      memory on each rank                    how it is traced
============  =====================================  =============================================
``ddp``       everything, plus gradient buckets      the single-process step, plus DDP's buckets
                                                     from its own bucket assignment (the reducer
                                                     cannot run on fake tensors)
``zero1``     full parameters and gradients;         DDP as above, the optimizer (and fp32 master
              optimizer state (and fp32 master       weights) over this rank's partition from
              weights) of its partition              ZeroRedundancyOptimizer's own partitioning
``zero2``     full parameters; gradients, optimizer   DeepSpeed's ZeRO-2 layout (its engine cannot
              state and fp32 master weights of its    run here): the single-process step, the
              partition                               gradients of other ranks' parameters freed
                                                      as made, a reduce bucket
``zero3``,    parameters, gradients and optimizer    FSDP2 ``fully_shard`` on a fake process group
``fsdp``      state sharded; layers' parameters
              gathered for their compute
============  =====================================  =============================================

Offload (DeepSpeed ZeRO-Offload / FSDP2 CPU offload): ``optimizer`` keeps optimizer state, fp32
master weights and their gradients in host memory (the step runs on the CPU, so its temporaries
are host memory too); ``params`` keeps
sharded parameters there; ``both`` does both. It is applied to the traced timeline by category
(the copies' staging buffers are not modelled).
"""

from __future__ import annotations

from typing import Literal

from ..categories import Category, Phase
from ..timeline import Timeline

Strategy = Literal["none", "ddp", "zero1", "zero2", "zero3", "fsdp"]
STRATEGIES: tuple[str, ...] = ("none", "ddp", "zero1", "zero2", "zero3", "fsdp")
Offload = Literal["none", "optimizer", "params", "both"]
OFFLOADS: tuple[str, ...] = ("none", "optimizer", "params", "both")

FSDP_STRATEGIES = frozenset({"zero3", "fsdp"})
DDP_STRATEGIES = frozenset({"ddp", "zero1", "zero2"})

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


def apply_offload(timeline: Timeline, offload: str) -> None:
    """Mark what ``offload`` keeps in host memory."""
    offloaded = OFFLOADED[offload]
    step_on_host = offload in STEP_ON_HOST
    for sid in range(timeline.num_storages):
        category = timeline.category(sid)
        if category in offloaded or (
            step_on_host
            and category is Category.TEMPORARIES
            and timeline.origin[sid][1] is Phase.OPTIMIZER
        ):
            timeline.on_host[sid] = True
