"""The training step both the tracer and the measurer execute, unchanged.

Per step: ``optimizer.zero_grad(set_to_none=True)``; for each of ``grad_accum`` micro-steps,
forward and loss (under autocast if the precision asks), ``backward()``; then the precision's
step (unscale, cast gradients to the master weights, ``optimizer.step()``, copy back). An
observer is told where each phase begins, which tensors are gradients and which are optimizer
state, so the same code serves fake-tensor tracing and real measurement.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from vramledger.inputs.adapters import quantization_state
from vramledger.inputs.categories import Category, Phase
from vramledger.inputs.errors import InputError
from vramledger.inputs.optimizers import OptimizerChoice
from vramledger.inputs.precision import (
    DynamicLossScaler,
    MasterWeights,
    PrecisionPolicy,
    autocast,
    is_fake,
)
from vramledger.inputs.sources import LossFn, map_tensors, tensor_leaves


class StepObserver(Protocol):
    def phase(self, step: int, phase: Phase) -> None: ...

    def tensors(self, tensors: Iterable[torch.Tensor | None], category: Category) -> None: ...

    def optimizer_stepped(self, optimizer: torch.optim.Optimizer) -> None: ...

    def label(self, tensors: Iterable[torch.Tensor], text: str) -> None: ...


MASTER_GRADIENT = "fp32 gradient for the optimizer step"
"""Label of the fp32 copies of half gradients made for a master-weight step (temporaries)."""


class NullObserver:
    def phase(self, step: int, phase: Phase) -> None:
        pass

    def tensors(self, tensors: Iterable[torch.Tensor | None], category: Category) -> None:
        pass

    def optimizer_stepped(self, optimizer: torch.optim.Optimizer) -> None:
        pass

    def label(self, tensors: Iterable[torch.Tensor], text: str) -> None:
        pass


def cast_floating(batch: Any, dtype: torch.dtype) -> Any:
    """``batch`` with its floating-point tensors in ``dtype``."""
    return map_tensors(lambda t: t.to(dtype) if t.is_floating_point() else t, batch)


def _is_sharded(t: torch.Tensor) -> bool:
    """A DTensor shard (FSDP2): its local tensor is this rank's piece."""
    return type(t).__name__ == "DTensor"


def param_category(t: torch.Tensor) -> Category:
    return Category.SHARDED_PARAMETERS if _is_sharded(t) else Category.PARAMETERS


def grad_category(t: torch.Tensor) -> Category:
    return Category.SHARDED_GRADIENTS if _is_sharded(t) else Category.GRADIENTS


def track_by_kind(
    observer: StepObserver,
    tensors: Iterable[torch.Tensor | None],
    kind: Callable[[torch.Tensor], Category],
) -> None:
    present = [t for t in tensors if t is not None]
    for category in dict.fromkeys(kind(t) for t in present):
        observer.tensors((t for t in present if kind(t) is category), category)


def optimizer_state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return tensor_leaves(list(optimizer.state.values()))


@dataclass(kw_only=True)
class TrainingRun:
    """A model with its batch, loss, optimizer and precision, ready to step."""

    model: nn.Module
    batch: Any
    loss_fn: LossFn
    optimizer: torch.optim.Optimizer
    precision: PrecisionPolicy
    device_type: str
    grad_accum: int = 1
    masters: MasterWeights | None = None
    grad_scaler: Any = None
    loss_scaler: DynamicLossScaler | None = None
    record_losses: bool = False
    """Keep each step's loss (real runs only: it reads the value)."""
    losses: list[float] = field(default_factory=list)

    @property
    def params(self) -> list[nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def run(self, steps: int, observer: StepObserver) -> None:
        for step in range(1, steps + 1):
            self.step(step, observer)

    def step(self, step: int, observer: StepObserver) -> None:
        observer.phase(step, Phase.OPTIMIZER)
        self.optimizer.zero_grad(set_to_none=True)
        self.model.zero_grad(set_to_none=True)
        total = 0.0
        for _ in range(self.grad_accum):
            total += self._forward_backward(step, observer)
            track_by_kind(observer, (p.grad for p in self.params), grad_category)
        if self.record_losses:
            self.losses.append(total)
        observer.phase(step, Phase.OPTIMIZER)
        self._optimizer_step(observer)
        observer.optimizer_stepped(self.optimizer)

    def _forward_backward(self, step: int, observer: StepObserver) -> float:
        observer.phase(step, Phase.FORWARD)
        with autocast(self.precision, self.device_type):
            loss = self.loss_fn(self.model, self.batch)
        if self.grad_accum > 1:
            loss = loss / self.grad_accum
        value = float(loss.detach().float().item()) if self.record_losses else 0.0
        if self.grad_scaler is not None:
            loss = self.grad_scaler.scale(loss)
        elif self.loss_scaler is not None:
            loss = self.loss_scaler.scale_loss(loss)
        observer.phase(step, Phase.BACKWARD)
        loss.backward()
        return value

    def _optimizer_step(self, observer: StepObserver) -> None:
        if self.masters is not None:
            self.masters.grads_to_masters()
            grads = self.masters.master_grads()  # fp32 copies for the step: temporaries
            observer.label(grads, MASTER_GRADIENT)
            take_step = True
            if self.loss_scaler is not None:
                take_step = self.loss_scaler.unscale_(grads)
            if take_step:
                self.optimizer.step()
            self.masters.masters_to_model()
        elif self.grad_scaler is not None:
            scaler = self.grad_scaler
            if is_fake(scaler._scale):
                # GradScaler.step() reads found_inf with .item(), which fake tensors cannot
                # answer; unscale_ + step allocates exactly what step() would.
                scaler.unscale_(self.optimizer)
                self.optimizer.step()
            else:
                scaler.step(self.optimizer)
            scaler.update()
        else:
            self.optimizer.step()


def assemble(
    *,
    model: nn.Module,
    batch: Any,
    loss_fn: LossFn,
    optimizer: OptimizerChoice,
    precision: PrecisionPolicy,
    device: torch.device,
    grad_accum: int,
    observer: StepObserver,
    owned: Callable[[list[nn.Parameter]], list[nn.Parameter]] | None = None,
) -> TrainingRun:
    """Put a model (already on its device, in its dtype) together with everything a step needs,
    telling the observer which tensors are parameters, buffers, inputs and master weights.
    Floating-point inputs are cast to the model's dtype when the model is stored in half
    precision (``*-mixed``, ``bf16-true``), as a training script for such a model does."""
    if precision.param_dtype is not torch.float32:
        batch = cast_floating(batch, precision.param_dtype)
    track_by_kind(observer, model.parameters(), param_category)
    # bitsandbytes' quantization state (absmax, scales, codes) beside the packed weights
    observer.tensors(quantization_state(model.parameters()), Category.PARAMETERS)
    observer.tensors(model.buffers(), Category.BUFFERS)
    observer.tensors(tensor_leaves(batch), Category.INPUTS)
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise InputError(
            "nothing to train: every parameter of the model has requires_grad=False",
            hint="--quantize freezes the base weights as peft's prepare_model_for_kbit_training "
            "does, so add --lora (QLoRA trains adapters over them); with --freeze, leave some "
            "modules trainable",
        )
    if owned is not None:  # ZeRO-1: this rank's optimizer steps only its partition
        params = owned(params)
    masters = None
    if precision.master_weights:
        masters = MasterWeights(params)
        observer.tensors(masters.masters, Category.MASTER_WEIGHTS)
        opt = optimizer.build(masters.masters)
    else:
        opt = optimizer.build(params)
    grad_scaler = loss_scaler = None
    if precision.loss_scaling and precision.autocast_dtype is not None:
        grad_scaler = torch.amp.GradScaler(device.type)
    elif precision.loss_scaling:
        loss_scaler = DynamicLossScaler(device)
    return TrainingRun(
        model=model,
        batch=batch,
        loss_fn=loss_fn,
        optimizer=opt,
        precision=precision,
        grad_accum=grad_accum,
        masters=masters,
        grad_scaler=grad_scaler,
        loss_scaler=loss_scaler,
        device_type=device.type,
    )
