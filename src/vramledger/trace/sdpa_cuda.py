"""The attention kernel CUDA would pick, and what it keeps, applied to a trace on CPU tensors.

On CPU tensors ``scaled_dot_product_attention`` runs the CPU flash kernel or the math path
(which materialises the S×S attention matrix, e.g. whenever dropout is on). On an sm80+ GPU
the same call picks, in order (``sdp_priority_order`` in ATen/Context.h; cuDNN attention comes
after math unless the runtime cuDNN is newer than 9.15, see ``CudaSdpa.prefer_cudnn``):

1. flash attention: fp16/bf16, no mask, head_dim <= 256, no causal with unequal lengths,
   grouped-query attention allowed;
2. memory-efficient attention: fp16/bf16/fp32, masks allowed, head_dim aligned to 8 (half) or
   4 (fp32), equal head counts (no GQA in PyTorch 2.13);
3. the math path, which upcasts fp16/bf16 to fp32 on CUDA.

(``can_use_flash_attention`` / ``can_use_mem_efficient_attention`` in
aten/src/ATen/native/transformers/cuda/sdp_utils.cpp.) This module overrides the SDPA kernel for
CPU tensors during a trace and calls the chosen CUDA operator itself, whose meta kernel gives
the outputs and whose autograd formula decides what is saved. The backward kernels' internal
buffers, which no tensor shows, are added as transient workspace (``workspace_for``).
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch

aten = torch.ops.aten
_HALF = (torch.float16, torch.bfloat16)

FLASH_MAX_HEAD_DIM = 256
"""``check_head_dim_size_flash``: q, k, v head dims equal and at most 256."""
FLASH_PAD_MULTIPLE = 8
"""SDPA pads head_dim to a multiple of 8 before flash (``pad_last_dim<8, false>``), a real copy."""
EFFICIENT_ALIGNMENT = {torch.float16: 8, torch.bfloat16: 8, torch.float32: 4}
"""``minimum_gemm_alignment`` on sm80+: head dims must be multiples of this."""
EFFICIENT_MASK_PAD = 16
"""``preprocess_mask``: a mask whose last dim is not a multiple of 16 is padded (materialised)."""
FLASH_BWD_SEQ_ROUND = 128
"""``mha_bwd``: ``seqlen_q_rounded = round_multiple(seqlen_q, 128)``."""
EFFICIENT_LSE_ALIGN = 32
"""``kAlignLSE``: the efficient kernel's logsumexp length is padded to a multiple of 32."""


def _round(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _shapes_ok(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    return (
        q.dim() == k.dim() == v.dim() == 4
        and q.size(-2) > 0
        and k.size(-2) > 0
        and q.stride(-1) == k.stride(-1) == v.stride(-1) == 1
        and q.size(0) == k.size(0) == v.size(0)
    )


def _heads_ok(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gqa: bool) -> bool:
    hq, hk, hv = q.size(1), k.size(1), v.size(1)
    if gqa:
        return hk == hv and hq % hk == 0
    return hq == hk == hv


def can_use_flash(q, k, v, attn_mask, dropout_p, is_causal, enable_gqa) -> bool:
    d = q.size(-1)
    return (
        torch.backends.cuda.flash_sdp_enabled()
        and _shapes_ok(q, k, v)
        and q.dtype in _HALF
        and q.dtype == k.dtype == v.dtype
        and attn_mask is None
        and k.size(-1) == d
        and v.size(-1) == d
        and d <= FLASH_MAX_HEAD_DIM
        and not (is_causal and q.size(-2) != k.size(-2))
        and _heads_ok(q, k, v, enable_gqa)
    )


def can_use_efficient(q, k, v, attn_mask, dropout_p, is_causal, enable_gqa) -> bool:
    align = EFFICIENT_ALIGNMENT.get(q.dtype)
    return (
        torch.backends.cuda.mem_efficient_sdp_enabled()
        and align is not None
        and _shapes_ok(q, k, v)
        and q.dtype == k.dtype == v.dtype
        and q.size(-1) == k.size(-1)
        and q.size(-1) % align == 0
        and v.size(-1) % align == 0
        and q.size(1) == k.size(1) == v.size(1)  # no grouped-query attention in PyTorch 2.13
        and (attn_mask is None or attn_mask.stride(-1) == 1)
    )


def select_backend(
    q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, enable_gqa=False
) -> str:
    """'flash', 'efficient' or 'math', as CUDA's ``select_sdp_backend`` would choose."""
    args = (q, k, v, attn_mask, dropout_p, is_causal, enable_gqa)
    if can_use_flash(*args):
        return "flash"
    if can_use_efficient(*args):
        return "efficient"
    return "math"


def _needs_grad(*tensors: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def cuda_sdpa(
    q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False
):
    """``scaled_dot_product_attention`` as CUDA runs it (see module docstring)."""
    backend = select_backend(q, k, v, attn_mask, dropout_p, is_causal, enable_gqa)
    if scale is None:
        scale = 1.0 / math.sqrt(q.size(-1))
    if backend == "flash":
        d = q.size(-1)
        if d % FLASH_PAD_MULTIPLE:
            pad = [0, _round(d, FLASH_PAD_MULTIPLE) - d]
            q, k, v = (torch.nn.functional.pad(t, pad) for t in (q, k, v))
        out = aten._scaled_dot_product_flash_attention(
            q, k, v, dropout_p, is_causal, False, scale=scale
        )[0]
        return out[..., :d] if out.size(-1) != d else out
    if backend == "efficient":
        bias = attn_mask
        if bias is not None and bias.dtype == torch.bool:
            bias = torch.where(bias, 0.0, torch.scalar_tensor(-math.inf, dtype=q.dtype))
        if bias is not None:
            bias = bias.expand(q.size(0), q.size(1), q.size(-2), k.size(-2))
            if bias.size(-1) % EFFICIENT_MASK_PAD:
                padded = _round(bias.size(-1), EFFICIENT_MASK_PAD) - bias.size(-1)
                bias = torch.nn.functional.pad(bias, [0, padded])[..., : k.size(-2)]
        lse = _needs_grad(q, k, v)
        return aten._scaled_dot_product_efficient_attention(
            q, k, v, bias, lse, dropout_p, is_causal, scale=scale
        )[0]
    dtype = q.dtype
    if dtype in _HALF:  # CUDA's math path computes in fp32 (allow_fp16_bf16_reduction_math_sdp off)
        q, k, v = q.float(), k.float(), v.float()
        if attn_mask is not None and attn_mask.is_floating_point():
            attn_mask = attn_mask.float()
    out = aten._scaled_dot_product_attention_math(
        q, k, v, attn_mask, dropout_p, is_causal, None, scale=scale, enable_gqa=enable_gqa
    )[0]
    return out.to(dtype)


# -- what the CUDA kernels allocate that no output shows -----------------------------------------
def flash_backward_workspace(args: tuple[Any, ...]) -> list[tuple[str, int]]:
    """``mha_bwd`` in flash_attn/flash_api.cpp: ``softmax_d`` fp32 (B, H, Sq rounded to 128),
    ``dq_accum`` fp32 (B, Sq rounded, H, head_dim rounded to 32, or 64 above 128), for grouped
    queries two (B, Sk, Hq, D) buffers summed into dK/dV; and ``grad_out.contiguous()`` /
    ``out.contiguous()`` copies when they are not (B, S, H, D)-physical."""
    grad_out, q, k, _v, out = args[:5]
    b, h, sq, d = q.shape
    sk, hk = k.size(2), k.size(1)
    sq_r = _round(sq, FLASH_BWD_SEQ_ROUND)
    d_r = _round(d, 32 if d <= 128 else 64)
    f32 = torch.float32.itemsize
    items = [("flash softmax_d", b * h * sq_r * f32), ("flash dq_accum", b * sq_r * h * d_r * f32)]
    if hk != h:
        items.append(("flash dk_expanded+dv_expanded", 2 * b * sk * h * d * q.element_size()))
    for name, t in (("grad_out", grad_out), ("out", out)):
        if not t.transpose(1, 2).is_contiguous():
            items.append((f"flash {name}.contiguous()", t.numel() * t.element_size()))
    return items


def efficient_backward_workspace(args: tuple[Any, ...]) -> list[tuple[str, int]]:
    """``_efficient_attention_backward`` (attention_backward.cu): ``grad_out.contiguous()`` unless
    (B, S, H, D)-physical; ``delta`` fp32 (B, H, Sq); a workspace of about one fp32 dQ
    (``workspace_size()`` of the cutlass kernel; exact tiles depend on the kernel picked)."""
    grad_out, q = args[0], args[1]
    b, h, sq, d = q.shape
    f32 = torch.float32.itemsize
    items = [
        ("efficient delta", b * h * sq * f32),
        ("efficient dq workspace", b * h * sq * d * f32),
    ]
    if not grad_out.transpose(1, 2).is_contiguous():
        items.append(
            ("efficient grad_out.contiguous()", grad_out.numel() * grad_out.element_size())
        )
    return items


BACKWARD_WORKSPACE = {
    aten._scaled_dot_product_flash_attention_backward.default: flash_backward_workspace,
    aten._scaled_dot_product_efficient_attention_backward.default: efficient_backward_workspace,
}
HOST_OUTPUTS = {
    # philox seed/offset of the efficient kernel are CPU int64 scalars in eager mode
    # (Note [Seed and Offset Device] in attention.cu).
    aten._scaled_dot_product_efficient_attention.default: (2, 3),
}


class CudaSdpa:
    """Route ``scaled_dot_product_attention`` on CPU tensors through :func:`cuda_sdpa` while active."""

    def __init__(self) -> None:
        self._lib: torch.library.Library | None = None

    def __enter__(self) -> CudaSdpa:
        lib = torch.library.Library("aten", "IMPL")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            lib.impl("scaled_dot_product_attention", cuda_sdpa, "AutogradCPU")
        self._lib = lib
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._lib is not None:
            self._lib._destroy()
            self._lib = None
