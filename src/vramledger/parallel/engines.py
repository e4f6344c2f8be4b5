"""Applying a data-parallel strategy to a model traced on fake tensors, as rank ``rank`` of
``world_size``, with a fake process group standing in for the others (collectives return at
once; shapes are exact). See ``strategy.py`` for what runs for each strategy.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from vramledger.inputs.categories import Category
from vramledger.inputs.errors import InputError
from vramledger.inputs.parallelism import Parallelism
from vramledger.inputs.precision import PrecisionPolicy
from vramledger.inputs.recipe import Recipe
from vramledger.inputs.spec import TrainingSpec
from vramledger.parallel.fake_group import fake_process_group
from vramledger.parallel.fsdp_units import apply_fully_shard
from vramledger.parallel.strategy import (
    OFFLOADED,
    apply_offload,
    master_shard_fraction,
)
from vramledger.record.timeline import Timeline

DDP_FIRST_BUCKET_BYTES = 1024**2
"""``dist._DEFAULT_FIRST_BUCKET_BYTES``: DDP's first bucket is capped at 1 MiB."""
DDP_BUCKET_CAP_BYTES = 25 * 1024**2
"""``_DEFAULT_BUCKET_CAP_MB = 25`` in torch/nn/parallel/distributed.py."""

# Outputs of these operators are sharding buffers (FSDP2's copy-in kernels, torch.ops.fsdp).
FSDP_OP_CATEGORIES: dict[str, Category] = {
    "fsdp.all_gather_copy_in.default": Category.ALL_GATHER_BUFFERS,
    "fsdp.chunk_cat.default": Category.REDUCE_SCATTER_BUFFERS,
    "_c10d_functional.all_gather_into_tensor.default": Category.ALL_GATHER_BUFFERS,
    "_c10d_functional.reduce_scatter_tensor.default": Category.REDUCE_SCATTER_BUFFERS,
}


@contextlib.contextmanager
def fake_world(rank: int, world_size: int) -> Iterator[Any]:
    """A fake process group for ``world_size`` ranks in this process (and its device mesh)."""
    from torch.distributed.device_mesh import init_device_mesh

    with fake_process_group(rank, world_size):
        yield init_device_mesh("cpu", (world_size,))


def adapt_recipe(recipe: Recipe) -> Recipe:
    """FSDP keeps fp32 shards and computes in half precision through its own
    MixedPrecisionPolicy: no separate master weights, the model built in fp32."""
    spec = recipe.spec
    if not spec.parallelism.is_fsdp or not recipe.precision.master_weights:
        return recipe
    if recipe.precision.loss_scaling:
        raise InputError("fp16-master with FSDP is not supported", hint="use bf16-master")
    fsdp_precision = PrecisionPolicy(
        name=recipe.precision.name,
        param_dtype=torch.float32,
        autocast_dtype=None,
        master_weights=False,
        loss_scaling=False,
        models="fp32 shards that are the master weights, computing in bf16 through FSDP2's "
        "MixedPrecisionPolicy (torchtitan, accelerate FSDP2 bf16; DeepSpeed ZeRO-3 bf16)",
    )
    return replace(recipe, precision=fsdp_precision)


class DataParallel:
    """The ``trace.engine.Engine`` of a data-parallel strategy (or of none, with offload):
    each traced run is one rank on a fake process group of ``spec.world_size`` ranks."""

    def __init__(self, spec: TrainingSpec) -> None:
        self.spec = spec

    def adapt(self, recipe: Recipe) -> Recipe:
        return adapt_recipe(recipe)

    @contextlib.contextmanager
    def rank(self, rank: int) -> Iterator[RankEngine]:
        if self.spec.parallelism.is_single:
            yield RankEngine(spec=self.spec, rank=rank)
            return
        with fake_world(rank, self.spec.world_size) as mesh:
            yield RankEngine(spec=self.spec, rank=rank, mesh=mesh)

    def finish(self, timeline: Timeline, recipe: Recipe) -> list[str]:
        """Offload: what the setting keeps in host memory (``strategy.py``)."""
        spec = self.spec
        offloaded = OFFLOADED[spec.offload]
        if not offloaded:
            return []
        notes = []
        fraction = master_shard_fraction(spec.parallelism, recipe.precision)
        apply_offload(timeline, spec.offload, half_shard_fraction=fraction)
        if fraction is not None and spec.offload == "optimizer":
            notes.append(
                f"offload optimizer under {spec.strategy}: DeepSpeed ZeRO-3's offload_optimizer "
                "layout: the fp32 shards (master weights) in host memory, a half-precision copy "
                "of each on the GPU"
            )
        notes.append(
            f"offload {spec.offload}: {', '.join(sorted(c.value for c in offloaded))} kept in host "
            "memory, and the optimizer step's temporaries when it runs there (staging buffers of "
            "the transfers not modelled)"
        )
        return notes


@dataclass
class RankEngine:
    """What a strategy does to one rank's model, optimizer and memory
    (a ``trace.engine.RankEngine``)."""

    spec: TrainingSpec
    rank: int
    mesh: Any = None
    notes: list[str] = field(default_factory=list)
    keep: list[torch.Tensor] = field(default_factory=list)

    @property
    def strategy(self) -> str:
        return self.spec.strategy or "none"

    @property
    def parallelism(self) -> Parallelism:
        return self.spec.parallelism

    @property
    def op_categories(self) -> dict[str, Category]:
        return FSDP_OP_CATEGORIES if self.parallelism.is_fsdp else {}

    @property
    def resize_category(self) -> Category | None:
        """FSDP2 allocates and frees unsharded parameters by resizing their storage: gathered
        for a layer's compute, then freed — all-gather buffers."""
        return Category.ALL_GATHER_BUFFERS if self.parallelism.is_fsdp else None

    def wrap(self, model: nn.Module, blocks: list[nn.Module], precision_name: str) -> nn.Module:
        """FSDP2 ``fully_shard`` on each unit and the root (``fsdp_units.py``: the traced block
        stack, else the largest stack of identical blocks, else the units the spec names;
        named units that are not the traced ``blocks`` raise NotExtensible)."""
        if not self.parallelism.is_fsdp:
            return model

        units = apply_fully_shard(model, self.spec, self.mesh, precision_name, blocks)
        self.notes.append(
            f"{self.strategy}: traced with FSDP2 fully_shard on a fake process group of "
            f"{self.spec.world_size} ranks, on {units}"
        )
        return model

    def owned(self, params: list[nn.Parameter]) -> list[nn.Parameter]:
        """The parameters this rank's optimizer steps (``zero1-torch``: its partition, by
        ZeroRedundancyOptimizer's own partitioning)."""
        if not self.parallelism.is_zero_redundancy:
            return params
        return [params[i] for i in zero1_partition(params, self.spec.world_size)[self.rank]]

    def add_buckets(self, model: nn.Module, track: Any) -> None:
        """DDP's gradient buckets: one flat buffer per bucket of its own bucket assignment,
        allocated when DDP wraps the model (``gradient_as_bucket_view=False``, the default)."""
        if not self.parallelism.is_ddp:
            return
        buffers = ddp_bucket_buffers([p for p in model.parameters() if p.requires_grad])
        self.keep.extend(buffers)
        track(buffers, Category.GRADIENT_BUCKETS)
        self.notes.append(
            f"{self.strategy}: DDP gradient buckets from DDP's own bucket assignment "
            "(dist._compute_bucket_assignment_by_size); its reducer cannot run on fake tensors"
        )


def ddp_bucket_buffers(
    params: list[torch.Tensor],
    caps: tuple[int, int] = (DDP_FIRST_BUCKET_BYTES, DDP_BUCKET_CAP_BYTES),
) -> list[torch.Tensor]:
    """DDP's gradient buckets for ``params`` (its trainable parameters, or their local pieces):
    one flat buffer per bucket of its own assignment (:func:`ddp_buckets`) and dtype, made like
    the parameters (fake when they are), as its reducer allocates them when it wraps the model
    (``gradient_as_bucket_view=False``, the default). The estimate's engines and a program's
    ``DDP(...)`` (``program_world.py``) make them here."""
    out = []
    for dtype in dict.fromkeys(p.dtype for p in params):
        group = [p for p in params if p.dtype is dtype]
        for bucket in ddp_buckets(group, caps):
            numel = sum(group[i].numel() for i in bucket)
            out.append(group[bucket[0]].detach().new_empty(numel))
    return out


def ddp_buckets(
    params: list[torch.Tensor],
    caps: tuple[int, int] = (DDP_FIRST_BUCKET_BYTES, DDP_BUCKET_CAP_BYTES),
) -> list[list[int]]:
    """DDP's bucket assignment for ``params`` (in reverse order of definition, as DDP does),
    with its first bucket capped at ``caps[0]`` bytes and the others at ``caps[1]``."""
    order = list(reversed(range(len(params))))
    with _no_fake():
        metas = [torch.empty(params[i].shape, dtype=params[i].dtype, device="meta") for i in order]
        buckets, _ = dist._compute_bucket_assignment_by_size(
            metas, list(caps), [False] * len(metas)
        )
    return [[order[i] for i in bucket] for bucket in buckets]


def zero1_partition(params: list[torch.Tensor], world_size: int) -> list[list[int]]:
    """Which parameters each rank owns, by ZeroRedundancyOptimizer's own partitioning
    (largest first, to the rank with the fewest elements so far)."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    with _no_fake():
        metas = [torch.empty(p.shape, dtype=p.dtype, device="meta") for p in params]
        index = {id(m): i for i, m in enumerate(metas)}
        # Only the partitioning state of an instance (no process group, no collectives).
        zero = object.__new__(ZeroRedundancyOptimizer)
        zero.param_groups = [{"params": metas}]
        zero.world_size = world_size
        zero._partition_parameters_cache = []
        partition = zero._partition_parameters()
    return [[index[id(p)] for group in groups for p in group["params"]] for groups in partition]


@contextlib.contextmanager
def _no_fake() -> Iterator[None]:
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():
        yield
