"""Per-rank timelines derived from one single-GPU trace, for the planner's search.

A planner compares hundreds of configurations; tracing each is too slow for a 70B model. Each
(model, precision, checkpointing, micro-batch, optimizer) is traced once on one GPU, and the
strategies are applied to that timeline by category — the ledger of the result is replayed as
usual:

- ``ddp``: plus DDP's gradient buckets (one copy of the gradients, from setup on);
- ``zero1``, ``zero2``: DeepSpeed's layout (``_deepspeed_layout``) for the rank that keeps the
  most gradients: the flat parameters padded to a multiple of 2N elements, fp32 master weights
  and optimizer state of the even partition ``p`` (the step's temporaries scaled to it), the
  reduce bucket (``reduce_bucket_size`` elements) from the first gradient to the end of
  backward, and the gradients the rank keeps (every parameter overlapping its partition,
  ``G_r`` elements) from their reduction to the step; ZeRO-1 keeps autograd's full gradients
  to the end of backward, ZeRO-2 frees each as DeepSpeed copies it into its bucket;
- ``zero1-torch``: master weights, optimizer state and the optimizer step's temporaries (the
  fp32 gradients of a master-weight step among them) divided over the ranks (the mean rank:
  ZeroRedundancyOptimizer's whole-parameter partition is uneven); plus DDP's buckets;
- ``fsdp``: FSDP2's layout — parameters, gradients and optimizer state divided;
  under master-weight precision the fp32 master weights are the shards, the gradients are
  reduce-scattered in fp32 into them (no fp32 gradient copies in the step) and the
  half-precision parameters exist only gathered; plus the working set FSDP gathers during the
  forward and backward passes: the root unit's parameters (embeddings, head: not resharded
  between the passes), two blocks' parameters (the one computing and the one prefetched) and
  one block's fp32 gradients being reduce-scattered;
- offload: the offloaded categories in host memory (``apply_offload``, as ``estimate`` does).

DeepSpeed's ZeRO-3 (``zero3``) is not derived: the planner searches FSDP2 for sharded
parameters (``candidates.PLANNED_STRATEGIES``), and ``estimate`` traces ZeRO-3 itself.

This is an approximation of what ``estimate`` traces with the real engines (it ignores FSDP's
shard padding and when exactly FSDP gathers and frees; under ZeRO-1/2 DeepSpeed's fused Adam on
a GPU makes no step temporaries where the traced step's are scaled, and its reductions and norms
make transients modelled only in size); the planner re-estimates the configurations it answers
with, with the real engines.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from vramledger.inputs.categories import Category, Phase
from vramledger.inputs.parallelism import Parallelism
from vramledger.inputs.training import MASTER_GRADIENT
from vramledger.parallel.deepspeed_layout import (
    REDUCE_BUCKET_ELEMENTS,
    RankPartition,
    even_partitions,
    reduction_buckets,
    reduction_order,
)
from vramledger.parallel.strategy import FP32_ITEMSIZE, apply_offload, half_shard_fraction
from vramledger.record.timeline import Timeline


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
    parameter_numels: tuple[int, ...] = ()
    """Elements of each trainable parameter, in definition order (DeepSpeed's partition);
    empty: read from the timeline's parameters in the order they were registered."""


@dataclass(frozen=True)
class DerivedLayout:
    """A strategy applied to a traced timeline, at any rank count where it does not change the
    events (``Parallelism.rank_independent``: the derived events, categories and host placement
    are the same at every rank count, only the sizes of what is divided over the ranks change;
    not DeepSpeed's ZeRO-1/2, whose partition cuts the flat buffer at other parameters): the
    planner asks for a dozen counts of each."""

    timeline: Timeline
    """The derived timeline with the divided storages whole."""
    divided: list[int]
    """Storages divided over the ranks: ``ceil(nbytes / n)`` each."""
    copies: dict[int, int]
    """Half-precision copies (sid -> its shard's sid) that optimizer offload keeps on the GPU:
    ``copy_fraction`` of the divided shard's bytes."""
    copy_fraction: float | None

    def at(self, world_size: int) -> Timeline:
        """The timeline on ``world_size`` ranks (shares every list but the sizes)."""
        nbytes = list(self.timeline.nbytes)
        for sid in self.divided:
            nbytes[sid] = -(-nbytes[sid] // world_size)
        if self.copy_fraction is not None:
            for copy, shard in self.copies.items():
                nbytes[copy] = round(nbytes[shard] * self.copy_fraction)
        return replace(self.timeline, nbytes=nbytes)


def derive(
    tl: Timeline, facts: ModelFacts, strategy: str, world_size: int, offload: str
) -> Timeline:
    return derive_layout(tl, facts, strategy, offload, world_size).at(world_size)


def derive_layout(
    tl: Timeline, facts: ModelFacts, strategy: str, offload: str, world_size: int | None = None
) -> DerivedLayout:
    """``strategy`` and ``offload`` applied to the single-GPU trace ``tl``; ``world_size`` is
    needed (and the layout valid only there) for DeepSpeed's ZeRO-1/2."""
    n = world_size
    parallelism = Parallelism(strategy=strategy)
    if parallelism.is_deepspeed_zero3:
        raise ValueError("DeepSpeed ZeRO-3's layout is not derived: estimate it, or derive fsdp")
    if not parallelism.rank_independent and n is None:
        raise ValueError(f"{strategy}'s layout depends on the rank count: give world_size")
    out = tl.copy()
    divided: list[int] = []

    def shard(categories: set[Category], rename: dict[Category, Category]) -> None:
        """Divide ``categories`` over the ranks, and the optimizer step's temporaries (the fp32
        gradients of a master-weight step among them): each rank steps its own part."""
        tags, origin = out.tags, out.origin
        temporary, optimizer = Category.TEMPORARIES, Phase.OPTIMIZER
        for sid, tag in enumerate(tags):
            category = tag or temporary  # Timeline.category, inlined (hundreds of thousands)
            if category in categories or (category is temporary and origin[sid][1] is optimizer):
                divided.append(sid)
                if category in rename:
                    tags[sid] = rename[category]

    extra: list[tuple[int, Category]] = []
    copy_fraction = None
    if parallelism.is_ddp:
        extra.append((facts.parameter_bytes, Category.GRADIENT_BUCKETS))
    if parallelism.is_zero_redundancy:
        shard({Category.MASTER_WEIGHTS, Category.OPTIMIZER_STATE}, {})
    stage = parallelism.deepspeed_stage
    if stage and n is not None and n > 1:  # ZeRO's partition (zero0 keeps everything whole)
        extra += _deepspeed_layout(out, facts, stage, n)
    if parallelism.is_fsdp:
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
    copies = apply_offload(out, offload, half_shard_fraction=copy_fraction)
    return DerivedLayout(timeline=out, divided=divided, copies=copies, copy_fraction=copy_fraction)


def _fsdp_master_layout(tl: Timeline, facts: ModelFacts) -> None:
    """FSDP2 under master-weight precision, before sharding: the fp32 master weights are the
    parameters (the half-precision ones exist only gathered), gradients are fp32, and the step
    makes no fp32 copies of them."""
    widen = FP32_ITEMSIZE // facts.parameter_itemsize
    nbytes = tl.nbytes
    for sid, tag in enumerate(tl.tags):
        if tag is Category.PARAMETERS:
            nbytes[sid] = 0
        elif tag is Category.GRADIENTS:
            nbytes[sid] *= widen
    for sid, label in tl.labels.items():
        if label == MASTER_GRADIENT and tl.tags[sid] not in (
            Category.PARAMETERS,
            Category.GRADIENTS,
        ):
            nbytes[sid] = 0


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


DEEPSPEED_NORM_ITEMSIZE = torch.float64.itemsize
"""DeepSpeed's step copies each gradient piece of the partition to fp64 for its norm
(``get_grad_norm_direct``; ``get_norm_dtype()`` is double where the device has it)."""


def _deepspeed_layout(
    tl: Timeline, facts: ModelFacts, stage: int, n: int
) -> list[tuple[int, Category]]:
    """DeepSpeed ZeRO-``stage``'s layout on one rank (the one keeping the most gradients), in
    place; returns the storages to add at the end of set-up."""
    numels = list(facts.parameter_numels) or _parameter_numels(tl, facts.parameter_itemsize)
    total = sum(numels)
    if not total:
        return []
    order = reduction_order(len(numels), stage)
    buckets = reduction_buckets(numels, order, REDUCE_BUCKET_ELEMENTS)

    def first_bucket(part: RankPartition) -> int:
        return min((buckets[i] for i in part.params), default=0)

    rank = max(
        even_partitions(numels, n),
        key=lambda r: (r.grads_in_partition, r.padding, -first_bucket(r)),
    )
    size, item = rank.partition_numel, facts.parameter_itemsize
    has_masters = Category.MASTER_WEIGHTS in tl.tags
    for sid in range(tl.num_storages):
        category = tl.category(sid)
        if category is Category.MASTER_WEIGHTS:
            tl.nbytes[sid] = 0  # one fp32 partition instead, added below
        elif category is Category.OPTIMIZER_STATE or (
            category is Category.TEMPORARIES and tl.origin[sid][1] is Phase.OPTIMIZER
        ):
            tl.nbytes[sid] = -(-tl.nbytes[sid] * size // total)
    for step in range(1, tl.steps + 1):
        _deepspeed_step(tl, step, stage, rank, numels, order, item, has_masters)
    # the flat buffer's padding; the fp32 partition (a copy even when training in fp32)
    return [
        ((rank.flat_numel - total) * item, Category.PARAMETERS),
        (size * FP32_ITEMSIZE, Category.MASTER_WEIGHTS),
    ]


def _zero2_kept_at(
    tl: Timeline,
    grads: list[tuple[int, int]],
    rank: RankPartition,
    numels: list[int],
    order: list[int],
    item: int,
    end: int,
) -> int:
    """Where ZeRO-2 makes the kept gradients: when the first bucket holding one of the rank's
    is reduced (``grads``: (event index, storage) of autograd's gradients, in order)."""
    buckets = reduction_buckets(numels, order, REDUCE_BUCKET_ELEMENTS)
    first = min((buckets[i] for i in rank.params), default=0)
    # the bucket each gradient fills as autograd makes them: the first of the next one
    # arrives when DeepSpeed reduces that one
    filled = reduction_buckets(
        [tl.nbytes[sid] // item for _, sid in grads], range(len(grads)), REDUCE_BUCKET_ELEMENTS
    )
    return next((i for (i, _), b in zip(grads, filled, strict=True) if b > first), end)


def _deepspeed_step(
    tl: Timeline,
    step: int,
    stage: int,
    rank: RankPartition,
    numels: list[int],
    order: list[int],
    item: int,
    has_masters: bool,
) -> None:
    """One step's gradients as DeepSpeed handles them (see ``derive``'s docstring)."""
    begin = _mark(tl, step, Phase.BACKWARD)
    end = _mark(tl, step, Phase.OPTIMIZER, after=begin)
    if begin is None or end is None:
        return
    grads = [
        (i, e)
        for i, e in enumerate(tl.events[begin:end], begin)
        if e >= 0 and tl.category(e) is Category.GRADIENTS
    ]
    if not grads:
        return
    kept_at = _zero2_kept_at(tl, grads, rank, numels, order, item, end) if stage == 2 else end
    step_end = _mark(tl, step + 1, Phase.OPTIMIZER, after=end) or len(tl.events)
    master_grads = [
        i
        for i, e in enumerate(tl.events[end:step_end], end)
        if e >= 0 and tl.labels.get(e) == MASTER_GRADIENT
    ]
    first_master = master_grads[0] if master_grads else end
    last_master = master_grads[-1] + 1 if master_grads else end

    def new(nbytes: int, category: Category, phase: Phase, label: str | None = None) -> int:
        sid = tl.add_storage(nbytes, category)
        tl.origin[sid] = (step, phase)
        if label:
            tl.labels[sid] = label
        return sid

    bucket = new(REDUCE_BUCKET_ELEMENTS * item, Category.GRADIENT_BUCKETS, Phase.BACKWARD)
    reduced = new(
        min(sum(numels), REDUCE_BUCKET_ELEMENTS) * item,
        Category.TEMPORARIES,
        Phase.BACKWARD,
        "reduced bucket, flattened",
    )
    kept = new(rank.grads_in_partition * item, Category.SHARDED_GRADIENTS, Phase.BACKWARD)
    norm = new(
        max(rank.pieces, default=0) * DEEPSPEED_NORM_ITEMSIZE,
        Category.TEMPORARIES,
        Phase.OPTIMIZER,
        "a gradient piece in fp64 for the norm",
    )
    flat = new(
        rank.partition_numel * item,
        Category.TEMPORARIES,
        Phase.OPTIMIZER,
        "the partition's gradients, flattened",
    )
    before: dict[int, list[int]] = {}
    after: dict[int, list[int]] = {}  # after the mark at that index
    # Autograd's gradients: ZeRO-2 frees each as it copies it into the bucket; ZeRO-1 at the
    # end of backward, as it copies them into the bucket to reduce them.
    moved = {sid for _, sid in grads}
    for i, sid in grads:
        before.setdefault(i + 1 if stage == 2 else end, []).append(~sid)
    for table, index, events in (
        (before, grads[0][0] + 1, [bucket]),
        (before, kept_at, [reduced, ~reduced, kept]),
        (before, end, [~bucket]),
    ):
        table.setdefault(index, []).extend(events)
    if has_masters:  # the half-precision flat partition, then its fp32 copy (the traced ones)
        before.setdefault(first_master, []).extend([norm, ~norm, flat])
        before.setdefault(last_master, []).extend([~flat, ~kept])
    else:  # fp32: the flat partition is the step's gradient
        after.setdefault(end, []).extend([norm, ~norm, flat, ~kept])
        before.setdefault(step_end, []).append(~flat)
    _rewrite(tl, before, after, drop={~sid for sid in moved})


def _rewrite(
    tl: Timeline, before: dict[int, list[int]], after: dict[int, list[int]], drop: set[int]
) -> None:
    """Insert ``before[i]`` ahead of event ``i`` (and of a mark there) and ``after[i]`` between
    such a mark and the event; remove the events in ``drop``."""
    events: list[int] = []
    blocks: list[int | None] = []
    position: list[int] = []
    for i in range(len(tl.events) + 1):
        for e in before.get(i, ()):
            events.append(e)
            blocks.append(tl.block[e if e >= 0 else ~e])
        position.append(len(events))
        for e in after.get(i, ()):
            events.append(e)
            blocks.append(tl.block[e if e >= 0 else ~e])
        if i < len(tl.events) and tl.events[i] not in drop:
            events.append(tl.events[i])
            blocks.append(tl.event_block[i])
    tl.events, tl.event_block = events, blocks
    tl.marks = [(position[index], step, phase) for index, step, phase in tl.marks]


def _mark(tl: Timeline, step: int, phase: Phase, after: int = 0) -> int | None:
    """Index of the first mark of (``step``, ``phase``) at or after event ``after``."""
    return next((i for i, s, p in tl.marks if s == step and p is phase and i >= after), None)


def _parameter_numels(tl: Timeline, itemsize: int) -> list[int]:
    """Elements of the parameters the trace registered (set-up, in registration order)."""
    end = next((index for index, step, _ in tl.marks if step >= 1), len(tl.events))
    return [
        tl.nbytes[e] // itemsize
        for e in tl.events[:end]
        if e >= 0 and tl.category(e) is Category.PARAMETERS
    ]
