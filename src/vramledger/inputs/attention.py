"""The attention path a Hugging Face model is built with (``--attn-implementation``), and
FlashAttention-2 modelled where it cannot run.

``sdpa`` (transformers' default) and ``eager`` are transformers' own implementations, traced as
they run (SDPA's CUDA kernel choice: ``trace/emulation/sdpa_cuda.py``). ``flash_attention_2`` is the
``flash-attn`` package, a CUDA-only extension that cannot run here: the model is built with
transformers' flash path replaced by :func:`flash_attention_forward`, an autograd function that
allocates and saves what flash-attn 2.x's ``FlashAttnFunc`` and its C++ ``mha_fwd`` /
``mha_bwd`` (``csrc/flash_attn/flash_api.cpp``) allocate and save — shapes and dtypes only (its
outputs hold no values, so a real run cannot use it):

- forward: the output like ``q`` (``[b, s, h, d]``, half), ``softmax_lse`` ``[b, h, s]`` fp32 and
  the 2-element int64 ``rng_state``; saved for backward: ``q, k, v, out, softmax_lse,
  rng_state`` (``FlashAttnFunc.forward``: ``ctx.save_for_backward``). No attention matrix and no
  dropout mask (dropout is regenerated from ``rng_state``). The head dimension is padded to a
  multiple of 8 first when it is not one (a padded copy of q, k, v).
- backward: ``dq, dk, dv`` like ``q, k, v``; ``softmax_d`` ``[b, h, round128(s_q)]`` fp32 and
  ``dq_accum`` ``[b, round128(s_q), h, round32(d)]`` fp32 (``d > 192``: 256); with grouped-query
  attention ``dk_expanded`` / ``dv_expanded`` ``[b, s_k, h, d]`` (half) summed into ``dk`` /
  ``dv``.

Not modelled: the split-KV accumulators ``mha_fwd`` makes when batch x heads x query blocks is
below 80 % of the SMs (small inputs), the deterministic mode's per-split ``dq_accum``, and
variable-length (padded) batches, which are refused. FlashAttention-2 computes in fp16/bf16
only: an fp32 run (no autocast) is refused, as transformers' flash path would cast it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from vramledger.inputs.errors import InputError
from vramledger.inputs.notes import Note, Topic

IMPLEMENTATIONS = ("sdpa", "eager", "flash_attention_2")
"""``--attn-implementation`` values: transformers' names."""
MODELLED_FA2 = "vramledger_modelled_fa2"
"""The name the modelled FlashAttention-2 is registered under in transformers'
``AttentionInterface`` (the real name needs the flash-attn package; a name with "flash" in it
transformers treats as a flash-attn kernel to load)."""
HEAD_PAD = 8
"""flash-attn's Python wrapper pads the head dimension to a multiple of 8
(``_flash_attn_forward``: ``head_size_og % 8``)."""
SEQ_ROUND = 128
"""``mha_bwd``: ``seqlen_q_rounded = round_multiple(seqlen_q, 128)``."""
HEAD_ROUND = 32
HEAD_ROUND_LIMIT = 192
HEAD_ROUND_MAX = 256
"""``head_size_rounded = head_size <= 192 ? round_multiple(head_size, 32) : 256``."""


def _round(x: int, m: int) -> int:
    return (x + m - 1) // m * m


class _FlashAttn2(torch.autograd.Function):
    """flash-attn 2's ``FlashAttnFunc`` as its memory goes (module docstring); q, k, v are
    ``[b, s, h, d]``."""

    calls = 0
    """Forward calls so far in this process (``AttentionCalls`` reads the difference)."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        _FlashAttn2.calls += 1
        d = q.size(-1)
        if d % HEAD_PAD:
            pad = [0, _round(d, HEAD_PAD) - d]
            q, k, v = (torch.nn.functional.pad(t, pad) for t in (q, k, v))
        b, s, h, _ = q.shape
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
        lse = torch.empty(b, h, s, dtype=torch.float32, device=q.device)
        rng = torch.empty(2, dtype=torch.int64, device=q.device)
        ctx.save_for_backward(q, k, v, out, lse, rng)
        ctx.head_dim = d
        return out[..., :d] if out.size(-1) != d else out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[torch.Tensor, ...]:
        q, k, v, _out, _lse, _rng = ctx.saved_tensors  # as flash-attn reads them
        d = ctx.head_dim
        if dout.size(-1) != q.size(-1):
            dout = torch.nn.functional.pad(dout, [0, q.size(-1) - dout.size(-1)])
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        b, s_q, h, dp = q.shape
        s_k, h_k = k.size(1), k.size(2)
        rounded = _round(dp, HEAD_ROUND) if dp <= HEAD_ROUND_LIMIT else HEAD_ROUND_MAX
        softmax_d = torch.empty(b, h, _round(s_q, SEQ_ROUND), dtype=torch.float32, device=q.device)
        dq_accum = torch.empty(
            b, _round(s_q, SEQ_ROUND), h, rounded, dtype=torch.float32, device=q.device
        )
        if h_k != h:  # grouped-query attention: gradients per query head, then summed
            dk_expanded = torch.empty(b, s_k, h, dp, dtype=k.dtype, device=k.device)
            dv_expanded = torch.empty(b, s_k, h, dp, dtype=v.dtype, device=v.device)
            torch.sum(dk_expanded.view(b, s_k, h_k, h // h_k, dp), dim=3, out=dk)
            torch.sum(dv_expanded.view(b, s_k, h_k, h // h_k, dp), dim=3, out=dv)
            del dk_expanded, dv_expanded
        del softmax_d, dq_accum
        if dp != d:
            dq, dk, dv = dq[..., :d], dk[..., :d], dv[..., :d]
        return dq, dk, dv


def flash_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function interface (q, k, v ``[b, h, s, d]``; returns
    ``[b, s, h, d]``), as its flash path calls ``flash_attn_func`` on ``transpose(1, 2)`` views."""
    if attention_mask is not None:
        raise InputError(
            "a padded batch under flash_attention_2 (transformers unpads it for flash-attn's "
            "variable-length kernel) is not modelled",
            hint="give a batch without padding, or use --attn-implementation sdpa",
        )
    if query.dtype not in (torch.float16, torch.bfloat16):
        raise InputError(
            f"FlashAttention-2 computes in fp16 or bf16, and this run's attention is {query.dtype}",
            hint="use a half or autocast --precision (bf16-master, bf16-mixed, ...)",
        )
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    return _FlashAttn2.apply(q, k, v), None


def register_modelled_flash_attention() -> str:
    """Register the modelled FlashAttention-2 with transformers (attention and mask functions,
    the mask as flash-attn's: none without padding); returns the name to build with."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    AttentionInterface.register(MODELLED_FA2, flash_attention_forward)
    AttentionMaskInterface.register(MODELLED_FA2, flash_attention_mask)
    return MODELLED_FA2


def check_implementation(name: str | None) -> None:
    if name is not None and name not in IMPLEMENTATIONS:
        raise InputError(
            f"unknown attention implementation {name!r}", hint=f"use {', '.join(IMPLEMENTATIONS)}"
        )


class AttentionCalls(TorchFunctionMode):
    """Counts the attention the traced step called, so that the notes say what ran, not what was
    asked for: PyTorch's ``scaled_dot_product_attention`` (transformers' sdpa path, and any
    model's own call) and the modelled FlashAttention-2 (:class:`_FlashAttn2`). A torch-function
    mode sees calls before dispatch; it changes no operator."""

    def __init__(self) -> None:
        super().__init__()
        self.sdpa = 0
        self._flash_start = _FlashAttn2.calls

    @property
    def flash(self) -> int:
        return _FlashAttn2.calls - self._flash_start

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.nn.functional.scaled_dot_product_attention:
            self.sdpa += 1
        return func(*args, **(kwargs or {}))


def built_implementation(model: torch.nn.Module) -> str | None:
    """The attention path a Hugging Face model was built with (its config's
    ``_attn_implementation``, which its layers dispatch on), None for other models."""
    config = getattr(model, "config", None)
    return getattr(config, "_attn_implementation", None)


def implementation_note(calls: AttentionCalls, built: str | None) -> str | None:
    """What an estimate says about the attention its trace ran (``calls``) in a model built with
    the path ``built`` (:func:`built_implementation`)."""
    if calls.flash:
        return Note(
            Topic.KERNELS,
            "attention: FlashAttention-2 (flash-attn 2.x) modelled from its code, since it "
            "cannot run here — saves q, k, v, the output and an fp32 logsumexp; backward "
            "allocates fp32 dq_accum and softmax_d (attention.py)",
        )
    if calls.sdpa:
        path = f"transformers' {built} path, " if built is not None else ""
        return Note(
            Topic.KERNELS, f"attention: {path}torch.nn.functional.scaled_dot_product_attention"
        )
    if built == "eager":
        return Note(
            Topic.KERNELS, "attention: transformers' eager implementation (matmul, softmax, matmul)"
        )
    return None
