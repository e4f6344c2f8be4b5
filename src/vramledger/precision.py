"""Precision modes: what dtype the model lives in, whether autocast runs, who keeps fp32 copies.

=================  ============  ==========  ==============  ============
mode               parameters    autocast    master weights  loss scaling
=================  ============  ==========  ==============  ============
fp32               fp32          —           —               —
bf16-autocast      fp32          bf16        —               —
fp16-autocast      fp32          fp16        —               GradScaler
bf16-mixed         bf16          —           fp32            —
fp16-mixed         fp16          —           fp32            dynamic
bf16-pure          bf16          —           —               —
=================  ============  ==========  ==============  ============

``*-autocast`` is native ``torch.autocast`` (parameters stay fp32; autocast caches half copies
of the weights for the duration of the autocast region). ``*-mixed`` is the DeepSpeed layout
(its FP16/BF16 optimizer without ZeRO): the model and its gradients are half precision, the
optimizer steps fp32 master weights; for the step the half gradients are cast to fp32
gradients of the masters — temporaries of the step, freed after it — and the masters are copied
back into the model. Model states are thus 2 + 2 + 4 + optimizer bytes per parameter (16 for
Adam), the accounting of the ZeRO paper.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from .errors import InputError

Precision = Literal[
    "fp32", "bf16-autocast", "fp16-autocast", "bf16-mixed", "fp16-mixed", "bf16-pure"
]


@dataclass(frozen=True, kw_only=True)
class PrecisionPolicy:
    name: str
    param_dtype: torch.dtype
    """dtype of the model's floating-point parameters and buffers."""
    autocast_dtype: torch.dtype | None
    """dtype torch.autocast computes in, or None for no autocast."""
    master_weights: bool
    """Keep fp32 master copies that the optimizer steps."""
    loss_scaling: bool
    """Scale the loss (fp16 only: its range is too small for small gradients)."""


PRECISIONS: dict[str, PrecisionPolicy] = {
    "fp32": PrecisionPolicy(
        name="fp32",
        param_dtype=torch.float32,
        autocast_dtype=None,
        master_weights=False,
        loss_scaling=False,
    ),
    "bf16-autocast": PrecisionPolicy(
        name="bf16-autocast",
        param_dtype=torch.float32,
        autocast_dtype=torch.bfloat16,
        master_weights=False,
        loss_scaling=False,
    ),
    "fp16-autocast": PrecisionPolicy(
        name="fp16-autocast",
        param_dtype=torch.float32,
        autocast_dtype=torch.float16,
        master_weights=False,
        loss_scaling=True,
    ),
    "bf16-mixed": PrecisionPolicy(
        name="bf16-mixed",
        param_dtype=torch.bfloat16,
        autocast_dtype=None,
        master_weights=True,
        loss_scaling=False,
    ),
    "fp16-mixed": PrecisionPolicy(
        name="fp16-mixed",
        param_dtype=torch.float16,
        autocast_dtype=None,
        master_weights=True,
        loss_scaling=True,
    ),
    "bf16-pure": PrecisionPolicy(
        name="bf16-pure",
        param_dtype=torch.bfloat16,
        autocast_dtype=None,
        master_weights=False,
        loss_scaling=False,
    ),
}


def precision_policy(name: str) -> PrecisionPolicy:
    try:
        return PRECISIONS[name]
    except KeyError:
        raise InputError(
            f"unknown precision {name!r}", hint=f"use one of {', '.join(PRECISIONS)}"
        ) from None


def cast_model(model: nn.Module, policy: PrecisionPolicy) -> None:
    """Store floating-point parameters and buffers in the policy's dtype (in place), whatever
    dtype the model was built in: the precision mode decides it."""
    if any(p.is_floating_point() and p.dtype != policy.param_dtype for p in model.parameters()):
        model.to(policy.param_dtype)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@contextlib.contextmanager
def autocast(policy: PrecisionPolicy, device_type: str) -> Iterator[None]:
    if policy.autocast_dtype is None:
        yield
        return
    with torch.autocast(device_type=device_type, dtype=policy.autocast_dtype):
        yield


class MasterWeights:
    """fp32 master copies of a half-precision model's parameters.

    The optimizer is built over :attr:`masters`. Before each step, :meth:`grads_to_masters`
    casts each half gradient to fp32 on its master (the half gradients stay until the next
    ``zero_grad``); after the step, :meth:`masters_to_model` copies the masters back and frees
    their gradients.
    """

    def __init__(self, params: list[nn.Parameter]) -> None:
        self.params = params
        with torch.no_grad():
            self.masters = [p.detach().to(torch.float32) for p in params]

    def grads_to_masters(self) -> None:
        for p, master in zip(self.params, self.masters, strict=True):
            if p.grad is None:
                master.grad = None
                continue
            master.grad = p.grad.to(torch.float32)

    def master_grads(self) -> list[torch.Tensor]:
        return [m.grad for m in self.masters if m.grad is not None]

    def masters_to_model(self) -> None:
        with torch.no_grad():
            for p, master in zip(self.params, self.masters, strict=True):
                p.copy_(master)
                master.grad = None


class DynamicLossScaler:
    """Loss scaling for fp16 master-weight training (the DeepSpeed/apex dynamic scaler, reduced
    to what touches memory: one scale, a found-inf flag, an in-place unscale of fp32 grads)."""

    INITIAL_SCALE = 2.0**16
    """DeepSpeed's default ``initial_scale_power`` of 16."""

    def __init__(self, device: torch.device) -> None:
        self.scale = self.INITIAL_SCALE
        self.found_inf = torch.zeros(1, device=device)
        self.inv_scale = torch.full((1,), 1.0 / self.scale, device=device)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale

    def unscale_(self, grads: list[torch.Tensor]) -> bool:
        """Unscale in place; True when the step may be taken (no inf/nan found)."""
        self.found_inf.zero_()
        torch._amp_foreach_non_finite_check_and_unscale_(grads, self.found_inf, self.inv_scale)
        if is_fake(self.found_inf):
            return True  # a fake run takes every step: the memory is the same either way
        return not bool(self.found_inf.item())


def is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)
