"""One pipeline rank in a run (``PipelineRank``, a ``trace.engine.RankEngine``): its stage
models given the run's inner axes, and its step built as ``PipelineStage`` objects under the
schedule, the same for an estimate and a real run (``pipeline.py`` says how the stages run)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from vramledger.inputs.categories import Category, Phase
from vramledger.inputs.errors import InputError
from vramledger.inputs.precision import autocast
from vramledger.inputs.spec import TrainingSpec
from vramledger.inputs.training import TrainingRun, assemble
from vramledger.parallel.mesh import (
    MeshRankEngine,
    applied,
    apply_inner_parallelism,
    fsdp_degree,
    mesh_coords,
    meshes_outside_the_trace,
)
from vramledger.parallel.pipeline_stages import StagePlan, microbatches
from vramledger.parallel.pipeline_step import PipelineRun, unsharded_gradients

SCHEDULE_CLASSES: dict[str, str] = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved-1f1b": "ScheduleInterleaved1F1B",
}
"""``--pp-schedule`` -> its class in ``torch.distributed.pipelining``."""


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
        (``pipeline_models._stage_forward``)."""
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
