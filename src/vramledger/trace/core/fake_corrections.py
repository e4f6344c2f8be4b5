"""Where a fake (meta) kernel differs from the real kernels.

``CORRECTIONS``: for these operators the meta implementation returns outputs of a different
dtype or layout than the real CPU and CUDA kernels; the tracker replaces those outputs by fake tensors of
the real dtype before anything sees them, so the ledger, the saved tensors and the backward all
match a real run. ``SUBSTITUTES``: for these the meta implementation refuses inputs the real
kernels accept; the tracker computes the output's shape itself. Each entry is checked against a
real CPU run in ``tests/test_ground_truth.py``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

aten = torch.ops.aten

Correction = Callable[[Sequence[Any], Any], Any]
"""(args, outputs) -> outputs as the real kernel returns them."""

_HALF = (torch.float16, torch.bfloat16)
BATCH_NORM_STATS_DTYPE = torch.float32
"""Batch-norm statistics of half-precision inputs are kept in float32, the accumulate type
(``at::acc_type``): CPU ``batch_norm_cpu`` in aten/src/ATen/native/Normalization.cpp and CUDA
``batch_norm_cuda`` allocate ``save_mean``/``save_invstd`` with the accumulate dtype; the meta
kernel uses the input's dtype."""


def _batch_norm_stats(args: Sequence[Any], out: Any) -> Any:
    x = args[0]
    if not isinstance(x, torch.Tensor) or x.dtype not in _HALF:
        return out
    fixed = list(out)
    for i in (1, 2):
        stat = fixed[i]
        if isinstance(stat, torch.Tensor) and stat.dtype in _HALF:
            fixed[i] = torch.empty(stat.shape, dtype=BATCH_NORM_STATS_DTYPE, device=stat.device)
    return type(out)(fixed)


LAYER_NORM_MIXED_STATS_DTYPE = torch.float32
"""Layer-norm statistics of a half-precision input normalised with float32 weight or bias (a
*mixed type*: autocast on CPU leaves ``layer_norm`` in bfloat16 over fp32 parameters) are kept
in float32: ``layer_norm_cpu`` (aten/src/ATen/native/layer_norm.cpp) allocates ``mean`` and
``rstd`` with ``param_scalar_type(input, mixed_type)``, which is ``toOpMathType`` of the
input's dtype when ``is_mixed_type(input, weight, bias)`` (a defined parameter's dtype differs
from the input's; aten/src/ATen/native/cpu/mixed_data_type.h). The reference that fake tensors run
(``native_layer_norm`` in torch/_refs/__init__.py) converts them to the input's dtype on CPU."""


def _layer_norm_stats(args: Sequence[Any], out: Any) -> Any:
    # native_layer_norm(input, normalized_shape, weight, bias, eps)
    return _mixed_norm_stats(args[0], args[2:4], out)


def _group_norm_stats(args: Sequence[Any], out: Any) -> Any:
    """GroupNorm's the same way: ``native_group_norm`` (aten/src/ATen/native/group_norm.cpp)
    allocates ``mean``/``rstd`` with ``param_scalar_type(X, mixed_type)`` (wav2vec2-conformer's
    feature encoder under bf16 autocast); the meta kernel gives the input's dtype."""
    # native_group_norm(input, weight, bias, N, C, HxW, group, eps)
    return _mixed_norm_stats(args[0], args[1:3], out)


def _mixed_norm_stats(x: Any, weights: Sequence[Any], out: Any) -> Any:
    params = [p for p in weights if isinstance(p, torch.Tensor)]
    if not isinstance(x, torch.Tensor) or x.dtype not in _HALF or not params:
        return out
    if params[0].dtype == x.dtype:  # is_mixed_type asks the first defined parameter
        return out
    fixed = list(out)
    for i in (1, 2):
        stat = fixed[i]
        if isinstance(stat, torch.Tensor) and stat.dtype != LAYER_NORM_MIXED_STATS_DTYPE:
            fixed[i] = torch.empty_strided(
                stat.shape, stat.stride(), dtype=LAYER_NORM_MIXED_STATS_DTYPE, device=stat.device
            )
    return type(out)(fixed)


def _layer_norm_grad_contiguous(args: Sequence[Any], out: Any) -> Any:
    """``native_layer_norm_backward``'s input gradient is contiguous: the CPU and CUDA kernels
    (``layer_norm_backward_cpu`` / ``layer_norm_backward_cuda`` in aten/src/ATen/native/
    layer_norm.cpp and cuda/layer_norm_kernel.cu) allocate it ``empty_like`` the contiguous
    input (``input.expect_contiguous()``); the meta kernel keeps the strides of a transposed
    input, so a convolution after a transposed LayerNorm (the wav2vec2 family's feature
    encoders) saw a contiguous gradient where the real one copies a strided one."""
    grad = out[0]
    if not isinstance(grad, torch.Tensor) or grad.is_contiguous():
        return out
    fixed = torch.empty(grad.shape, dtype=grad.dtype, device=grad.device)
    return type(out)((fixed, *out[1:]))


Substitute = Callable[..., Any]
"""(func, *args, **kwargs) -> outputs as the real kernel returns them."""


def _grouped_mm(func: Any, mat_a: Any, mat_b: Any, *args: Any, **kwargs: Any) -> Any:
    """``torch._grouped_mm`` (mixture-of-experts layers) in any floating dtype.

    The meta kernel (``_meta_grouped_mm_common`` in torch/_meta_registrations.py) copies the
    checks of the CUDA fast path and refuses anything but bfloat16, but the real kernels take
    other dtypes: the CPU kernel, and on CUDA ``_grouped_mm_cuda`` falls back to
    ``_grouped_mm_fallback`` (a loop of ``mm_out`` into slices of the output) when the inputs are
    not bfloat16 (aten/src/ATen/native/cuda/GroupedBlas.cpp, GroupedMMUtils.h). The output has
    the meta kernel's shape and the inputs' dtype (or ``out_dtype``)."""
    if mat_a.dtype == mat_b.dtype == torch.bfloat16:
        return func(mat_a, mat_b, *args, **kwargs)
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    def proxy(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        dtype = torch.bfloat16 if t.is_floating_point() else t.dtype
        return torch.empty_strided(t.shape, t.stride(), dtype=dtype, device="meta")

    out_dtype = kwargs.pop("out_dtype", None) or mat_a.dtype
    with unset_fake_temporarily():
        shaped = func(
            proxy(mat_a),
            proxy(mat_b),
            *map(proxy, args),
            **{k: proxy(v) for k, v in kwargs.items()},
        )
    return torch.empty_strided(shaped.shape, shaped.stride(), dtype=out_dtype, device=mat_a.device)


SUBSTITUTES: dict[Any, Substitute] = {aten._grouped_mm.default: _grouped_mm}


CORRECTIONS: dict[Any, Correction] = {
    aten.native_batch_norm.default: _batch_norm_stats,
    aten._native_batch_norm_legit.default: _batch_norm_stats,
    aten._native_batch_norm_legit.no_stats: _batch_norm_stats,
    aten._native_batch_norm_legit_no_training.default: _batch_norm_stats,
    aten._native_batch_norm_legit_functional.default: _batch_norm_stats,
    aten.native_layer_norm.default: _layer_norm_stats,
    aten.native_group_norm.default: _group_norm_stats,
    aten.native_layer_norm_backward.default: _layer_norm_grad_contiguous,
}


@contextlib.contextmanager
def noop_conversions() -> Iterator[None]:
    """``module.to(dtype)`` that changes nothing leaves fake parameters alone, and one that
    changes them converts in place where a fake parameter cannot be swapped.

    ``nn.Module._apply`` swaps every fake parameter for its converted copy
    (``torch.utils.swap_tensors``), even when the conversion returned the parameter itself; the
    swap fails for a parameter the optimizer and the tracker refer to. A real run's ``.to()`` of
    the same dtype changes nothing, so neither does the trace's (model code that casts a layer in
    forward, e.g. Switch Transformers' router to its ``router_dtype``)."""
    original = nn.Module._apply

    def _apply(self: nn.Module, fn: Any, recurse: bool = True) -> nn.Module:
        if recurse:
            for child in self.children():
                child._apply(fn)
        with torch.no_grad():
            unchanged = all(
                fn(t) is t
                for t in (*self._parameters.values(), *self._buffers.values())
                if t is not None
            )
        if unchanged:
            return self
        try:
            return original(self, fn, recurse=False)
        except RuntimeError as exc:
            if "Couldn't swap" not in str(exc):
                raise
        # a fake parameter with a weak reference (its known values' registry) cannot be
        # swapped: converted in place, as ``_apply`` does where it does not swap (``.data``)
        with torch.no_grad():
            for p in (p for p in self._parameters.values() if p is not None):
                converted = fn(p)
                if converted is not p:
                    p.data = converted
            for name, b in list(self._buffers.items()):
                if b is not None:
                    self._buffers[name] = fn(b)
        return self

    nn.Module._apply = _apply  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module._apply = original  # type: ignore[method-assign]
