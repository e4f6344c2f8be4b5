"""Per-rank timelines derived from one single-GPU trace, for the planner's search.

A planner compares hundreds of configurations; tracing each is too slow for a 70B model. Each
(model, precision, checkpointing, micro-batch, optimizer) is traced once on one GPU, and the
strategies are applied to that timeline by category — the ledger of the result is replayed as
usual:

- ``ddp``: plus DDP's gradient buckets (one copy of the gradients, from setup on);
- ``zero1``: master weights, optimizer state and the optimizer step's temporaries (the fp32
  gradients of a master-weight step among them) divided over the ranks (the mean rank: ZeroRedundancyOptimizer's whole-parameter partition is uneven); plus
  DDP's buckets;
- ``zero2``: as ``zero1``, gradients divided too, plus DeepSpeed's reduce bucket;
- ``zero3``/``fsdp``: FSDP2's layout — parameters, gradients and optimizer state divided;
  under master-weight precision the fp32 master weights are the shards, the gradients are
  reduce-scattered in fp32 into them (no fp32 gradient copies in the step) and the
  half-precision parameters exist only gathered; plus the working set FSDP gathers during the
  forward and backward passes: the root unit's parameters (embeddings, head: not resharded
  between the passes), two blocks' parameters (the one computing and the one prefetched) and
  one block's fp32 gradients being reduce-scattered;
- offload: the offloaded categories in host memory (``apply_offload``, as ``estimate`` does).

This is an approximation of what ``estimate`` traces with the real engines (it ignores shard
padding, the uneven ZeRO-1/2 partition and when exactly FSDP gathers and frees); the planner
re-estimates the configurations it answers with, with the real engines.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..categories import Category, Phase
from ..parallel.engines import DEEPSPEED_REDUCE_BUCKET_ELEMENTS
from ..parallel.strategy import FP32_ITEMSIZE, apply_offload, half_shard_fraction
from ..timeline import Timeline
from ..training import MASTER_GRADIENT


@dataclass(frozen=True, kw_only=True)
class ModelFacts:
    """What the derivation needs to know about the traced model."""

    parameter_bytes: int
    """Trainable parameters, in the dtype the model runs in (= one copy of its gradients)."""
    parameter_itemsize: int
    trainable_parameters: int
    block_parameters: int
    """Elements of the largest unit FSDP gathers at once (a block, or the whole model)."""
    root_parameters: int = 0
    """Elements outside the blocks (embeddings, head): the root unit, which FSDP gathers once
    for the forward pass and keeps gathered through the backward pass."""


def derive(
    tl: Timeline, facts: ModelFacts, strategy: str, world_size: int, offload: str
) -> Timeline:
    n = world_size
    out = Timeline(
        nbytes=list(tl.nbytes),
        tags=list(tl.tags),
        on_host=list(tl.on_host),
        module=list(tl.module),
        op=list(tl.op),
        origin=list(tl.origin),
        labels=dict(tl.labels),
        events=list(tl.events),
        marks=list(tl.marks),
        block=list(tl.block),
        event_block=list(tl.event_block),
    )

    def shard(categories: set[Category], rename: dict[Category, Category]) -> None:
        """Divide ``categories`` over the ranks, and the optimizer step's temporaries (the fp32
        gradients of a master-weight step among them): each rank steps its own part."""
        for sid in range(out.num_storages):
            category = out.category(sid)
            step_temporary = (
                category is Category.TEMPORARIES and out.origin[sid][1] is Phase.OPTIMIZER
            )
            if category in categories or step_temporary:
                out.nbytes[sid] = -(-out.nbytes[sid] // n)
                if category in rename:
                    out.tags[sid] = rename[category]

    extra: list[tuple[int, Category]] = []
    copy_fraction = None
    if strategy in ("ddp", "zero1"):
        extra.append((facts.parameter_bytes, Category.GRADIENT_BUCKETS))
    if strategy in ("zero1", "zero2"):
        grads = {Category.GRADIENTS} if strategy == "zero2" else set()
        shard({Category.MASTER_WEIGHTS, Category.OPTIMIZER_STATE} | grads, {})
    if strategy == "zero2":
        bucket = min(DEEPSPEED_REDUCE_BUCKET_ELEMENTS, facts.trainable_parameters)
        extra.append((bucket * facts.parameter_itemsize, Category.GRADIENT_BUCKETS))
    if strategy in ("zero3", "fsdp"):
        if Category.MASTER_WEIGHTS in out.tags:
            _fsdp_master_layout(out, facts)
            copy_fraction = half_shard_fraction(facts.parameter_itemsize)
        shard(
            {
                Category.PARAMETERS,
                Category.GRADIENTS,
                Category.MASTER_WEIGHTS,
                Category.OPTIMIZER_STATE,
            },
            {
                Category.PARAMETERS: Category.SHARDED_PARAMETERS,
                Category.MASTER_WEIGHTS: Category.SHARDED_PARAMETERS,
                Category.GRADIENTS: Category.SHARDED_GRADIENTS,
            },
        )
        gathered = (2 * facts.block_parameters + facts.root_parameters) * facts.parameter_itemsize
        _add_during_passes(
            out,
            [
                (gathered, Category.ALL_GATHER_BUFFERS),
                (facts.block_parameters * FP32_ITEMSIZE, Category.REDUCE_SCATTER_BUFFERS),
            ],
        )
    if extra:
        _add_at_setup_end(out, extra)
    apply_offload(out, offload, half_shard_fraction=copy_fraction)
    return out


def _fsdp_master_layout(tl: Timeline, facts: ModelFacts) -> None:
    """FSDP2 under master-weight precision, before sharding: the fp32 master weights are the
    parameters (the half-precision ones exist only gathered), gradients are fp32, and the step
    makes no fp32 copies of them."""
    widen = FP32_ITEMSIZE // facts.parameter_itemsize
    for sid in range(tl.num_storages):
        category = tl.category(sid)
        if category is Category.PARAMETERS:
            tl.nbytes[sid] = 0
        elif category is Category.GRADIENTS:
            tl.nbytes[sid] *= widen
        elif tl.labels.get(sid) == MASTER_GRADIENT:
            tl.nbytes[sid] = 0


def _add_during_passes(tl: Timeline, storages: list[tuple[int, Category]]) -> None:
    """Allocate storages when each step's first forward pass begins and free them when its
    optimizer step begins (``zero_grad`` opens a step in the optimizer phase)."""
    begins: dict[int, int] = {}
    steps: dict[int, int] = {}
    for index, step, phase in tl.marks:
        if step >= 1 and phase is Phase.FORWARD:
            begins.setdefault(step, index)
        elif step in begins and phase is Phase.OPTIMIZER:
            steps.setdefault(step, index)
    insertions: dict[int, list[int]] = {}
    for step, first in begins.items():
        sids = [tl.add_storage(nbytes, category) for nbytes, category in storages]
        for sid in sids:
            tl.origin[sid] = (step, Phase.FORWARD)
        insertions.setdefault(first, []).extend(sids)
        end = steps.get(step, len(tl.events))
        insertions.setdefault(end, []).extend(~sid for sid in sids)
    tl.insert_events(insertions)


def _add_at_setup_end(tl: Timeline, storages: list[tuple[int, Category]]) -> None:
    """Allocate persistent storages just before step 1 begins."""
    first = next((index for index, step, _ in tl.marks if step >= 1), len(tl.events))
    tl.insert_events({first: [tl.add_storage(nbytes, category) for nbytes, category in storages]})
