"""DeepSpeed ZeRO-1/2's partition of a parameter group, per rank, from DeepSpeed's own code.

``DeepSpeedZeroOptimizer`` (``deepspeed/runtime/zero/stage_1_and_2.py``) flattens each parameter
group into one buffer padded to a multiple of ``2 × world_size`` elements and splits it evenly:
rank ``r`` steps elements ``[r·p, (r+1)·p)`` of it (its fp32 master partition and optimizer
state are ``p`` elements), and the last rank's partition holds the padding. Gradients are kept
for whole parameters: a rank keeps the gradient of every parameter that overlaps its partition
(``grads_in_partition``, ``G_r`` elements, made by ``copy_grads_in_partition`` when the first of
them is reduced).

:func:`zero_partitions` runs DeepSpeed's own partitioning methods —
``flatten_dense_tensors_aligned``, ``get_data_parallel_partitions``, ``get_partition_info`` (and
``_round_robin_reorder`` when asked) — on meta tensors, with a fake process group answering the
world size: no step, no memory, no communication. It says which ranks hold the same things
(:func:`rank_groups`, for ``predict.rank_groups``). :func:`even_partitions` restates the same
arithmetic without DeepSpeed for the planner (``plan/derive.py``); the tests check that the two
agree.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from vramledger.parallel.deepspeed_runtime import deepspeed_modules, fake_deepspeed_world
from vramledger.parallel.engines import fake_world

NCCL_START_ALIGNMENT_FACTOR = 2
"""Elements each partition start is aligned to, per rank: ``nccl_start_alignment_factor = 2``
("4-byte alignment/sizeof(fp16)") in ``DeepSpeedZeroOptimizer.__init__``; the flat buffer is
padded to a multiple of ``NCCL_START_ALIGNMENT_FACTOR × world_size`` elements."""
REDUCE_BUCKET_ELEMENTS = 500_000_000
"""DeepSpeed's default ``zero_optimization.reduce_bucket_size`` (``DeepSpeedZeroConfig``,
``deepspeed/runtime/zero/config.py``): its reduce bucket holds this many gradient elements,
allocated whole whatever the model's size."""


@dataclass(frozen=True, kw_only=True)
class RankPartition:
    """What DeepSpeed's flat partition gives one rank (one parameter group)."""

    rank: int
    flat_numel: int
    """Elements of the padded flat buffer of the group (``bit16_groups_flat``), on every rank."""
    partition_numel: int
    """Elements of this rank's partition: its fp32 master weights and optimizer state."""
    padding: int
    """Padding elements inside this rank's partition (``groups_padding``)."""
    params: tuple[int, ...]
    """Indices (in the group's order) of the parameters overlapping the partition."""
    grads_in_partition: int
    """Elements of those parameters, whole: the gradients this rank keeps."""
    pieces: tuple[int, ...]
    """Elements of each of those parameters inside the partition."""

    @property
    def signature(self) -> tuple[int, int, int, int]:
        """The sizes of the rank's own allocations: partition, padding, the gradients it keeps,
        the largest parameter piece (the step copies each piece to the norm's dtype in turn)."""
        return (
            self.partition_numel,
            self.padding,
            self.grads_in_partition,
            max(self.pieces, default=0),
        )


def zero_partitions(
    numels: Sequence[int], world_size: int, *, round_robin: bool = False
) -> list[RankPartition]:
    """Every rank's partition of one parameter group whose parameters have ``numels`` elements
    (in the group's order), as DeepSpeed's ZeRO-1/2 optimizer makes it on ``world_size`` ranks,
    by DeepSpeed's own methods."""
    if dist.is_initialized():
        if dist.get_world_size() != world_size:
            raise ValueError(f"a process group of {dist.get_world_size()} ranks is initialised")
        return _deepspeed_partitions(numels, world_size, round_robin)
    with fake_world(0, world_size), fake_deepspeed_world():
        return _deepspeed_partitions(numels, world_size, round_robin)


def _deepspeed_partitions(
    numels: Sequence[int], world_size: int, round_robin: bool
) -> list[RankPartition]:
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch._utils import _flatten_dense_tensors

    # Only the partitioning methods of an instance are used, with the state they read.
    zero = object.__new__(deepspeed_modules().zero_optimizer)
    zero.flatten = _flatten_dense_tensors
    zero.real_dp_process_group = [None]  # the world: DeepSpeedEngine's default dp group
    zero.nccl_start_alignment_factor = NCCL_START_ALIGNMENT_FACTOR
    with unset_fake_temporarily():
        tensors = [torch.empty(n, dtype=torch.bfloat16, device="meta") for n in numels]
        index = {id(t): i for i, t in enumerate(tensors)}
        if round_robin:
            tensors, _ = zero._round_robin_reorder(tensors, world_size)
        padding = [0] * len(tensors)  # parameter_alignment=False, DeepSpeed's default
        flat = zero.flatten_dense_tensors_aligned(
            tensors, NCCL_START_ALIGNMENT_FACTOR * world_size, param_padding=padding
        )
        parts = zero.get_data_parallel_partitions(flat, 0)
        group_numel = sum(t.numel() for t in tensors)
        partition_size = flat.numel() // world_size  # as DeepSpeedZeroOptimizer.__init__
        out, left = [], 0
        for rank, part in enumerate(parts):
            inside, _, first_offset = zero.get_partition_info(
                tensors, partition_size, rank, padding
            )
            size = part.numel()
            out.append(
                RankPartition(
                    rank=rank,
                    flat_numel=flat.numel(),
                    partition_numel=size,
                    padding=_padding(left, size, group_numel),
                    params=tuple(index[id(t)] for t in inside),
                    grads_in_partition=sum(t.numel() for t in inside),
                    pieces=_pieces([t.numel() for t in inside], first_offset, partition_size),
                )
            )
            left += size
    return out


def even_partitions(numels: Sequence[int], world_size: int) -> list[RankPartition]:
    """:func:`zero_partitions` (no round robin) restated without DeepSpeed: the group padded to
    a multiple of ``NCCL_START_ALIGNMENT_FACTOR × world_size``, split evenly, each rank keeping
    the parameters that start inside its partition or straddle its start."""
    total = sum(numels)
    alignment = NCCL_START_ALIGNMENT_FACTOR * world_size
    flat = -(-total // alignment) * alignment
    size = flat // world_size
    out = []
    for rank in range(world_size):
        start, end = rank * size, (rank + 1) * size
        params, first_offset, offset = [], 0, 0
        for i, n in enumerate(numels):
            if start <= offset < end:
                params.append(i)
            elif offset < start < offset + n:
                params.append(i)
                first_offset = start - offset
            offset += n
        inside = [numels[i] for i in params]
        out.append(
            RankPartition(
                rank=rank,
                flat_numel=flat,
                partition_numel=size,
                padding=_padding(start, size, total),
                params=tuple(params),
                grads_in_partition=sum(inside),
                pieces=_pieces(inside, first_offset, size),
            )
        )
    return out


def _padding(left: int, size: int, group_numel: int) -> int:
    """Padding inside the partition ``[left, left + size)`` (``groups_padding`` in __init__)."""
    return min(size, max(0, left + size - group_numel))


def _pieces(numels: list[int], first_offset: int, partition_size: int) -> tuple[int, ...]:
    """Elements of each parameter inside the partition: the first starts ``first_offset``
    elements into its parameter, the last may end past the partition."""
    out, room = [], partition_size
    for i, n in enumerate(numels):
        take = min(n - (first_offset if i == 0 else 0), room)
        out.append(take)
        room -= take
    return tuple(out)


def reduction_buckets(numels: Sequence[int], order: Sequence[int], bucket: int) -> list[int]:
    """The reduce bucket (0, 1, ...) each parameter's gradient goes through when the gradients
    arrive in ``order``: DeepSpeed reduces its bucket when the next gradient would overflow it
    (``reduce_independent_p_g_buckets_and_remove_grads``)."""
    out = [0] * len(numels)
    current = elements = 0
    for i in order:
        if elements + numels[i] > bucket:
            current, elements = current + 1, 0
        out[i] = current
        elements += numels[i]
    return out


def reduction_order(count: int, stage: int) -> list[int]:
    """The order gradients reach DeepSpeed's reduce bucket: ZeRO-2 reduces them in backward as
    autograd makes them — assumed in reverse order of definition, as DDP assumes for its
    buckets; ZeRO-1 reduces them after backward in the group's order (``reduce_gradients``)."""
    return list(reversed(range(count))) if stage == 2 else list(range(count))


def rank_groups(
    numels: Sequence[int],
    world_size: int,
    *,
    stage: int,
    reduce_bucket_size: int = REDUCE_BUCKET_ELEMENTS,
    round_robin: bool = False,
) -> list[list[int]]:
    """Ranks whose partitions have the same sizes (``RankPartition.signature``). Such ranks differ
    only in when their kept gradients are made (the bucket that first holds one of theirs), so
    each group lists first the rank that makes them first: it holds the same buffers longer
    than the others, so its ledger bounds theirs from above, and the worst rank of all is one
    of the firsts."""
    parts = zero_partitions(numels, world_size, round_robin=round_robin)
    buckets = reduction_buckets(numels, reduction_order(len(numels), stage), reduce_bucket_size)
    groups: dict[tuple[int, ...], list[tuple[int, int]]] = {}
    for part in parts:
        first = min((buckets[i] for i in part.params), default=0)
        groups.setdefault(part.signature, []).append((first, part.rank))
    return [[rank for _, rank in sorted(members)] for members in groups.values()]
