"""Operators whose output depends on values a trace knows (``values.py``): the shapes that
known boolean masks, lengths and indices give, and the range checks a real kernel makes on known
indices. Each handler takes the trace's ``values.KnownValues`` and the call, and returns the
call's fake outputs, or ``NotImplemented`` to let the operator run on fake tensors as it is.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.utils._python_dispatch import _disable_current_modes

from vramledger.inputs.errors import InputError

aten = torch.ops.aten


# -- operators whose output shape depends on the values of some (known) arguments --------------
def _index_from_masks(values: Any, indices: Any) -> tuple[list[Any], int] | None:
    """Boolean masks among ``indices`` (known) replaced by the long indices their nonzero gives,
    as the real kernel does (``expandTensors`` in aten/src/ATen/native/IndexingUtils.h); None if
    a mask is unknown. Also returns the bytes of those index tensors (kernel scratch)."""
    out: list[Any] = []
    scratch = 0
    for idx in indices:
        if isinstance(idx, torch.Tensor) and idx.dtype in (torch.bool, torch.uint8):
            if not values.known(idx):
                return None
            with _disable_current_modes(), unset_fake_temporarily():
                nz = values.value(idx).nonzero()
                columns = [nz[:, d].contiguous() for d in range(idx.dim())]
            scratch += nz.nbytes
            out.extend(values._fake_from_real(c) for c in columns)
        else:
            out.append(idx)
    return out, scratch


def _index(values: Any, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``index`` and the ``index_put`` family alike: their second argument, the indices, with
    each known boolean mask turned into its columns of positions."""
    found = _index_from_masks(values, args[1])
    if found is None:
        return NotImplemented
    indices, scratch = found
    values.pending_scratch += scratch
    return func(args[0], indices, *args[2:], **kwargs)


def _masked_select(values: Any, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    x, mask = args[0], args[1]
    if not values.known(mask):
        return NotImplemented
    shape = torch.broadcast_shapes(x.shape, mask.shape)
    with _disable_current_modes(), unset_fake_temporarily():
        count = int(values.value(mask).expand(shape).sum())
    return torch.empty((count,), dtype=x.dtype, device=x.device)


def _lengths(values: Any, t: Any) -> list[int] | None:
    if not isinstance(t, torch.Tensor) or not values.known(t):
        return None
    with _disable_current_modes(), unset_fake_temporarily():
        return [int(v) for v in values.value(t).tolist()]


def _ctc_loss(values: Any, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """CTC: its log-alpha buffer is (batch, time, 2 * longest target + 1), a size that depends
    on the target lengths. With them known, the outputs are made as the native kernels make them
    (``ctc_loss_cpu_template`` / ``ctc_loss_gpu_template`` in aten/src/ATen/native/LossCTC.cpp
    and cuda/LossCTC.cu); the backward returns the gradient of the log-probabilities and holds a
    log-beta buffer shaped like log-alpha while it runs."""
    backward = func in (aten._ctc_loss_backward.Tensor, aten._ctc_loss_backward.default)
    offset = 1 if backward else 0
    log_probs = args[offset]
    target_lengths = args[offset + 3]
    lengths = (
        _lengths(values, target_lengths)
        if isinstance(target_lengths, torch.Tensor)
        else list(target_lengths)
    )
    if lengths is None:
        return NotImplemented
    time_steps = log_probs.shape[0]
    batch = log_probs.shape[1] if log_probs.dim() == 3 else 1
    alpha = (batch, time_steps, 2 * max(lengths, default=0) + 1)
    if backward:
        values.pending_scratch += math.prod(alpha) * log_probs.element_size()
        # ``at::full_like(log_probs, neginf, LEGACY_CONTIGUOUS_MEMORY_FORMAT)`` in both
        # templates: contiguous in (time, batch, labels) even when log_probs is a transposed
        # view (a model's (batch, time, labels) log-softmax), so the log-softmax backward that
        # follows gets a non-contiguous gradient and copies it (``grad.contiguous()``, a
        # scratch buffer the CPU probe counts).
        return torch.empty_like(log_probs, memory_format=torch.contiguous_format)
    return (
        torch.empty((batch,), dtype=log_probs.dtype, device=log_probs.device),
        torch.empty(alpha, dtype=log_probs.dtype, device=log_probs.device),
    )


# -- bounds a real kernel checks on known indices --------------------------------------------
def _embedding(values: Any, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """A real embedding lookup fails on an id past the table; so does the trace, naming it."""
    weight, ids = args[0], args[1]
    if values.known(ids) and ids.numel():
        with _disable_current_modes(), unset_fake_temporarily():
            real = values.value(ids)
            high, low = int(real.max()), int(real.min())
        rows = weight.shape[0]
        if high >= rows or low < 0:
            module = values.module() or "an embedding"
            bad = high if high >= rows else low
            positions = "position" in module or module.endswith("wpe")
            raise InputError(
                f"the batch has {'position' if positions else 'token'} id {bad}, out of range of "
                f"the {rows} rows of {module}",
                hint=(
                    f"use --seq-len {rows} or less"
                    if values.seq_len_option
                    else f"the inputs function must make sequences of at most {rows} tokens"
                )
                if positions
                else f"ids must be in [0, {rows}) (the model's vocabulary); check the inputs function",
            )
    return NotImplemented


def _nll_loss(values: Any, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Labels past the number of classes fail in the real loss; so does the trace."""
    scores, target = args[0], args[1]
    ignore = args[4] if len(args) > 4 else kwargs.get("ignore_index", -100)
    classes = scores.shape[1] if scores.dim() > 1 else scores.shape[0]
    if values.known(target) and target.numel():
        with _disable_current_modes(), unset_fake_temporarily():
            real = values.value(target)
            real = real[real != ignore]
            high = int(real.max()) if real.numel() else 0
            low = int(real.min()) if real.numel() else 0
        if high >= classes or low < 0:
            raise InputError(
                f"the batch has label {high if high >= classes else low}, out of range of the "
                f"{classes} classes of the loss (in {values.module() or 'the loss'})",
                hint=f"labels must be in [0, {classes}) or {ignore} (ignored); check the inputs function",
            )
    return NotImplemented


PARTLY_KNOWN: dict[Any, Callable[[Any, Any, tuple[Any, ...], dict[str, Any]], Any]] = {
    aten.index.Tensor: _index,
    aten.index_put.default: _index,
    aten.index_put_.default: _index,
    aten._index_put_impl_.default: _index,
    aten.masked_select.default: _masked_select,
    aten.embedding.default: _embedding,
    aten._ctc_loss.Tensor: _ctc_loss,
    aten._ctc_loss.default: _ctc_loss,
    aten._ctc_loss_backward.Tensor: _ctc_loss,
    aten._ctc_loss_backward.default: _ctc_loss,
    aten.nll_loss_forward.default: _nll_loss,
    aten.nll_loss2d_forward.default: _nll_loss,
}
