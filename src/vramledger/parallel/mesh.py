"""The N-D device mesh of a run split along several axes, and what each axis does to a (stage)
model: tensor and sequence parallelism, context parallelism, expert parallelism, and FSDP2 or
DDP over the data-parallel axis.

The mesh is torchtitan's (``torchtitan/distributed/parallel_dims.py``): dimensions in the order
``pp, dp_replicate | dp_shard, cp, tp`` (the innermost, ``tp``, varies fastest over the ranks,
so a tensor-parallel group is a node's neighbouring GPUs), each dimension present only when its
degree is above 1. The data-parallel dimension is ``dp_replicate`` under DDP and ``dp_shard``
under FSDP2 (``--strategy fsdp``, the default when the model is split). Expert
parallelism borrows its ranks from ``dp_shard x cp`` as torchtitan does (``ep`` of them: the
inner part of the flattened ``dp_shard, cp`` dimension).

The API other engines build on (the pipeline engine calls these for a stage's inner axes):

- :func:`mesh_coords` — a rank's coordinates ``{dp, tp, pp, cp, ep}``;
- :func:`fake_mesh` — a context manager: a fake process group for the whole world and the
  named DeviceMesh, as rank ``rank`` sees it (no other processes; collectives return at once);
- :func:`build_mesh` — the same mesh on a process group that exists (a real gloo/NCCL run);
- :func:`apply_inner_parallelism` — TP/SP, CP, EP and FSDP2 applied to a model (or one pipeline
  stage's module) on that mesh; the same call serves the estimate and the real run.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from vramledger.inputs.categories import Category
from vramledger.inputs.config_depth import config_depth
from vramledger.inputs.errors import InputError
from vramledger.inputs.recipe import Recipe, resolve
from vramledger.inputs.spec import TrainingSpec
from vramledger.inputs.training import assemble
from vramledger.parallel.context import check_context_parallel, context_parallel_step
from vramledger.parallel.engines import (
    FSDP_OP_CATEGORIES,
    DataParallel,
    adapt_recipe,
    ddp_bucket_buffers,
)
from vramledger.parallel.experts import apply_expert_parallel, symmetric_count_exchange
from vramledger.parallel.fake_group import fake_process_group
from vramledger.parallel.fsdp_units import apply_fully_shard, mixed_precision_policy
from vramledger.parallel.tp_plans import tp_plan
from vramledger.record.timeline import Timeline
from vramledger.trace.core.engine import Track

MESH_ORDER: tuple[str, ...] = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
"""torchtitan's order of mesh dimensions, outermost first."""
COORD_AXES: tuple[str, ...] = ("dp", "tp", "pp", "cp", "ep")
"""The keys of :func:`mesh_coords` (and of ``mesh_coords`` in the JSON)."""


def dp_dim_name(spec: TrainingSpec) -> str:
    """The data-parallel dimension's name: ``dp_replicate`` under DDP (or no strategy),
    ``dp_shard`` under FSDP2."""
    return "dp_shard" if spec.parallelism.dp_shard_enabled else "dp_replicate"


def mesh_dims(spec: TrainingSpec) -> list[tuple[str, int]]:
    """(name, degree) of each mesh dimension, outermost first, those of degree 1 left out (as
    torchtitan builds its mesh). A world of one rank has a single dimension of size 1, named
    after the data-parallel axis.

    With expert parallelism the data-parallel dimension is split as torchtitan's
    ``_build_mesh_with_ep`` splits it: ``dp_shard_mod_ep`` (always present, the ranks FSDP2
    shards each expert over) and ``dp_shard_in_ep`` (the data-parallel part of the ep group,
    ``ep / cp``), and ``tp`` is kept even at degree 1 (the experts' dispatch needs the group of
    ranks sharing a batch)."""
    dp = dp_dim_name(spec)
    if spec.ep > 1:
        check_expert_parallel(spec)
        in_ep = spec.ep // spec.cp
        degrees = [
            ("pp", spec.pp),
            ("dp_shard_mod_ep", spec.dp_degree // in_ep),
            ("dp_shard_in_ep", in_ep),
            ("cp", spec.cp),
            ("tp", spec.tp),
        ]
        keep = {"dp_shard_mod_ep", "tp"}
        return [(n, d) for n, d in degrees if d > 1 or n in keep]
    degrees = {"pp": spec.pp, dp: spec.dp_degree, "cp": spec.cp, "tp": spec.tp}
    dims = [(name, degrees[name]) for name in MESH_ORDER if degrees.get(name, 1) > 1]
    return dims or [(dp, 1)]


def check_expert_parallel(spec: TrainingSpec) -> None:
    """torchtitan's rule for ep (with experts not split by tp): ep borrows all of cp and part of
    the FSDP ranks, ``ep % cp == 0`` and ``(dp_shard x cp) % ep == 0``."""
    if spec.ep % spec.cp or (spec.dp_degree * spec.cp) % spec.ep:
        raise InputError(
            f"ep {spec.ep} must be a multiple of cp {spec.cp} and divide dp x cp "
            f"({spec.dp_degree * spec.cp})",
            hint="expert parallelism borrows all context-parallel ranks and some data-parallel ones",
        )
    if spec.ep > spec.cp and not spec.parallelism.is_fsdp:
        raise InputError(
            f"expert parallelism borrows data-parallel ranks from FSDP2's, and the strategy is "
            f"{spec.strategy}",
            hint="add --strategy fsdp",
        )


def mesh_coords(rank: int, spec: TrainingSpec) -> dict[str, int]:
    """Rank ``rank``'s coordinates on the mesh: ``{"dp", "tp", "pp", "cp", "ep"}``.

    Row-major over ``pp, dp, cp, tp`` (tp fastest). ``ep`` is the rank's place in its
    expert-parallel group, the inner ``ep`` ranks of the flattened ``dp x cp`` index
    (torchtitan's ``dp_shard_in_ep x cp``): ``(dp * cp_degree + cp) % ep_degree``. Ranks of a
    data-parallel-only run have ``dp`` = the rank and every other coordinate 0."""
    if not 0 <= rank < spec.world_size:
        raise InputError(f"rank {rank} is not in a world of {spec.world_size}")
    tp = rank % spec.tp
    cp = (rank // spec.tp) % spec.cp
    dp = (rank // (spec.tp * spec.cp)) % spec.dp_degree
    pp = rank // (spec.tp * spec.cp * spec.dp_degree)
    ep = (dp * spec.cp + cp) % spec.ep
    return {"dp": dp, "tp": tp, "pp": pp, "cp": cp, "ep": ep}


def build_mesh(spec: TrainingSpec, device_type: str = "cpu") -> Any:
    """The named DeviceMesh of ``spec`` on the process group that exists (``init_device_mesh``),
    with the flattened dimensions the engines use: ``dp_shard_cp`` (FSDP2 over data and context
    ranks, when cp > 1), and with expert parallelism ``dp_shard`` (the two parts of the
    data-parallel dimension), ``dp_shard_cp`` and ``ep`` (``dp_shard_in_ep x cp``)."""
    from torch.distributed.device_mesh import init_device_mesh

    dims = mesh_dims(spec)
    names = tuple(n for n, _ in dims)
    mesh = init_device_mesh(device_type, tuple(d for _, d in dims), mesh_dim_names=names)
    dp = dp_dim_name(spec)
    if spec.ep > 1:
        data = [n for n in ("dp_shard_mod_ep", "dp_shard_in_ep") if n in names]
        mesh[tuple(data)]._flatten(mesh_dim_name="dp_shard")
        if spec.cp > 1:
            mesh[(*data, "cp")]._flatten(mesh_dim_name="dp_shard_cp")
        inner = [n for n in ("dp_shard_in_ep", "cp") if n in names]
        mesh[tuple(inner)]._flatten(mesh_dim_name="ep")
    elif spec.cp > 1 and dp in names:
        mesh[(dp, "cp")]._flatten(mesh_dim_name=f"{dp}_cp")
    return mesh


@contextlib.contextmanager
def fake_mesh(rank: int, spec: TrainingSpec) -> Iterator[Any]:
    """A fake process group of ``spec.world_size`` ranks in this process, as rank ``rank``,
    and the named DeviceMesh of :func:`build_mesh` on it. Collectives return at once with
    exact shapes (``fake_group.py``); nothing else runs."""
    with fake_process_group(rank, spec.world_size):
        yield build_mesh(spec, "cpu")


def submesh(mesh: Any, name: str) -> Any | None:
    """The 1-D mesh of dimension ``name`` (flattened ones included), or None when the mesh has
    no such dimension (degree 1)."""
    try:
        return mesh[name]
    except (KeyError, RuntimeError, ValueError):
        return None


@dataclass(frozen=True)
class Applied:
    """What :func:`apply_inner_parallelism` did to a model."""

    words: list[str]
    """Each axis applied, in words (the estimate's notes)."""
    loss_parallel: bool
    """The logits stay split over the vocabulary: the loss runs under ``loss_parallel()``."""
    mesh: Any = None
    spec: TrainingSpec | None = None


_APPLIED: weakref.WeakKeyDictionary[nn.Module, Applied] = weakref.WeakKeyDictionary()


def applied(model: nn.Module) -> Applied:
    """What :func:`apply_inner_parallelism` did to ``model`` (nothing, if it was not called)."""
    return _APPLIED.get(model, Applied(words=[], loss_parallel=False))


def fsdp_degree(spec: TrainingSpec) -> int:
    """Ranks FSDP2 shards parameters over: data-parallel x context-parallel (torchtitan's
    ``dp_shard_cp``) under ``fsdp``; 1 otherwise."""
    return spec.dp_degree * spec.cp if spec.parallelism.is_fsdp else 1


def _fsdp_mesh(mesh: Any, spec: TrainingSpec) -> Any | None:
    if fsdp_degree(spec) == 1:
        return None
    dp = dp_dim_name(spec)
    if spec.cp > 1 and (spec.dp_degree > 1 or spec.ep > 1):
        return mesh[f"{dp}_cp"]
    return mesh["cp"] if spec.cp > 1 else mesh[dp]


def apply_inner_parallelism(
    model: nn.Module,
    mesh: Any,
    spec: TrainingSpec,
    blocks: Sequence[nn.Module],
    precision_name: str,
) -> nn.Module:
    """Apply the non-pipeline axes of ``spec`` to ``model`` (a whole model, or one pipeline
    stage's module) on ``mesh`` (from :func:`fake_mesh` or :func:`build_mesh`; a ``pp``
    dimension in it is ignored here), in torchtitan's order (``parallelize.py``): tensor and
    sequence parallelism (``parallelize_module`` with the family's plan or ``spec.tp_plan``,
    ``tp_plans.py``), expert parallelism of MoE experts, then FSDP2 ``fully_shard`` over the
    data-parallel x context-parallel ranks on each block of ``blocks`` (else of the model's
    block stack) and the root (``fsdp_units.py``). Context parallelism and loss parallelism act
    at run time: run the step under :func:`step_context`. Returns the model (changed in place);
    :func:`applied` says what was done."""
    from torch.distributed.tensor.parallel import parallelize_module

    words: list[str] = []
    loss_parallel = False
    if spec.cp > 1:
        check_context_parallel(spec.seq_len, spec.cp, spec.target)
        words.append(
            f"context parallel over {spec.cp} ranks: PyTorch's context_parallel (ring attention, "
            "all-gathered keys and values, head-tail load balancing)"
        )
    tp_mesh = submesh(mesh, "tp") if spec.tp > 1 else None
    if tp_mesh is not None:
        plan = tp_plan(model, tp_mesh, spec.tp_plan)
        parallelize_module(model, tp_mesh, plan.styles)
        loss_parallel = plan.loss_parallel
        words.append(f"tensor parallel over {spec.tp} ranks: {plan.source}")
    experts: list[nn.Module] = []
    if spec.ep > 1:
        experts = apply_expert_parallel(model, mesh["ep"], mesh["tp"])
        words.append(
            f"expert parallel over {spec.ep} ranks: transformers' apply_expert_parallelism "
            f"(the family's ep_plan, AllToAllEP) on {len(experts)} experts modules"
        )
    fsdp_mesh = _fsdp_mesh(mesh, spec)
    if fsdp_mesh is not None:
        from torch.distributed.fsdp import fully_shard

        for module in experts:  # torchtitan: each experts module over dp_shard_mod_ep first
            fully_shard(
                module,
                mesh=mesh["dp_shard_mod_ep"],
                mp_policy=mixed_precision_policy(spec, precision_name),
            )

        units = apply_fully_shard(model, spec, fsdp_mesh, precision_name, blocks)
        axes = "data-parallel x context-parallel" if spec.cp > 1 else "data-parallel"
        words.append(f"FSDP2 fully_shard over the {fsdp_mesh.size()} {axes} ranks, on {units}")
    _APPLIED[model] = Applied(words=words, loss_parallel=loss_parallel, mesh=mesh, spec=spec)
    return model


@contextlib.contextmanager
def step_context(model: nn.Module, batch: Any = None) -> Iterator[None]:
    """What a training step of ``model`` (after :func:`apply_inner_parallelism`) runs under,
    forward, loss and backward: ``loss_parallel()`` when the plan keeps the logits split over
    the vocabulary; PyTorch's ``context_parallel`` over the cp ranks with ``batch``'s sequence
    buffers (``context.py``) when cp > 1. Nothing for a model it was not applied to."""
    done = applied(model)
    with contextlib.ExitStack() as stack:
        if done.spec is not None and done.spec.cp > 1:
            stack.enter_context(context_parallel_step(done.mesh["cp"], batch, done.spec.seq_len))
        if done.loss_parallel:
            from torch.distributed.tensor.parallel import loss_parallel

            stack.enter_context(loss_parallel())
        yield


def in_step_context(run: Any, model: nn.Module) -> Any:
    """A training run (``training.TrainingRun``) whose ``step``/``run`` go through
    :func:`step_context` with the run's batch."""
    return _InContext(run, lambda: step_context(model, run.batch))


# -- the engine the tracer runs under (trace/core/engine.py) ---------------------------------------
COLLECTIVE_OP_CATEGORIES: dict[str, Category] = {
    f"_c10d_functional.{op}.default": Category.COMM_BUFFERS
    for op in ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce", "all_to_all_single")
}
"""Outputs of the functional collectives DTensor redistributes activations with (tensor and
sequence parallelism, loss parallel, context parallelism, expert dispatch)."""


class MeshParallel:
    """The ``trace.engine.Engine`` of a run split along tp / cp / ep (and data-parallel): each
    traced run is one rank on a fake process group, its model parallelized on the N-D mesh."""

    def __init__(self, spec: TrainingSpec) -> None:
        self.spec = spec

    def adapt(self, recipe: Recipe) -> Recipe:
        """Under FSDP2 the fp32 shards are the master weights (``engines.adapt_recipe``)."""
        return adapt_recipe(recipe) if fsdp_degree(self.spec) > 1 else recipe

    @contextlib.contextmanager
    def rank(self, rank: int) -> Iterator[MeshRankEngine]:
        with fake_mesh(rank, self.spec) as mesh:
            yield MeshRankEngine(spec=self.spec, rank=rank, mesh=mesh)

    def finish(self, timeline: Timeline, recipe: Recipe) -> list[str]:
        return DataParallel(self.spec).finish(timeline, recipe)


@dataclass
class MeshRankEngine:
    """One rank's engine on the mesh (a ``trace.engine.RankEngine``)."""

    spec: TrainingSpec
    rank: int
    mesh: Any
    notes: list[str] = field(default_factory=list)
    keep: list[Any] = field(default_factory=list)

    @property
    def op_categories(self) -> dict[str, Category]:
        fsdp = FSDP_OP_CATEGORIES if fsdp_degree(self.spec) > 1 else {}
        # FSDP2's own copy-in ops first; the functional collectives are DTensor's
        return {**COLLECTIVE_OP_CATEGORIES, **{k: v for k, v in fsdp.items() if "fsdp." in k}}

    @property
    def resize_category(self) -> Category | None:
        return Category.ALL_GATHER_BUFFERS if fsdp_degree(self.spec) > 1 else None

    def wrap(self, model: nn.Module, blocks: list[nn.Module], precision_name: str) -> nn.Module:
        with meshes_outside_the_trace():
            model = apply_inner_parallelism(model, self.mesh, self.spec, blocks, precision_name)
        coords = mesh_coords(self.rank, self.spec)
        where = ", ".join(f"{k} {v}" for k, v in coords.items())
        self.notes.append(
            f"rank {self.rank} ({where}) of a {' x '.join(f'{n} {d}' for n, d in mesh_dims(self.spec))} "
            f"mesh on a fake process group: " + "; ".join(applied(model).words or ["replicated"])
        )
        return model

    def owned(self, params: list[nn.Parameter]) -> list[nn.Parameter]:
        return params

    def add_buckets(self, model: nn.Module, track: Track) -> None:
        """DDP over the data-parallel (and context-parallel) ranks: its gradient buckets, by
        its own bucket assignment, over this rank's local parameter pieces (what DDP holds
        after ``_pre_dp_module_transform`` makes the tensor-parallel parameters local)."""
        spec = self.spec
        if not spec.parallelism.is_ddp or spec.dp_degree * spec.cp == 1:
            return
        from torch.distributed.tensor import DTensor

        params = [
            p.to_local() if isinstance(p, DTensor) else p
            for p in model.parameters()
            if p.requires_grad
        ]
        buffers = ddp_bucket_buffers(params)
        self.keep.extend(buffers)
        track(buffers, Category.GRADIENT_BUCKETS)
        self.notes.append(
            f"ddp over {spec.dp_degree * spec.cp} ranks: DDP gradient buckets of this rank's "
            "local parameter pieces, from DDP's own bucket assignment"
        )

    def assemble(self, **kwargs: Any) -> Any:
        """training.py's step, run under :func:`step_context` (loss parallel, context
        parallel)."""
        run = in_step_context(assemble(**kwargs), kwargs["model"])
        if self.spec.ep > 1:  # the count exchange a fake process group cannot make
            ep_rank = mesh_coords(self.rank, self.spec)["ep"]
            inner = run.context
            run.context = lambda: _both(inner(), symmetric_count_exchange(ep_rank))
        return run


@contextlib.contextmanager
def meshes_outside_the_trace() -> Iterator[None]:
    """FSDP2 on a tensor-parallel model builds a 2-D DeviceMesh (``_init_sharding_spec_tp``:
    ``DeviceMesh._concatenate``) from the mesh's rank tensor, a real tensor that the trace's
    fake mode refuses; meshes are built outside the trace's modes, as on a real rank."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.utils._python_dispatch import _disable_current_modes

    original = DeviceMesh.__init__

    def outside_the_trace(self: Any, *args: Any, **kwargs: Any) -> None:
        with _disable_current_modes():
            original(self, *args, **kwargs)

    DeviceMesh.__init__ = outside_the_trace
    try:
        yield
    finally:
        DeviceMesh.__init__ = original


@contextlib.contextmanager
def _both(
    first: contextlib.AbstractContextManager, second: contextlib.AbstractContextManager
) -> Iterator[None]:
    with first, second:
        yield


class _InContext:
    """A training run whose steps run inside a context."""

    def __init__(self, inner: Any, context: Callable[[], contextlib.AbstractContextManager]):
        self.inner, self.context = inner, context

    def run(self, steps: int, observer: Any) -> None:
        with self.context():
            self.inner.run(steps, observer)

    def step(self, step: int, observer: Any) -> None:
        with self.context():
            self.inner.step(step, observer)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


# -- which ranks share a ledger (predict.rank_groups) ----------------------------------------
def uses_mesh(spec: TrainingSpec) -> bool:
    """The run is split along tensor, context or expert parallelism (pipeline runs have their
    own engine, which calls this module for a stage's inner axes)."""
    return spec.tp > 1 or spec.cp > 1 or spec.ep > 1


def mesh_rank_groups(spec: TrainingSpec) -> list[list[int]]:
    """Ranks that hold the same things: every rank of the mesh. Ranks along dp and cp hold the
    same shapes (FSDP2's uneven last shard is bounded by rank 0's, as for the data-parallel
    strategies; the sequence split is even, checked); along ep too (whole experts, an even
    split, checked); along tp the plan's splits are checked even by :func:`check_even_tp`
    (PyTorch's tensor-parallel styles rebuild activations with ``DTensor.from_local``, which
    assumes even shards, so an uneven split does not run)."""
    check_even_tp(spec)
    return [list(range(spec.world_size))]


def check_even_tp(spec: TrainingSpec) -> None:
    """Apply the plan on a meta model of one block as each tp rank and compare every
    parameter's local shape; an uneven split is refused, naming the parameter."""
    if spec.tp == 1:
        return
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import parallelize_module

    recipe = resolve(spec)
    shapes: list[dict[str, tuple[int, ...]]] = []
    for t in range(spec.tp):  # rank t has tp coordinate t (tp varies fastest)
        with fake_mesh(t, spec) as mesh:
            model = _one_block_model(recipe)
            parallelize_module(model, mesh["tp"], tp_plan(model, mesh["tp"], spec.tp_plan).styles)
            shapes.append(
                {
                    n: tuple(p.to_local().shape if isinstance(p, DTensor) else p.shape)
                    for n, p in model.named_parameters()
                }
            )
    for name in shapes[0]:
        others = {s[name] for s in shapes}
        if len(others) > 1:
            raise InputError(
                f"tp {spec.tp} splits {name} unevenly ({' / '.join(map(str, sorted(others)))} "
                "on the tp ranks); PyTorch's tensor-parallel styles assume even shards of the "
                "activations they rebuild (DTensor.from_local)",
                hint="choose a tp that divides the model's dimensions (vocabulary, heads, "
                "intermediate size)",
            )


def _one_block_model(recipe: Recipe) -> nn.Module:
    """The model on the meta device, with one block when its config says its depth (blocks are
    identical: one shows every block's shapes), built with every option of the recipe."""
    if config_depth(recipe.source.config) is None:
        return recipe.build_model("meta")
    return recipe.at_depth(1).build_model("meta")
