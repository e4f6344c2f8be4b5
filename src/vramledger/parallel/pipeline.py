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

This module is the engine (``PipelineParallel``); the split into stages and the checks of a
pipeline spec are ``pipeline_stages.py``, the stage models ``pipeline_models.py``, a rank's
stages in a run and the schedule built over them ``pipeline_rank.py``, and the step under the
schedule ``pipeline_step.py``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import replace

from torch import nn

from vramledger.inputs.config_depth import config_depth
from vramledger.inputs.errors import InputError
from vramledger.inputs.recipe import Recipe, count_parameters
from vramledger.inputs.spec import TrainingSpec
from vramledger.parallel.engines import DataParallel, adapt_recipe
from vramledger.parallel.mesh import fake_mesh, fsdp_degree
from vramledger.parallel.pipeline_models import decoder_parts, stage_source
from vramledger.parallel.pipeline_rank import PipelineRank
from vramledger.parallel.pipeline_stages import (
    StagePlan,
    check_pipeline_spec,
    microbatches,
    pipeline_rank_groups,
    rank_stage_plans,
    stage_layers,
)
from vramledger.parallel.pipeline_step import PipelineRun
from vramledger.record.timeline import Timeline


class PipelineParallel:
    """The ``trace.engine.Engine`` of a pipeline-parallel run, as rank ``rank``: the model built
    as that rank's stage(s), run under the real schedule on a fake process group of the whole
    mesh (``mesh.fake_mesh``), the stage's inner axes applied by ``mesh.apply_inner_parallelism``.
    """

    def __init__(self, spec: TrainingSpec, rank: int) -> None:
        check_pipeline_spec(spec)
        # Imported before any trace: microbatch.py makes a tensor when it is first imported
        # (``sum_reducer = _LossReducer(torch.tensor(0.0), ...)``), which would be a storage of
        # the first trace in the process only, so the 4-block trace of the block extension had
        # one storage the 5-block trace had not and every pipeline stage was traced in full.
        import torch.distributed.pipelining.schedules  # noqa: F401

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


def whole_model_parameters(recipe: Recipe) -> tuple[int, int]:
    """(all, trainable) parameters of the whole model the stages are cut from, built on the
    meta device: a stage's model holds only its own layers, and a ledger's ``parameters`` are
    the model's (its per-parameter figures divide by them, as on FSDP's sharded ranks), with
    the stage's beside them (``Ledger.stage_parameters``). Tied embeddings count once, as in the
    model, though the first and last stages each hold a copy."""
    return count_parameters(recipe.build_model("meta"))


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


__all__ = [
    "PipelineParallel",
    "PipelineRank",
    "PipelineRun",
    "StagePlan",
    "pipeline_rank_groups",
    "rank_stage_plans",
    "stage_layers",
    "whole_model_parameters",
]
