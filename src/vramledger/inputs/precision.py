"""Precision modes: what dtype the model lives in, whether autocast runs, who keeps fp32 copies.

The names are the frameworks' own, with their meanings (Lightning's ``precision=``; the
master-weight modes are DeepSpeed's and Megatron's layout, named for what they keep):

=============  ==========  ========  ==============  ============  =============================
mode           parameters  autocast  master weights  loss scaling  the same setup elsewhere
=============  ==========  ========  ==============  ============  =============================
fp32           fp32        —         —               —             Lightning ``32-true``
bf16-mixed     fp32        bf16      —               —             Lightning ``bf16-mixed``, HF
                                                                   Trainer ``bf16=True``,
                                                                   accelerate ``bf16``
16-mixed       fp32        fp16      —               GradScaler    Lightning ``16-mixed``, HF
                                                                   Trainer ``fp16=True``,
                                                                   accelerate ``fp16``
bf16-true      bf16        —         —               —             Lightning ``bf16-true``
bf16-master    bf16        —         fp32            —             DeepSpeed ``bf16``, Megatron
fp16-master    fp16        —         fp32            dynamic       DeepSpeed ``fp16``, apex O2
=============  ==========  ========  ==============  ============  =============================

``*-mixed`` is native ``torch.autocast`` (parameters stay fp32; autocast caches half copies of
the weights for the duration of the autocast region). ``*-master`` is the DeepSpeed layout (its
FP16/BF16 optimizer without ZeRO): the model and its gradients are half precision, the
optimizer steps fp32 master weights; for the step the half gradients are cast to fp32 gradients
of the masters — temporaries of the step, freed after it — and the masters are copied back into
the model. Model states are thus 2 + 2 + 4 + optimizer bytes per parameter (16 for Adam), the
accounting of the ZeRO paper.

Until 2026-12 vramledger called autocast ``bf16-autocast``/``fp16-autocast`` and the master
modes ``bf16-mixed``/``fp16-mixed``: :data:`RENAMED` refuses the old spellings that no longer
exist, saying what they are called now.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from vramledger.inputs.errors import InputError

Precision = Literal["fp32", "bf16-mixed", "16-mixed", "bf16-true", "bf16-master", "fp16-master"]


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
    models: str = ""
    """The setup this mode models, in the words of the frameworks that run it (for the notes)."""


_MODES: tuple[tuple[str, torch.dtype, torch.dtype | None, bool, bool], ...] = (
    # name, parameter dtype, autocast dtype, fp32 master weights, loss scaling
    ("fp32", torch.float32, None, False, False),
    ("bf16-mixed", torch.float32, torch.bfloat16, False, False),
    ("16-mixed", torch.float32, torch.float16, False, True),
    ("bf16-master", torch.bfloat16, None, True, False),
    ("fp16-master", torch.float16, None, True, True),
    ("bf16-true", torch.bfloat16, None, False, False),
)
"""The module docstring's table, a row a mode (in the order ``--precision`` lists them)."""

_MODELS: dict[str, str] = {
    "fp32": "fp32 weights and compute (Lightning 32-true; HF Trainer and accelerate with no mixed precision)",
    "bf16-mixed": "torch.autocast to bf16 over fp32 weights (Lightning bf16-mixed, HF Trainer bf16=True, accelerate mixed_precision bf16)",
    "16-mixed": "torch.autocast to fp16 over fp32 weights with a GradScaler (Lightning 16-mixed, HF Trainer fp16=True, accelerate mixed_precision fp16)",
    "bf16-master": "bf16 weights and gradients, the optimizer stepping an fp32 master copy (DeepSpeed bf16, Megatron bf16)",
    "fp16-master": "fp16 weights and gradients, the optimizer stepping an fp32 master copy, dynamic loss scaling (DeepSpeed fp16, apex O2)",
    "bf16-true": "bf16 weights, gradients and optimizer state, no fp32 copy (Lightning bf16-true)",
}
"""What each mode models, in the frameworks' words (:attr:`PrecisionPolicy.models`)."""

PRECISIONS: dict[str, PrecisionPolicy] = {
    name: PrecisionPolicy(
        name=name,
        param_dtype=params,
        autocast_dtype=autocast,
        master_weights=master,
        loss_scaling=scaling,
        models=_MODELS[name],
    )
    for name, params, autocast, master, scaling in _MODES
}


ALIASES: dict[str, str] = {
    "32-true": "fp32",
    "32": "fp32",
    "bf16": "bf16-mixed",
    "16": "16-mixed",
    "fp16": "16-mixed",
}
"""Other frameworks' spellings of the same modes: Lightning's ``32-true`` and its legacy
``32``/``16``/``bf16`` (``lightning/fabric/connector.py``: 16 -> 16-mixed, bf16 -> bf16-mixed),
accelerate's ``mixed_precision`` values ``bf16``/``fp16`` (autocast over fp32 weights)."""

RENAMED: dict[str, str] = {
    "bf16-autocast": "bf16-mixed",
    "fp16-autocast": "16-mixed",
    "bf16-pure": "bf16-true",
    "fp16-mixed": "fp16-master",
}
"""vramledger's spellings before the frameworks' names were taken (2026-12): refused with the
new name. ``bf16-mixed`` itself changed meaning (it was the master-weight mode, now
``bf16-master``); see :func:`canonical_precision`."""


def canonical_precision(name: str) -> str:
    """The mode a name means (frameworks' aliases resolved); an old vramledger spelling or an
    unknown name is refused with what to write instead."""
    if name in PRECISIONS:
        return name
    if name in ALIASES:
        return ALIASES[name]
    if name in RENAMED:
        new = RENAMED[name]
        raise InputError(
            f"precision {name!r} is now called {new!r}: {PRECISIONS[new].models}",
            hint=f"write --precision {new} (bf16-mixed now means autocast over fp32 weights, as in "
            "Lightning; fp32 master weights are bf16-master / fp16-master)",
        )
    if name == "16-true":
        raise InputError(
            "precision '16-true' (fp16 weights with no master copy and no loss scaling) is not "
            "modelled",
            hint="use bf16-true, or fp16-master for fp16 weights with an fp32 master copy",
        )
    raise InputError(f"unknown precision {name!r}", hint=f"use one of {', '.join(PRECISIONS)}")


def precision_policy(name: str) -> PrecisionPolicy:
    return PRECISIONS[canonical_precision(name)]


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
