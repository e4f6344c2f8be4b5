"""CUDA's autocast, applied to CPU tensors.

``torch.autocast("cuda")`` and ``torch.autocast("cpu")`` cast different operators: on CUDA
``layer_norm``, ``rms_norm``, ``softmax`` and the losses run in fp32 and save fp32 tensors;
on CPU many of them run in the lower precision. Since the trace runs on CPU tensors, this
module overrides the AutocastCPU kernels, for the duration of a trace, with CUDA's policy:

- ``LOWER_PRECISION_FP``: floating inputs cast to the autocast dtype; fp32 leaf tensors that
  require grad (the weights) are cast once per autocast region and cached, as
  ``at::autocast::cached_cast`` does;
- ``FP32``: floating inputs cast to fp32;
- ``FP32_SET_OPT_DTYPE``: ``dtype=float32`` passed when the caller gave none;
- ``FP32_APPEND_DTYPE``: redispatched to the overload that takes a dtype, with float32;
- ``PROMOTE``: inputs cast to the widest floating type among them;
- ``BANNED``: raise, as CUDA autocast does;
- operators autocast-CPU knows but autocast-CUDA does not: run as CUDA would — composite
  ones decompose with autocast still active, the rest run uncast.

Source: ``aten/src/ATen/autocast_mode.h`` (``AT_FORALL_*`` macros) and ``autocast_mode.cpp``
of PyTorch 2.13; ``tests/test_autocast_cuda.py`` checks these lists against the AutocastCUDA
kernels registered in the installed PyTorch and the result against real CUDA autocast run on
fake CUDA tensors.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_leaves, tree_map

LOWER_PRECISION_FP: tuple[str, ...] = (
    "_convolution.deprecated",
    "_convolution",
    "conv1d",
    "conv2d",
    "conv3d",
    "conv_tbc",
    "conv_transpose1d",
    "conv_transpose2d.input",
    "conv_transpose3d.input",
    "convolution",
    "prelu",
    "addmm",
    "addmv",
    "addr",
    "matmul",
    "einsum",
    "mm",
    "mv",
    "linalg_vecdot",
    "linear",
    "addbmm",
    "baddbmm",
    "bmm",
    "chain_matmul",
    "linalg_multi_dot",
    "_thnn_fused_lstm_cell",
    "_thnn_fused_gru_cell",
    "lstm_cell",
    "gru_cell",
    "rnn_tanh_cell",
    "rnn_relu_cell",
    "_scaled_dot_product_flash_attention",
    "scaled_dot_product_attention",
)
FP32: tuple[str, ...] = (
    "acos",
    "asin",
    "cosh",
    "erfinv",
    "exp",
    "expm1",
    "log",
    "log10",
    "log2",
    "log1p",
    "reciprocal",
    "rsqrt",
    "sinh",
    "tan",
    "pow.Tensor_Scalar",
    "pow.Tensor_Tensor",
    "pow.Scalar",
    "softplus",
    "layer_norm",
    "native_layer_norm",
    "rms_norm",
    "group_norm",
    "frobenius_norm.dim",
    "nuclear_norm",
    "nuclear_norm.dim",
    "cosine_similarity",
    "poisson_nll_loss",
    "cosine_embedding_loss",
    "nll_loss",
    "nll_loss2d",
    "hinge_embedding_loss",
    "kl_div",
    "l1_loss",
    "smooth_l1_loss",
    "huber_loss",
    "mse_loss",
    "margin_ranking_loss",
    "multilabel_margin_loss",
    "soft_margin_loss",
    "triplet_margin_loss",
    "multi_margin_loss",
    "binary_cross_entropy_with_logits",
    "dist",
    "pdist",
    "cdist",
    "renorm",
    "logsumexp",
    "upsample_nearest1d",
    "_upsample_nearest_exact1d",
    "upsample_nearest2d",
    "_upsample_nearest_exact2d",
    "upsample_nearest3d",
    "_upsample_nearest_exact3d",
    "upsample_linear1d",
    "upsample_bilinear2d",
    "_upsample_bilinear2d_aa",
    "upsample_trilinear3d",
    "upsample_bicubic2d",
    "_upsample_bicubic2d_aa",
)
FP32_SET_OPT_DTYPE: tuple[str, ...] = (
    "prod",
    "prod.dim_int",
    "softmax.int",
    "log_softmax.int",
    "cumprod",
    "cumsum",
    "linalg_vector_norm",
    "linalg_matrix_norm",
    "linalg_matrix_norm.str_ord",
    "sum",
    "sum.dim_IntList",
)
FP32_APPEND_DTYPE: dict[str, str] = {
    "norm.Scalar": "norm.ScalarOpt_dtype",
    "norm.ScalarOpt_dim": "norm.ScalarOpt_dim_dtype",
}
PROMOTE: tuple[str, ...] = (
    "addcdiv",
    "addcmul",
    "atan2",
    "bilinear",
    "cross",
    "dot",
    "vdot",
    "grid_sampler",
    "index_put",
    "tensordot",
    "scatter_add",
)
BANNED: dict[str, str] = {
    "binary_cross_entropy": (
        "torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to autocast "
        "(CUDA autocast raises here); use binary_cross_entropy_with_logits / BCEWithLogitsLoss"
    ),
}
CUDA_ONLY: tuple[str, ...] = ("cudnn_convolution", "cudnn_convolution_transpose")
"""Registered for AutocastCUDA but unreachable from CPU tensors."""

_AUTOCAST_CPU = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)
_COMPOSITE = "CompositeImplicitAutograd"


def cuda_autocast_op_names() -> set[str]:
    """Every operator name (with overload) this module treats as AutocastCUDA does."""
    return {
        *LOWER_PRECISION_FP,
        *FP32,
        *FP32_SET_OPT_DTYPE,
        *FP32_APPEND_DTYPE,
        *PROMOTE,
        *BANNED,
        *CUDA_ONLY,
    }


def _op(name: str) -> torch._ops.OpOverload:
    base, _, overload = name.partition(".")
    packet = getattr(torch.ops.aten, base)
    return getattr(packet, overload or "default")


def _eligible(t: Any) -> bool:
    return (
        isinstance(t, torch.Tensor)
        and t.is_floating_point()
        and t.dtype is not torch.float64
        and t.device.type == "cpu"
    )


class _Caster:
    """Casts with CUDA's weight cache: fp32 leaf tensors that require grad, cast to the lower
    precision, are cast once per outermost autocast region."""

    def __init__(self) -> None:
        self.cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def cast(self, t: torch.Tensor, dtype: torch.dtype, lower: torch.dtype) -> torch.Tensor:
        if t.dtype is dtype:
            return t
        cacheable = (
            dtype is lower
            and t.dtype is torch.float32
            and t.requires_grad
            and t.is_leaf
            and not t._is_view()
            and torch.is_autocast_cache_enabled()
        )
        if not cacheable:
            return t.to(dtype)
        hit = self.cache.get(id(t))
        if hit is not None and hit[0] is t:
            return hit[1]
        out = t.to(dtype)
        self.cache[id(t)] = (t, out)
        return out

    def tree(self, args: Any, dtype: torch.dtype, lower: torch.dtype) -> Any:
        return tree_map(lambda a: self.cast(a, dtype, lower) if _eligible(a) else a, args)


class CudaAutocast:
    """Override AutocastCPU kernels with CUDA's policy while active (a context manager)."""

    def __init__(self) -> None:
        self.caster = _Caster()
        self._lib: torch.library.Library | None = None
        self._saved_clear: Callable[[], None] | None = None

    def _kernel(self, name: str) -> Callable[..., Any]:
        op = _op(name)
        caster = self.caster
        if name in BANNED:
            message = BANNED[name]

            def banned(*args: Any, **kwargs: Any) -> Any:
                raise RuntimeError(message)

            return banned
        if name in LOWER_PRECISION_FP or name in FP32 or name in PROMOTE:
            policy = (
                "lower" if name in LOWER_PRECISION_FP else "fp32" if name in FP32 else "promote"
            )

            def cast_kernel(*args: Any, **kwargs: Any) -> Any:
                lower = torch.get_autocast_dtype("cpu")
                if policy == "lower":
                    dtype = lower
                elif policy == "fp32":
                    dtype = torch.float32
                else:
                    eligible = [t.dtype for t in tree_leaves((args, kwargs)) if _eligible(t)]
                    dtype = torch.float32 if torch.float32 in eligible else lower
                with torch._C._ExcludeDispatchKeyGuard(_AUTOCAST_CPU):
                    return op(*caster.tree(args, dtype, lower), **caster.tree(kwargs, dtype, lower))

            return cast_kernel
        if name in FP32_SET_OPT_DTYPE:
            arguments = op._schema.arguments
            index = next(i for i, a in enumerate(arguments) if a.name == "dtype")
            kwarg_only = arguments[index].kwarg_only

            def set_dtype_kernel(*args: Any, **kwargs: Any) -> Any:
                with torch._C._ExcludeDispatchKeyGuard(_AUTOCAST_CPU):
                    if not (args and _eligible(args[0])):
                        return op(*args, **kwargs)
                    if kwarg_only or index >= len(args):
                        if kwargs.get("dtype") is None:
                            kwargs = {**kwargs, "dtype": torch.float32}
                    elif args[index] is None:
                        args = (*args[:index], torch.float32, *args[index + 1 :])
                    return op(*args, **kwargs)

            return set_dtype_kernel
        if name in FP32_APPEND_DTYPE:
            with_dtype = _op(FP32_APPEND_DTYPE[name])

            def append_dtype_kernel(*args: Any, **kwargs: Any) -> Any:
                with torch._C._ExcludeDispatchKeyGuard(_AUTOCAST_CPU):
                    if args and _eligible(args[0]):
                        return with_dtype(*args, **kwargs, dtype=torch.float32)
                    return op(*args, **kwargs)

            return append_dtype_kernel
        raise KeyError(name)

    @staticmethod
    def _passthrough(name: str) -> Callable[..., Any]:
        """An AutocastCPU-only operator: do what CUDA's fallthrough does."""
        op = _op(name)
        if torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), _COMPOSITE):

            def decompose(*args: Any, **kwargs: Any) -> Any:
                return op.decompose(*args, **kwargs)

            return decompose

        def uncast(*args: Any, **kwargs: Any) -> Any:
            with torch._C._ExcludeDispatchKeyGuard(_AUTOCAST_CPU):
                return op(*args, **kwargs)

        return uncast

    def __enter__(self) -> CudaAutocast:
        lib = torch.library.Library("aten", "IMPL")
        handled = cuda_autocast_op_names() - set(CUDA_ONLY)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "overriding a previously registered kernel"
            for name in sorted(handled):
                lib.impl(name, self._kernel(name), "AutocastCPU")
            for name in sorted(cpu_autocast_op_names() - handled):
                lib.impl(name, self._passthrough(name), "AutocastCPU")
        self._lib = lib
        # torch.autocast.__exit__ calls torch.clear_autocast_cache() when the outermost region
        # ends; clear the emulated weight cache at the same moment.
        self._saved_clear = torch.clear_autocast_cache

        def clear() -> None:
            self.caster.cache.clear()
            assert self._saved_clear is not None
            self._saved_clear()

        torch.clear_autocast_cache = clear
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._saved_clear is not None:
            torch.clear_autocast_cache = self._saved_clear
            self._saved_clear = None
        if self._lib is not None:
            self._lib._destroy()
            self._lib = None
        self.caster.cache.clear()


def cpu_autocast_op_names() -> set[str]:
    """Operators with an AutocastCPU kernel in the installed PyTorch (name[.overload])."""
    return _registered("AutocastCPU")


def registered_cuda_autocast_op_names() -> set[str]:
    """Operators with an AutocastCUDA kernel in the installed PyTorch (for the consistency test)."""
    return _registered("AutocastCUDA")


@functools.cache
def _registered(key: str) -> frozenset[str]:
    out = set()
    for name in torch._C._dispatch_get_all_op_names():
        if name.startswith("aten::") and torch._C._dispatch_has_kernel_for_dispatch_key(name, key):
            out.add(name[len("aten::") :])
    return frozenset(out)
