"""``torch.distributed.pipelining`` inside a user's program run as several ranks
(``program_world.py``), each rank traced in turn in this process on its own fake process group.

A program builds its ``PipelineStage`` (or several) and a schedule (``ScheduleGPipe``,
``Schedule1F1B``, ...) and calls ``schedule.step``. At its first step the schedule talks to the
neighbouring ranks before any activation moves, and a fake process group delivers nothing:

- **the warm-up vote** (``schedules.py`` ``_PipelineSchedule._warmup_p2p``): every stage votes
  STATIC (it was built with its shapes, ``input_args``/``output_args``) or DYNAMIC, the product
  is passed from the first stage to the last and back, and every stage takes the result. Here
  each rank's vote is its stages' own (``InferenceMode.needs_dynamic``, PyTorch's rule) times
  the votes of the ranks traced before it; a rank that assumed STATIC when a later rank voted
  DYNAMIC is traced again with the result (:meth:`StageMail.retrace`).
- **the shapes sent between stages** in DYNAMIC mode (``stage.py`` ``_send_meta`` /
  ``_recv_meta``: a ``_StageForwardMeta`` of the outputs, from stage to stage, then a
  ``_StageBackwardMeta`` of the input gradients, back): each meta a rank sends is kept
  (:class:`StageMail`; a stage built with its shapes, its outputs' and input gradients'), and
  a later rank's stage receives it. A rank receiving from a rank not
  yet traced (the gradients' shapes, from the next stage) gets what the schedule itself derives
  in STATIC mode for plain tensors: each output's gradient has the output's shape, strides and
  dtype (``_utils._derive_grad_metas``). A forward meta from a later rank (looped schedules,
  several stages per rank) and DTensors between stages in DYNAMIC mode are refused.

What the schedule holds is then as in the estimate's pipeline engine (``pipeline_step.py``): its
receive buffers (one per micro-batch from each neighbour, made at the first step and kept:
``pipeline_buffers``), and its sends' and receives' works holding their tensors as gloo's do
(``works_hold_tensors``). The metadata's own pickled bytes (a few hundred bytes, sent once at
the first step) and the vote's 4-byte tensors are not made here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any
from unittest import mock

import torch

from vramledger.inputs.categories import Category
from vramledger.inputs.errors import InputError
from vramledger.parallel.pipeline_step import receive_buffers, works_hold_tensors

Register = Callable[[list[torch.Tensor], Category], None]


@dataclass
class StageMail:
    """What the ranks of one program's pipeline told each other, kept across the ranks traced in
    turn: each forward meta sent (by source and destination stage), each rank's vote and the
    result it assumed."""

    metas: dict[tuple[int, int], Any] = field(default_factory=dict)
    votes: dict[int, int] = field(default_factory=dict)
    """Each traced rank's vote: 1 (its stages were built with their shapes) or 0."""
    assumed: dict[int, int] = field(default_factory=dict)
    """The result each rank was traced with."""

    def result(self, rank: int, own: int) -> int:
        """The vote's result as far as rank ``rank`` can know it: its own vote times those of
        the ranks traced before it (every rank's, on a retrace)."""
        self.votes[rank] = own
        known = [v for r, v in self.votes.items() if r != rank]
        answer = own * min(known, default=1)
        self.assumed[rank] = answer
        return answer

    def retrace(self) -> list[int]:
        """The ranks traced with a result that a later rank's vote changed."""
        final = min(self.votes.values(), default=1)
        return sorted(r for r, a in self.assumed.items() if a != final)


@contextlib.contextmanager
def program_pipelines(
    mail: StageMail, rank: int, register: Register, used: dict[str, None], notes: dict[str, None]
) -> Iterator[None]:
    """While the program runs as ``rank``: its schedules' vote and stage metadata answered from
    ``mail``, its stages' receive buffers tagged with ``register``; ``used`` gets 'pp' and
    ``notes`` what was set up."""
    from torch.distributed.pipelining import schedules, stage
    from torch.distributed.pipelining._utils import _StageBackwardMeta, _StageForwardMeta

    prepare_fwd = stage.PipelineStage.__dict__["_prepare_forward_infra"]
    prepare_bwd = stage.PipelineStage.__dict__["_prepare_backward_infra"]

    warmup = schedules._PipelineSchedule.__dict__["_warmup_p2p"]

    def warmup_p2p(schedule: Any, stages: list[Any], has_backward: bool, p2p_done: bool) -> None:
        used["pp"] = None
        if not all(isinstance(s, stage.PipelineStage) for s in stages):
            # the tracer front end's stages (``build_stage``) have their shapes from the traced
            # graph: no vote, their neighbours' ops only (no memory that stays)
            warmup(schedule, stages, has_backward, p2p_done)
            return
        own = min(
            0 if schedules.InferenceMode.needs_dynamic(s._user_meta, has_backward) else 1
            for s in stages
        )
        modes = schedules.InferenceMode
        mode = modes.STATIC if mail.result(rank, own) else modes.DYNAMIC
        for s in stages:
            s._inference_mode = mode
        notes[_schedule_note(schedule, stages, rank)] = None

    def send_meta(s: Any, meta: Any, dst_stage: int) -> None:
        mail.metas[(s.stage_index, dst_stage)] = meta

    def recv_meta(s: Any, src_stage: int) -> Any:
        if (src_stage, s.stage_index) in mail.metas:
            return mail.metas[(src_stage, s.stage_index)]
        if src_stage < s.stage_index:
            raise InputError(
                f"pipeline stage {s.stage_index} receives its input shapes from stage "
                f"{src_stage}, on a rank traced after this one (its shapes inferred at run "
                "time) — not modelled",
                hint="give each PipelineStage its input_args and output_args",
            )
        return _derived_grad_meta(s)

    def prepare_forward_infra(s: Any, *args: Any, **kwargs: Any) -> Any:
        out = prepare_fwd(s, *args, **kwargs)
        register(receive_buffers([s]), Category.PIPELINE_BUFFERS)
        if not s.is_last:  # what it sends in DYNAMIC mode (a retraced rank's neighbour reads it)
            sent = _StageForwardMeta(forward_metas=s._stage_meta.outputs)
            mail.metas.setdefault((s.stage_index, s.stage_index + 1), sent)
        return out

    def prepare_backward_infra(s: Any, *args: Any, **kwargs: Any) -> Any:
        out = prepare_bwd(s, *args, **kwargs)
        register(receive_buffers([s]), Category.PIPELINE_BUFFERS)
        if not s.is_first:
            sent = _StageBackwardMeta(backward_metas=s._stage_meta.input_grads)
            mail.metas.setdefault((s.stage_index, s.stage_index - 1), sent)
        return out

    pipeline_stage = stage.PipelineStage
    with (
        mock.patch.object(schedules._PipelineSchedule, "_warmup_p2p", warmup_p2p),
        mock.patch.object(pipeline_stage, "_send_meta", send_meta),
        mock.patch.object(pipeline_stage, "_recv_meta", recv_meta),
        mock.patch.object(pipeline_stage, "_prepare_forward_infra", prepare_forward_infra),
        mock.patch.object(pipeline_stage, "_prepare_backward_infra", prepare_backward_infra),
        works_hold_tensors(),
    ):
        yield


def _derived_grad_meta(s: Any) -> Any:
    """The gradients' shapes stage ``s`` would receive from the next stage: its outputs'
    (``_derive_grad_metas``, the schedule's own rule for plain tensors in STATIC mode)."""
    from torch.distributed.pipelining._utils import (
        _derive_grad_metas,
        _DTensorMeta,
        _StageBackwardMeta,
    )

    outputs = s._stage_meta.outputs
    if any(isinstance(m, _DTensorMeta) for m in outputs):
        raise InputError(
            f"pipeline stage {s.stage_index} sends DTensors, whose gradients' layouts are "
            "inferred at run time from the next stage — not modelled",
            hint="give each PipelineStage its input_args, output_args and grads",
        )
    return _StageBackwardMeta(backward_metas=_derive_grad_metas(outputs))


def _schedule_note(schedule: Any, stages: list[Any], rank: int) -> str:
    indices = ", ".join(str(s.stage_index) for s in stages)
    first = stages[0]
    mode = first._inference_mode.value
    how = (
        "were built with their shapes (STATIC)"
        if mode == "static"
        else "had their shapes inferred at the first step (DYNAMIC): the input shapes sent by the "
        "previous stage's rank, as its trace sent them; the gradients' from the next stage "
        "derived from this stage's outputs"
    )
    return (
        f"pipelining: the program's {type(schedule).__name__} ran stage {indices} of "
        f"{first.num_stages} on rank {rank}, {schedule._n_microbatches} micro-batches per step, "
        f"on a fake process group; its stages {how}; the warm-up vote answered from each rank's "
        "stages"
    )
