"""Pipeline parallelism: the model's layers split into stages, each rank running its stage(s)
under ``torch.distributed.pipelining``'s own schedule.

The split is torchtitan's (``torchtitan/distributed/pipeline_parallel.py``): the input embedding
counts as one layer and the final norm with the output head as one more
(``generate_llm_fqn_per_model_part`` with its default weights of 1), these ``layers + 2`` are
divided as evenly as possible with the remainder to the first stages, and each stage is a copy
of the model with the other stages' layers removed (``pipeline_module_split``): the embedding
only on the first stage, the final norm and the head only on the last. Single-stage schedules
(GPipe, 1F1B) give each rank one stage; interleaved 1F1B gives each rank two (torchtitan's
default), stages ``r`` and ``r + pp`` (the looped placement).

A stage of a Hugging Face decoder runs the model's own modules: the first stage its base model
on the token ids, the others its base model on the hidden states they receive
(``inputs_embeds``), the last one the model's own forward for the logits; the loss is the
model's own ``loss_function`` on the last stage, as the schedule's ``loss_fn``, divided by the
number of micro-batches with ``scale_grads=False`` (torchtitan's ``rescale_accumulated_loss``).

Each stage is a ``PipelineStage`` given its input and output shapes (one micro-batch of
``batch_size`` examples), and the rank runs ``ScheduleGPipe`` / ``Schedule1F1B`` /
``ScheduleInterleaved1F1B`` with ``microbatches`` micro-batches, ``return_outputs=False`` (as
torchtitan's training step). The same code runs an estimate (fake tensors, a fake process group:
the sends and receives go nowhere, shapes are exact) and a real run (``measure/pipeline.py``,
gloo or NCCL), with one difference: the schedule's warm-up vote (``schedules.py``
``_PipelineSchedule._warmup_p2p``, ``result.item()`` on a tensor each stage receives from its
neighbour, ``stage.py`` ``_warmup_backward_result``) cannot run on fake tensors, whose values
are unknown, nor on a fake process group, which delivers nothing; in an estimate it is answered
``STATIC``, the answer every rank gets in a real run, since every stage is built with its shapes.

Memory the schedule adds, as it allocates it: a receive buffer per micro-batch for the
activations from the previous stage and one per micro-batch for the gradients from the next
(``stage.py`` ``_setup_forward_recv_info``, ``_create_grad_recv_info``: made at the first step
and kept; category ``pipeline_buffers``), and the activations of the micro-batches in flight,
which the schedule's order decides: GPipe runs every forward before any backward, 1F1B lets
stage ``s`` of ``pp`` run ``pp - s`` forwards before its first backward.

Each stage gets the run's inner axes as torchtitan gives each model part its ``parallelize_fn``
(``mesh.apply_inner_parallelism``): tensor and sequence parallelism with the family's plan
(``tp_plans.py``), then FSDP2 over the data-parallel axis, ``reshard_after_forward=False`` unless
asked otherwise (torchtitan's default under pipeline parallelism); the schedule then keeps the
stage's gathered parameters and its unsharded gradients through all micro-batches and
reduce-scatters once, after the last (``stage.py`` ``backward_maybe_with_nosync``,
``perform_reduce_grad``). Under sequence parallelism the hidden states between stages are each
tensor-parallel rank's part of the sequence, ``[micro, seq / tp, hidden]`` (what torchtitan's
stages send), made a DTensor again on the receiving stage before its layers; the last stage's
logits stay split over the vocabulary and its loss runs under ``loss_parallel()``. Context and
expert parallelism with pipeline stages are not modelled (refused).
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from ..categories import Category, Phase
from ..config_depth import config_depth
from ..errors import InputError
from ..precision import PrecisionPolicy, autocast
from ..recipe import Recipe
from ..sources import ModelSource
from ..spec import TrainingSpec
from ..timeline import Timeline
from ..trace.blocks import find_block_stack
from ..training import TrainingRun, assemble, grad_category, track_by_kind
from .engines import DataParallel, adapt_recipe
from .mesh import (
    MeshRankEngine,
    applied,
    apply_inner_parallelism,
    check_even_tp,
    fake_mesh,
    fsdp_degree,
    mesh_coords,
    meshes_outside_the_trace,
)
from .tp_plans import SEQUENCE_DIM

SCHEDULE_CLASSES: dict[str, str] = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved-1f1b": "ScheduleInterleaved1F1B",
}
"""``--pp-schedule`` -> its class in ``torch.distributed.pipelining``."""
STAGES_PER_RANK: dict[str, int] = {"gpipe": 1, "1f1b": 1, "interleaved-1f1b": 2}
"""Stages a rank holds: one for single-stage schedules, two for interleaved ones (torchtitan's
``pipeline_llm`` default when ``pipeline_parallel_layers_per_stage`` is not given)."""
INPUT_WEIGHT = 1
"""Layers the input embedding counts for in the split (torchtitan's
``pipeline_parallel_first_stage_less_layers`` default)."""
OUTPUT_WEIGHT = 1
"""Layers the final norm and output head count for (``pipeline_parallel_last_stage_less_layers``)."""
FINAL_NORM_NAMES = ("norm", "final_layernorm", "final_layer_norm", "ln_f", "norm_f")
"""Attribute names of a Hugging Face base model's final norm."""
STAGE_PREFIX = "stage"
"""Each stage model a rank holds is its child ``stage{index}``."""


# -- the split ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class StagePlan:
    """One pipeline stage: its index and the model's layers it holds."""

    index: int
    num_stages: int
    layers: range

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.num_stages - 1

    @property
    def name(self) -> str:
        return f"{STAGE_PREFIX}{self.index}"

    def words(self) -> str:
        parts = ["the input embedding"] if self.first else []
        if self.layers:
            parts.append(f"layers {self.layers.start}-{self.layers.stop - 1}")
        parts += ["the final norm and output head"] if self.last else []
        return f"stage {self.index} of {self.num_stages} ({', '.join(parts) or 'no layers'})"


def stage_layers(num_stages: int, num_layers: int) -> list[range]:
    """The layers of each stage, as torchtitan's ``generate_llm_fqn_per_model_part`` gives them
    (input embedding and output head weighing ``INPUT_WEIGHT`` / ``OUTPUT_WEIGHT`` layers)."""
    if num_stages == 1:
        return [range(num_layers)]
    effective = num_layers + INPUT_WEIGHT + OUTPUT_WEIGHT
    per_stage, extra = divmod(effective, num_stages)
    if per_stage == 0 or max(INPUT_WEIGHT, OUTPUT_WEIGHT) > per_stage:
        raise InputError(
            f"{num_stages} pipeline stages need at least {num_stages * max(1, INPUT_WEIGHT)} "
            f"layers counting the embedding and head as one each; the model has {num_layers}",
            hint="use fewer stages (--pp, or another --pp-schedule)",
        )
    out, current = [], 0
    for s in range(num_stages):
        n = per_stage + (1 if s < extra else 0)
        n -= INPUT_WEIGHT if s == 0 else OUTPUT_WEIGHT if s == num_stages - 1 else 0
        take = max(0, min(n, num_layers - current))
        out.append(range(current, current + take))
        current += take
    return out


def pp_rank(rank: int, spec: TrainingSpec) -> int:
    """The rank's place along the pipeline axis (``mesh.mesh_coords``: torchtitan's order, pp
    outermost)."""
    return mesh_coords(rank, spec)["pp"]


def rank_stage_plans(spec: TrainingSpec, rank: int, num_layers: int) -> list[StagePlan]:
    """The stages rank ``rank`` holds (the looped placement: ``p, p + pp, ...``)."""
    per_rank = STAGES_PER_RANK[spec.pp_schedule]
    num_stages = spec.pp * per_rank
    layers = stage_layers(num_stages, num_layers)
    p = pp_rank(rank, spec)
    return [StagePlan(i, num_stages, layers[i]) for i in range(p, num_stages, spec.pp)]


def microbatches(spec: TrainingSpec) -> int:
    return spec.microbatches or spec.pp


def pipeline_rank_groups(spec: TrainingSpec) -> list[list[int]]:
    """Ranks that share one ledger: those of the same pipeline rank (the same stages) are
    symmetric along the data-parallel axis (FSDP2 shards evenly; the traced rank, data-parallel
    rank 0, holds the largest shard) and along the tensor-parallel one (the plan's splits are
    checked even, ``mesh.check_even_tp``). Every pipeline rank differs: the first holds the
    embedding, the last the head and the loss, and 1F1B keeps a different number of
    micro-batches in flight on each."""
    check_pipeline_spec(spec)
    check_even_tp(spec)
    groups: dict[int, list[int]] = {}
    for rank in range(spec.world_size):
        groups.setdefault(pp_rank(rank, spec), []).append(rank)
    return [groups[p] for p in sorted(groups)]


# -- the stage models ---------------------------------------------------------------------------
class PipelineChunks(nn.Module):
    """The stage model(s) one pipeline rank holds, each a child named ``stage{index}``: a copy
    of the model with the other stages' layers removed."""

    supports_gradient_checkpointing = True

    def __init__(self, stages: dict[str, nn.Module]) -> None:
        super().__init__()
        for name, module in stages.items():
            self.add_module(name, module)

    def gradient_checkpointing_enable(self, **kwargs: Any) -> None:
        """The Hugging Face switch of each stage model."""
        for module in self.children():
            module.gradient_checkpointing_enable(**kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("a pipeline rank's stages run under the schedule, one at a time")


@dataclass(frozen=True)
class DecoderParts:
    """Where the parts of a Hugging Face decoder are (attribute paths)."""

    blocks: str
    """The ModuleList of decoder layers, e.g. ``model.layers``."""
    norm: str
    """The base model's final norm attribute."""


def decoder_parts(model: nn.Module) -> DecoderParts:
    """The block stack and final norm of a Hugging Face causal LM whose base model holds
    nothing else with parameters than the input embedding (the stage's forward gives the base
    model the hidden states as ``inputs_embeds``; a learned position table, as GPT-2's, would be
    added again on every stage)."""
    name = type(model).__name__
    base = getattr(model, "base_model", None)
    if base is None or base is model or not hasattr(model, "get_output_embeddings"):
        raise InputError(
            f"pipeline stages are built for Hugging Face causal LMs, not {name}",
            hint="use a decoder config (Llama, Mistral, Qwen, ...)",
        )
    stack = find_block_stack(base, min_blocks=1)
    if stack is None:
        raise InputError(f"{name} has no single stack of identical decoder layers to split")
    prefix = next(n for n, m in model.named_modules() if m is base)
    norm = next(
        (n for n in FINAL_NORM_NAMES if isinstance(getattr(base, n, None), nn.Module)), None
    )
    embedding = model.get_input_embeddings()
    kept = {id(embedding), id(base.get_submodule(stack.fqn))}
    if norm is not None:
        kept.add(id(getattr(base, norm)))
    others = [
        n
        for n, m in base.named_children()
        if id(m) not in kept and any(True for _ in m.parameters())
    ]
    if norm is None or others:
        raise InputError(
            f"{name}'s base model has parts a pipeline stage cannot leave out or repeat "
            f"({', '.join(others) or 'no final norm found'})",
            hint="pipeline stages are modelled for Llama-like decoders (embedding, layers, norm)",
        )
    return DecoderParts(blocks=f"{prefix}.{stack.fqn}", norm=f"{prefix}.{norm}")


def cut_stage(model: nn.Module, plan: StagePlan, parts: DecoderParts) -> nn.Module:
    """``model`` as stage ``plan``: the other stages' layers removed (torchtitan's
    ``pipeline_module_split``), the embedding only on the first stage, the final norm (an
    identity elsewhere: the base model's forward calls it) and the output head only on the
    last; its forward runs one micro-batch through the stage."""
    parent_name, _, attr = parts.blocks.rpartition(".")
    parent = model.get_submodule(parent_name)
    layers = getattr(parent, attr)
    setattr(parent, attr, nn.ModuleList([layers[i] for i in plan.layers]))
    if not plan.first:
        model.set_input_embeddings(None)
    if not plan.last:
        norm_parent, _, norm_attr = parts.norm.rpartition(".")
        setattr(model.get_submodule(norm_parent), norm_attr, nn.Identity())
        model.set_output_embeddings(None)
    model.forward = types.MethodType(_stage_forward(plan, type(model).forward), model)
    return model


def _stage_forward(plan: StagePlan, model_forward: Any) -> Any:
    """A stage's forward. Under tensor parallelism (``_pipeline_sequence_mesh`` set by
    ``PipelineRank.wrap``) the hidden states a stage receives are its rank's part of the
    sequence, ``[micro, seq / tp, hidden]``, made a DTensor sharded along the sequence before the
    decoder layers (so the model's own code sees the whole sequence: its positions, rotary
    tables and mask), and those it sends are the local part of its output DTensor. The last
    stage returns the logits as the plan leaves them (split over the vocabulary under loss
    parallel)."""

    def forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
        mesh = getattr(self, "_pipeline_sequence_mesh", None)
        if mesh is not None and not plan.first:
            from torch.distributed.tensor import DTensor, Shard

            x = DTensor.from_local(x, mesh, [Shard(SEQUENCE_DIM)], run_check=False)
        fed = {"input_ids": x} if plan.first else {"inputs_embeds": x}
        with autocast(self._pipeline_precision, x.device.type):
            if plan.last:  # the model's own forward: its head and whatever follows it
                return model_forward(self, **fed, use_cache=False).logits
            hidden = self.base_model(**fed, use_cache=False).last_hidden_state
        return hidden.to_local() if mesh is not None else hidden

    return forward


def stage_source(
    source: ModelSource, plans: Sequence[StagePlan], parts: DecoderParts, precision: PrecisionPolicy
) -> ModelSource:
    """A source that builds this rank's stage models (``PipelineChunks``). It has no config, so
    the tracer finds the block stack in the built model and traces a few of its blocks."""

    def build() -> nn.Module:
        stages = {}
        for plan in plans:
            model = cut_stage(source.build(), plan, parts)
            model._pipeline_precision = precision
            stages[plan.name] = model
        return PipelineChunks(stages)

    return replace(source, build=build, config=None, builder=None)


# -- the engine (trace/engine.py) ---------------------------------------------------------------
class PipelineParallel:
    """The ``trace.engine.Engine`` of a pipeline-parallel run, as rank ``rank``: the model built
    as that rank's stage(s), run under the real schedule on a fake process group of the whole
    mesh (``mesh.fake_mesh``), the stage's inner axes applied by ``mesh.apply_inner_parallelism``.
    """

    def __init__(self, spec: TrainingSpec, rank: int) -> None:
        check_pipeline_spec(spec)
        self.spec = spec
        self.rank_id = rank
        self.plans: list[StagePlan] = []

    def adapt(self, recipe: Recipe) -> Recipe:
        """This rank's stage models, and the step's batch: ``microbatches`` micro-batches of
        ``batch_size`` examples. Under FSDP2 the fp32 shards are the master weights."""
        check_pipeline_recipe(recipe)
        hidden_dtype = recipe.precision.param_dtype
        if fsdp_degree(self.spec) > 1:
            recipe = adapt_recipe(recipe)
        depth = config_depth(recipe.source.config)
        parts = decoder_parts(_one_block_model(recipe))
        self.plans = rank_stage_plans(self.spec, self.rank_id, depth)
        source = stage_source(recipe.source, self.plans, parts, recipe.precision)
        spec = replace(recipe.spec, batch_size=self.spec.batch_size * microbatches(self.spec))
        self.hidden_dtype = hidden_dtype
        return replace(recipe, source=source, spec=spec)

    @contextlib.contextmanager
    def rank(self, rank: int) -> Iterator[PipelineRank]:
        if rank != self.rank_id:
            raise ValueError(f"this engine builds rank {self.rank_id}'s stages, not rank {rank}'s")
        with fake_mesh(rank, self.spec) as mesh:
            yield PipelineRank(
                spec=self.spec, rank=rank, mesh=mesh, plans=self.plans, fake=True,
                hidden_dtype=self.hidden_dtype,
            )  # fmt: skip

    def finish(self, timeline: Timeline, recipe: Recipe) -> list[str]:
        return DataParallel(self.spec).finish(timeline, recipe)


def check_pipeline_spec(spec: TrainingSpec) -> None:
    """What the pipeline engine runs: a known schedule's micro-batch count; the other axes
    that are modelled with it."""
    m = microbatches(spec)
    if spec.pp_schedule == "1f1b" and m < spec.pp:
        raise InputError(
            f"1F1B needs at least as many micro-batches as stages ({spec.pp}), not {m}",
            hint=f"use --microbatches {spec.pp} or more",
        )
    if spec.pp_schedule == "interleaved-1f1b":
        rounds = max(1, m // spec.pp)
        if m % rounds:
            raise InputError(
                f"interleaved 1F1B needs the micro-batches to be a multiple of "
                f"{rounds} (micro-batches // pp), not {m}",
                hint=f"use --microbatches {rounds * spec.pp}",
            )
    if spec.cp > 1 or spec.ep > 1:
        axis = "context" if spec.cp > 1 else "expert"
        raise InputError(
            f"pipeline parallelism with {axis} parallelism is not modelled yet (with tensor "
            "parallelism and FSDP2 over the data-parallel axis it is)",
            hint=f"drop --{'cp' if spec.cp > 1 else 'ep'}, or estimate without --pp",
        )
    if spec.tp > 1 and spec.tp_plan is not None:
        raise InputError(
            "--tp-plan with pipeline parallelism: the hidden states between stages are sent as "
            "the default plan leaves them (each rank's part of the sequence), which a user plan "
            "need not do",
            hint="drop --tp-plan to use the model family's plan",
        )
    if spec.tp > 1 and spec.seq_len % spec.tp:
        raise InputError(
            f"sequence parallelism between pipeline stages splits the sequence ({spec.seq_len}) "
            f"over the {spec.tp} tensor-parallel ranks evenly",
            hint=f"use a --seq-len that is a multiple of {spec.tp}",
        )
    if spec.grad_accum > 1:
        raise InputError(
            "--grad-accum with pipeline parallelism: the micro-batches are the accumulation",
            hint="use --microbatches",
        )
    if spec.dp_degree > 1 and not spec.parallelism.shards_params:
        raise InputError(
            f"--strategy {spec.strategy} with pipeline parallelism is not modelled",
            hint="use fsdp over the data-parallel axis",
        )


def check_pipeline_recipe(recipe: Recipe) -> None:
    spec = recipe.spec
    if recipe.source.config is None or config_depth(recipe.source.config) is None:
        raise InputError(
            "pipeline stages are built from a Hugging Face decoder config",
            hint="give a config.json of a causal LM",
        )
    if recipe.source.task != "causal-lm":
        raise InputError(
            f"pipeline parallelism is modelled for causal LMs, not {recipe.source.task}"
        )
    if spec.loss is not None or spec.inputs is not None:
        raise InputError(
            "pipeline parallelism runs the model's own loss on its default batch",
            hint="drop --loss and --inputs",
        )
    if spec.lora is not None or spec.quantize is not None:
        raise InputError("LoRA and quantized weights with pipeline parallelism are not modelled")


def _one_block_model(recipe: Recipe) -> nn.Module:
    """The model with one layer, on the meta device, to find its parts (built the one way every
    trace builds it: ``Recipe.at_depth``)."""
    return recipe.at_depth(1).build_model("meta")


@dataclass
class PipelineRank:
    """One rank's stages in a run (a ``trace.engine.RankEngine`` that builds its own step; the
    same object builds a real run's)."""

    spec: TrainingSpec
    rank: int
    mesh: Any
    plans: list[StagePlan]
    fake: bool
    hidden_dtype: torch.dtype
    notes: list[str] = field(default_factory=list)

    @property
    def _inner(self) -> MeshRankEngine:
        return MeshRankEngine(spec=self.spec, rank=self.rank, mesh=self.mesh)

    @property
    def op_categories(self) -> dict[str, Category]:
        return self._inner.op_categories

    @property
    def resize_category(self) -> Category | None:
        return self._inner.resize_category

    def inner_spec(self) -> TrainingSpec:
        """FSDP2 under pipeline parallelism keeps each unit's parameters from its forward to its
        backward unless asked otherwise (torchtitan's ``reshard_after_forward`` default)."""
        if fsdp_degree(self.spec) > 1 and self.spec.reshard_after_forward is None:
            return replace(self.spec, reshard_after_forward=False)
        return self.spec

    def wrap(self, model: nn.Module, blocks: list[nn.Module], precision_name: str) -> nn.Module:
        """Each stage model's inner axes (tensor and sequence parallelism with the family's
        plan, then FSDP2 over the data-parallel ranks), as torchtitan applies its
        ``parallelize_fn`` to each model part. Under tensor parallelism each stage is told the
        tensor-parallel mesh its hidden states are split over along the sequence
        (``_stage_forward``)."""
        chunks = list(model.children())
        words: list[str] = []
        if fsdp_degree(self.spec) > 1 or self.spec.tp > 1:
            outside = meshes_outside_the_trace() if self.fake else contextlib.nullcontext()
            with outside:
                for chunk in chunks:
                    mine = blocks if len(chunks) == 1 else []
                    apply_inner_parallelism(
                        chunk, self.mesh, self.inner_spec(), mine, precision_name
                    )
                    if self.spec.tp > 1:
                        chunk._pipeline_sequence_mesh = self.mesh["tp"]
            words.extend(applied(chunks[-1]).words)
        if self.spec.tp > 1:
            words.append(
                "the hidden states between stages sent as each tensor-parallel rank's part of "
                "the sequence (sequence parallel, as torchtitan sends them)"
            )
        coords = ", ".join(f"{k} {v}" for k, v in mesh_coords(self.rank, self.spec).items())
        stages = "; ".join(p.words() for p in self.plans)
        self.notes.append(
            f"rank {self.rank} ({coords}) holds pipeline {stages}; "
            + "; ".join(words or ["no data-parallel sharding"])
        )
        return model

    def owned(self, params: list[nn.Parameter]) -> list[nn.Parameter]:
        return params

    def add_buckets(self, model: nn.Module, track: Any) -> None:
        pass

    def assemble(self, *, model: nn.Module, batch: Any, **kwargs: Any) -> PipelineRun:
        """training.py's pieces (parameters, inputs, master weights, optimizer) around the stage
        models, and the schedule over them."""
        run = assemble(model=model, batch=batch, **{**kwargs, "grad_accum": 1})
        return build_pipeline_run(run, self, batch)


# -- the step -----------------------------------------------------------------------------------
@dataclass(kw_only=True)
class PipelineRun(TrainingRun):
    """A rank's stages under the schedule, ready to step (``TrainingRun``'s interface)."""

    schedule: Any
    stages: list[Any]
    inputs: tuple[Any, ...]
    """What the first stage is given: the step's token ids (the schedule splits them)."""
    target: Any
    """What the last stage's loss is given: the step's labels."""
    current_step: int = 0
    observer: Any = None
    fake: bool = False
    loss_parallel: bool = False
    """The last stage's logits stay split over the vocabulary (the tensor-parallel plan's loss
    parallel): the step runs under ``loss_parallel()``, its loss and backward included."""

    def step(self, step: int, observer: Any) -> None:
        self.current_step, self.observer = step, observer
        observer.phase(step, Phase.OPTIMIZER)
        self.optimizer.zero_grad(set_to_none=True)
        self.model.zero_grad(set_to_none=True)
        losses: list[torch.Tensor] | None = [] if any(s.is_last for s in self.stages) else None
        # the schedule's set-up (first step) and its first action are forward
        observer.phase(step, Phase.FORWARD)
        with contextlib.ExitStack() as context:
            if self.fake:
                context.enter_context(works_hold_tensors())
            if self.loss_parallel:
                from torch.distributed.tensor.parallel import loss_parallel

                context.enter_context(loss_parallel())
            self.schedule.step(
                *self.inputs,
                target=self.target if losses is not None else None,
                losses=losses,
                return_outputs=False,
            )
        if step == 1:
            observer.tensors(receive_buffers(self.stages), Category.PIPELINE_BUFFERS)
        if self.record_losses:
            self.losses.append(sum(float(v.detach().float().item()) for v in losses or []))
        del losses
        track_by_kind(observer, (p.grad for p in self.params), grad_category)
        observer.phase(step, Phase.OPTIMIZER)
        self._optimizer_step(observer)
        observer.optimizer_stepped(self.optimizer)


class _HeldWorks(list):
    """A batch of send and receive works that keeps the tensors it moves."""

    tensors: list[torch.Tensor]


@contextlib.contextmanager
def works_hold_tensors() -> Iterator[None]:
    """The works of the schedule's sends and receives keep their tensors until they are
    dropped, as a real process group's do (gloo's ``SendWork``/``RecvWork`` hold their tensor
    until destroyed), and the schedule keeps some works for a while (1F1B's ``send_work`` until
    its next send, GPipe's ``fwd_sends_to_wait``/``bwd_sends_to_wait`` to the end of the step):
    a stage output it has sent outlives its backward. A fake process group's works hold
    nothing; here they do (``schedules._batch_p2p``, every batch of sends and receives)."""
    from torch.distributed.pipelining import schedules

    original = schedules._batch_p2p

    def batch_p2p(p2p_ops: list[Any], desc: str | None = None) -> list[Any]:
        works = _HeldWorks(original(p2p_ops, desc))
        works.tensors = [op.tensor for op in p2p_ops]
        return works

    schedules._batch_p2p = batch_p2p
    try:
        yield
    finally:
        schedules._batch_p2p = original


def unsharded_gradients(model: nn.Module) -> list[torch.Tensor]:
    """The gradients FSDP2 accumulates unsharded between micro-batches when the schedule turns
    its reduction off (``set_requires_gradient_sync(False)`` until the last backward): each
    parameter's ``unsharded_accumulated_grad`` (in the reduce dtype) or unsharded ``.grad``."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    out = []
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        group = fully_shard.state(module)._fsdp_param_group
        for param in group.fsdp_params if group is not None else ():
            unsharded = getattr(param, "_unsharded_param", None)
            for grad in (param.unsharded_accumulated_grad, getattr(unsharded, "grad", None)):
                if grad is not None:
                    out.append(grad)
    return out


def receive_buffers(stages: Sequence[Any]) -> list[torch.Tensor]:
    """The stages' receive buffers: activations from the previous stage, gradients from the
    next, one per micro-batch (``_RecvInfo.buffer``)."""
    out = []
    for stage in stages:
        for infos in (*stage.args_recv_info.values(), *stage.grad_recv_info.values()):
            out.extend(i.buffer for i in infos if not i.is_root_arg and i.buffer is not None)
    return out


def build_pipeline_run(run: TrainingRun, rank: PipelineRank, batch: dict[str, Any]) -> PipelineRun:
    """The ``PipelineStage`` of each stage model on the mesh's pipeline group, and the
    schedule over them, around ``run``'s model, optimizer and precision."""
    from torch.distributed import pipelining
    from torch.distributed.pipelining.stage import InferenceMode

    spec, m = rank.spec, microbatches(rank.spec)
    ids, labels = batch["input_ids"], batch["labels"]
    micro = ids.shape[0] // m
    chunks = dict(run.model.named_children())
    group = rank.mesh["pp"].get_group()
    stages = []
    for plan in rank.plans:
        chunk = chunks[plan.name]
        inp, out = stage_shapes(
            chunk, plan, micro, ids.shape[1], rank.hidden_dtype, sequence_shards=spec.tp
        )
        stage = pipelining.PipelineStage(
            chunk, plan.index, plan.num_stages, ids.device,
            input_args=inp, output_args=out, group=group,
        )  # fmt: skip
        stages.append(stage)
    last = chunks[rank.plans[-1].name]
    cls = getattr(pipelining, SCHEDULE_CLASSES[spec.pp_schedule])
    loss_fn = pipeline_loss(last, m, run)
    schedule = cls(stages if len(stages) > 1 else stages[0], m, loss_fn=loss_fn, scale_grads=False)
    if rank.fake:
        # The warm-up vote reads what the neighbouring stages send (schedules.py _warmup_p2p:
        # result.item()); a fake process group delivers nothing and fake tensors have no values.
        # Every stage is built with its shapes, so every rank's vote comes out STATIC.
        def vote(stages: list[Any], has_backward: bool, p2p_done: bool) -> None:
            for stage in stages:
                stage._inference_mode = InferenceMode.STATIC

        schedule._warmup_p2p = vote
    pipeline = PipelineRun(
        **{f: getattr(run, f) for f in TrainingRun.__dataclass_fields__ if f != "losses"},
        schedule=schedule,
        stages=stages,
        inputs=(ids,) if any(s.is_first for s in stages) else (),
        target=labels,
        fake=rank.fake,
        loss_parallel=applied(last).loss_parallel and rank.plans[-1].last,
    )
    for stage in stages:
        _observe(stage, pipeline, rank.hidden_dtype)
    rank.notes.append(
        f"pipeline: torch.distributed.pipelining's {cls.__name__} over {spec.pp} pipeline ranks "
        f"({rank.plans[0].num_stages} stages), {m} micro-batches of {micro} example(s) per step"
        + (
            " on a fake process group; its warm-up vote (schedules.py _warmup_p2p, which reads "
            "the neighbouring stages' votes) answered STATIC, every rank's vote, since each "
            "stage is built with its input and output shapes"
            if rank.fake
            else ""
        )
    )
    return pipeline


def stage_shapes(
    chunk: nn.Module,
    plan: StagePlan,
    micro: int,
    seq_len: int,
    hidden_dtype: torch.dtype,
    sequence_shards: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One micro-batch's input and output of a stage, on the meta device: token ids into the
    first, hidden states between stages (in the dtype the model is stored in: the residual
    stream's, fp32 under autocast; under sequence parallelism each tensor-parallel rank's part
    of the sequence, ``seq_len / sequence_shards``), logits out of the last (never sent: the
    schedule gives them to the loss, and does not check their shape)."""
    config = chunk.config.get_text_config()
    hidden = torch.empty(
        micro,
        seq_len // sequence_shards,
        config.hidden_size,
        dtype=hidden_dtype,
        device="meta",
        requires_grad=True,
    )
    ids = torch.empty(micro, seq_len, dtype=torch.long, device="meta")
    inp = ids if plan.first else hidden
    if plan.last:
        out = torch.empty(
            micro, seq_len, config.vocab_size, dtype=hidden_dtype, device="meta", requires_grad=True
        )
    else:
        out = hidden
    return inp, out


def pipeline_loss(model: nn.Module, m: int, run: TrainingRun) -> Any:
    """The schedule's ``loss_fn``: the model's own ``loss_function`` on the last stage's
    logits, divided by the micro-batches (with ``scale_grads=False``, torchtitan's
    ``rescale_accumulated_loss``), scaled for fp16 as training.py scales its loss."""
    vocab = model.config.get_text_config().vocab_size

    def loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        with autocast(run.precision, logits.device.type):
            value = model.loss_function(logits=logits, labels=labels, vocab_size=vocab) / m
        if run.grad_scaler is not None:
            return run.grad_scaler.scale(value)
        if run.loss_scaler is not None:
            return run.loss_scaler.scale_loss(value)
        return value

    return loss


def _observe(stage: Any, run: PipelineRun, hidden_dtype: torch.dtype) -> None:
    """Tell the observer where each of the schedule's forwards and backwards begins (the
    stage's own ``forward_one_chunk`` / ``backward_one_chunk``, as the schedule calls them),
    and check the stage's first output against the shape it was built with."""
    forward, backward = stage.forward_one_chunk, stage.backward_one_chunk
    checked = []

    def forward_one_chunk(*args: Any, **kwargs: Any) -> Any:
        run.observer.phase(run.current_step, Phase.FORWARD)
        out = forward(*args, **kwargs)
        if not checked and not stage.is_last:
            want = stage._stage_meta.outputs[0]
            if tuple(out.shape) != tuple(want.shape) or out.dtype != want.dtype:
                raise InputError(
                    f"pipeline stage {stage.stage_index} returned {tuple(out.shape)} "
                    f"{out.dtype}, not the hidden states {tuple(want.shape)} {want.dtype} it was "
                    "built to send",
                    hint="this model's hidden states between layers are not modelled",
                )
            checked.append(True)
        return out

    def backward_one_chunk(*args: Any, **kwargs: Any) -> Any:
        run.observer.phase(run.current_step, Phase.BACKWARD)
        out = backward(*args, **kwargs)
        run.observer.tensors(unsharded_gradients(stage.submod), Category.GRADIENTS)
        return out

    stage.forward_one_chunk = forward_one_chunk
    stage.backward_one_chunk = backward_one_chunk


__all__ = [
    "PipelineParallel",
    "PipelineRank",
    "PipelineRun",
    "StagePlan",
    "pipeline_rank_groups",
    "rank_stage_plans",
    "stage_layers",
]
