"""A pipeline rank's step: its stages under ``torch.distributed.pipelining``'s schedule
(``PipelineRun``), and what the schedule holds while it runs: the works of its sends and
receives, FSDP2's unsharded gradients between micro-batches, the stages' receive buffers
(``pipeline.py`` says how the stages run)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from vramledger.inputs.categories import Category, Phase
from vramledger.inputs.training import TrainingRun, grad_category, track_by_kind


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
