"""The attention kernel CUDA would pick, and what it keeps, applied to a trace on CPU tensors.

On CPU tensors ``scaled_dot_product_attention`` runs the CPU flash kernel or the math path
(which materialises the S×S attention matrix, e.g. whenever dropout is on). On a GPU the same
call tries the backends in ``priority_order`` and runs the first whose checks pass
(``select_sdp_backend`` in aten/src/ATen/native/transformers/cuda/sdp_utils.cpp; the checks
shared with the CPU in sdp_utils_cpp.h). Which ones exist and what they accept depends on the
GPU's compute capability (sm):

- **cuDNN attention**: sm80–sm121, fp16/bf16, head dims multiples of 8 and at most 128 (256 on
  sm90 itself, 192/128 on sm10x), masks allowed, grouped-query attention allowed. Tried first
  on sm90 and sm10x (``check_prefer_cudnn_attention``: runtime cuDNN newer than 9.15.0, which
  the torch 2.13.0 wheel's cuDNN 9.20 is), else after math, i.e. never by default;
- **flash attention**: sm80–sm121, fp16/bf16, no mask, equal head dims of at most 256, no causal
  with unequal lengths, grouped-query attention allowed; on sm86–sm89 and sm120–sm121 not when
  training with a head dim in (192, 224], or in (224, 256] with dropout;
- **memory-efficient attention**: sm50–sm121, fp16/fp32 (and bf16 from sm80), head dims aligned
  to ``minimum_gemm_alignment`` (8 for half, 4 for fp32 from sm80; 1 for fp32 below), masks
  allowed, equal head counts (no grouped-query attention in PyTorch 2.13);
- **math**, which upcasts fp16/bf16 to fp32 on CUDA.

The rules above were read from the sdp_utils.cpp of PyTorch 2.13 and checked against the
torch 2.13.0 CUDA wheel's libtorch_cuda.so (its warning strings, and the disassembled
``select_sdp_backend``, ``can_use_*`` and ``check_*`` functions: the constraint lists, the
instantiated templates and the compared constants). This module overrides the SDPA kernel for
CPU tensors during a trace and calls the chosen CUDA operator itself, whose meta kernel gives
the outputs and whose autograd formula decides what is saved. The backward kernels' internal
buffers, which no tensor shows, are added as transient workspace (``BACKWARD_WORKSPACE``).
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch

from vramledger.inputs.errors import InputError
from vramledger.inputs.gpus import DEFAULT_COMPUTE_CAPABILITY

aten = torch.ops.aten
_HALF = (torch.float16, torch.bfloat16)

Sm = tuple[int, int]

FLASH_SMS: tuple[Sm, Sm] = ((8, 0), (12, 1))
"""``check_flash_attention_hardware_support``: [sm80, sm121]."""
EFFICIENT_SMS: tuple[Sm, Sm] = ((5, 0), (12, 1))
"""``check_mem_efficient_hardware_support``: [sm50, sm121]."""
CUDNN_SMS: tuple[Sm, Sm] = ((8, 0), (12, 1))
"""``check_cudnn_hardware_support``: [sm80, sm121]."""
FLASH_TRAINING_HEAD_DIM_SMS: tuple[tuple[Sm, Sm], ...] = (((8, 6), (8, 9)), ((12, 0), (12, 1)))
"""``check_requires_grad_and_head_dim_gt192_constraints_on_sm86_89_or_120``: where flash's
backward lacks kernels for large head dims (too little shared memory)."""
FLASH_TRAINING_HEAD_DIM = 192
"""... there, training takes head dims up to this ..."""
FLASH_TRAINING_HEAD_DIM_NO_DROPOUT = 224
"""... or above this without dropout."""
HALF_PRECISION_SM: Sm = (8, 0)
"""From sm80 the fused kernels take bf16 (``check_dtypes_low_precision``, and the efficient
kernel's ``greater_than_or_equal_sm80_mem_efficient_dtypes``); below, fp16 (and fp32 for the
efficient kernel) only."""

FLASH_MAX_HEAD_DIM = 256
"""``check_head_dim_size_flash``: q, k, v head dims equal and at most 256."""
FLASH_PAD_MULTIPLE = 8
"""SDPA pads head_dim to a multiple of 8 before flash (``pad_last_dim<8, false>``), a real copy."""
EFFICIENT_MASK_PAD = 16
"""``preprocess_mask``: a mask whose last dim is not a multiple of 16 is padded (materialised)."""
FLASH_BWD_SEQ_ROUND = 128
"""``mha_bwd``: ``seqlen_q_rounded = round_multiple(seqlen_q, 128)``."""
EFFICIENT_LSE_ALIGN = 32
"""``kAlignLSE``: the efficient kernel's logsumexp length is padded to a multiple of 32."""

CUDNN_RUNTIME_VERSION = 92000
"""cuDNN 9.20.0 (``cudnnGetVersion()`` = major·10000 + minor·100 + patch): the torch 2.13.0
wheel on PyPI (CUDA 13.0) requires ``nvidia-cudnn-cu13==9.20.0.48`` (its METADATA)."""
CUDNN_PREFERRED_AFTER = 91500
"""``check_prefer_cudnn_attention``: cuDNN attention goes first when the runtime cuDNN is newer
than 9.15.0 ("cuDNN 9.15.1 required for seq_len not divisible by 128 fix") ..."""
CUDNN_PREFERRED_MAJORS = (9, 10)
"""... on sm9x and sm10x (a CUDA 13 build checks the major only)."""
CUDNN_MAX_HEAD_DIM = 128
"""``check_cudnn_tensor_shapes``: head dims at most 128 ..."""
CUDNN_MAX_HEAD_DIM_SM90 = 256
"""... 256 on sm90 itself (compute capability exactly 9.0) from cuDNN 9.10 ..."""
CUDNN_SM90_HEAD_DIM_VERSION = 91000
CUDNN_SM10X_QK192_V128_VERSION = 91100
"""... and on sm10x, d_qk = 192 with d_v = 128 (DeepSeek's) from cuDNN 9.11."""
CUDNN_HEAD_DIM_MULTIPLE = 8
CUDNN_MAX_BATCH_OR_HEADS = 65535
CUDNN_DROPOUT_RESOLUTION = 16
"""``check_cudnn_dropout``: the dropout probability must be a multiple of 1/16."""

BACKENDS = ("cudnn", "flash", "efficient", "math")
DEFAULT_PRIORITY = ("flash", "efficient", "math", "cudnn")
"""``sdp_priority_order`` in ATen/Context.h."""
CUDNN_PRIORITY = ("cudnn", "flash", "efficient", "math")
"""What ``priority_order`` installs when ``check_prefer_cudnn_attention`` holds."""


def _in(sm: Sm, bounds: tuple[Sm, Sm]) -> bool:
    return bounds[0] <= sm <= bounds[1]


def _round(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def priority_order(sm: Sm, cudnn_version: int = CUDNN_RUNTIME_VERSION) -> tuple[str, ...]:
    """The order ``select_sdp_backend`` tries the backends in on this GPU."""
    if cudnn_version > CUDNN_PREFERRED_AFTER and sm[0] in CUDNN_PREFERRED_MAJORS:
        return CUDNN_PRIORITY
    return DEFAULT_PRIORITY


def minimum_gemm_alignment(dtype: torch.dtype, sm: Sm) -> int:
    """``minimum_gemm_alignment``: 4 from sm80 (1 below), raised to 128 bits' worth of elements
    where tensor cores are used (sm80+, or fp16/bf16 from sm70)."""
    half = dtype in _HALF
    tensor_cores = sm[0] >= 8 or (sm[0] >= 7 and half)
    alignment = 4 if sm[0] >= 8 else 1
    if tensor_cores:
        alignment = max(alignment, 128 // (16 if half else 32))
    return alignment


def _shapes_ok(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """``check_tensor_shapes``, ``check_nonzero_sequence_lengths_dense``, stride 1 last dims."""
    return (
        q.dim() == k.dim() == v.dim() == 4
        and q.size(-2) > 0
        and k.size(-2) > 0
        and q.stride(-1) == k.stride(-1) == v.stride(-1) == 1
        and q.size(0) == k.size(0) == v.size(0)
    )


def _heads_ok(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gqa: bool, same_kv: bool = True
) -> bool:
    """``check_batch_size_and_num_heads_dense<supports_gqa, requires_same_num_heads>``."""
    hq, hk, hv = q.size(1), k.size(1), v.size(1)
    if gqa:
        if same_kv and hk != hv:
            return False
        return hq % hk == 0 and hq % hv == 0
    return hq == hk == hv


def _requires_grad(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """``input_requires_grad``."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))


def _mask_shape_ok(mask: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor) -> bool:
    """``check_attn_mask_shape``: a 2-d or 4-d mask broadcastable to (B, H, Sq, Sk), no grad."""
    if mask is None:
        return True
    if mask.requires_grad:
        return False

    def fits(dim: int, target: int) -> bool:
        return dim in (target, 1)

    if not (fits(mask.size(-2), q.size(2)) and fits(mask.size(-1), k.size(2))):
        return False
    if mask.dim() == 2:
        return True
    return mask.dim() == 4 and fits(mask.size(0), q.size(0)) and fits(mask.size(1), q.size(1))


def can_use_cudnn(q, k, v, attn_mask, dropout_p, is_causal, enable_gqa, sm: Sm) -> bool:
    """``can_use_cudnn_attention`` (dense inputs)."""
    if not (torch.backends.cuda.cudnn_sdp_enabled() and _in(sm, CUDNN_SMS)):
        return False
    deterministic = (
        torch.are_deterministic_algorithms_enabled()
        and not torch.is_deterministic_algorithms_warn_only_enabled()
    )
    if deterministic or not _shapes_ok(q, k, v):
        return False
    if not (q.dtype in _HALF and q.dtype == k.dtype == v.dtype and sm >= HALF_PRECISION_SM):
        return False
    if not _mask_shape_ok(attn_mask, q, k):
        return False
    if dropout_p * CUDNN_DROPOUT_RESOLUTION != math.floor(dropout_p * CUDNN_DROPOUT_RESOLUTION):
        return False
    if not _heads_ok(q, k, v, enable_gqa, same_kv=False):
        return False
    d_qk, d_v = q.size(3), v.size(3)
    limit = CUDNN_MAX_HEAD_DIM
    if sm == (9, 0) and CUDNN_RUNTIME_VERSION >= CUDNN_SM90_HEAD_DIM_VERSION:
        limit = CUDNN_MAX_HEAD_DIM_SM90
    if (
        sm[0] == 10
        and CUDNN_RUNTIME_VERSION >= CUDNN_SM10X_QK192_V128_VERSION
        and (d_qk, d_v) == (192, 128)
    ):
        limit = 192
    return (
        q.size(0) <= CUDNN_MAX_BATCH_OR_HEADS
        and q.size(1) <= CUDNN_MAX_BATCH_OR_HEADS
        and d_qk <= limit
        and d_v <= limit
        and d_qk % CUDNN_HEAD_DIM_MULTIPLE == 0
        and d_v % CUDNN_HEAD_DIM_MULTIPLE == 0
        and k.size(2) != 1
        and not (dropout_p > 0 and q.size(2) == 1)
    )


def can_use_flash(q, k, v, attn_mask, dropout_p, is_causal, enable_gqa, sm: Sm) -> bool:
    """``can_use_flash_attention`` (dense inputs)."""
    d = q.size(-1)
    if not (torch.backends.cuda.flash_sdp_enabled() and _in(sm, FLASH_SMS)):
        return False
    if any(_in(sm, span) for span in FLASH_TRAINING_HEAD_DIM_SMS) and _requires_grad(q, k, v):
        trainable = d <= FLASH_TRAINING_HEAD_DIM or (
            dropout_p == 0 and d > FLASH_TRAINING_HEAD_DIM_NO_DROPOUT
        )
        if not trainable:
            return False
    return (
        _shapes_ok(q, k, v)
        and q.dtype in _HALF
        and q.dtype == k.dtype == v.dtype
        and attn_mask is None
        and k.size(-1) == d
        and v.size(-1) == d
        and d <= FLASH_MAX_HEAD_DIM
        and not (is_causal and q.size(-2) != k.size(-2))
        and _heads_ok(q, k, v, enable_gqa)
    )


def can_use_efficient(q, k, v, attn_mask, dropout_p, is_causal, enable_gqa, sm: Sm) -> bool:
    """``can_use_mem_efficient_attention`` (dense inputs)."""
    if not (torch.backends.cuda.mem_efficient_sdp_enabled() and _in(sm, EFFICIENT_SMS)):
        return False
    dtypes = (*_HALF, torch.float32) if sm >= HALF_PRECISION_SM else (torch.float16, torch.float32)
    if q.dtype not in dtypes or not (q.dtype == k.dtype == v.dtype):
        return False
    align = minimum_gemm_alignment(q.dtype, sm)
    # check_data_ptr_alignment_mem_efficient (sm80+): the caching allocator's blocks are 512-byte
    # aligned, so a view's storage offset decides
    offsets_ok = sm < HALF_PRECISION_SM or all(t.storage_offset() % align == 0 for t in (q, k, v))
    return (
        _shapes_ok(q, k, v)
        and q.size(-1) == k.size(-1)
        and q.size(-1) % align == 0
        and v.size(-1) % align == 0
        and offsets_ok
        and _heads_ok(q, k, v, gqa=False)  # no grouped-query attention in PyTorch 2.13
        and (attn_mask is None or attn_mask.stride(-1) == 1)
    )


CHECKS = {"cudnn": can_use_cudnn, "flash": can_use_flash, "efficient": can_use_efficient}


def select_backend(
    q,
    k,
    v,
    attn_mask=None,
    dropout_p=0.0,
    is_causal=False,
    enable_gqa=False,
    *,
    compute_capability: Sm = DEFAULT_COMPUTE_CAPABILITY,
) -> str:
    """'cudnn', 'flash', 'efficient' or 'math', as CUDA's ``select_sdp_backend`` would choose."""
    args = (q, k, v, attn_mask, dropout_p, is_causal, enable_gqa, compute_capability)
    for backend in priority_order(compute_capability):
        if backend == "math":
            return "math"
        if CHECKS[backend](*args):
            return backend
    return "math"


def math_reasons(q, k, v, attn_mask, enable_gqa, sm: Sm) -> list[str]:
    """Why no fused kernel took these inputs, in the words of the checks above that failed (for
    the notes: the math path keeps the S×S scores)."""
    reasons = []
    if q.dtype not in _HALF:
        reasons.append(
            f"q/k/v are {str(q.dtype).removeprefix('torch.')} (cuDNN and flash attention take "
            "fp16/bf16 only)"
        )
    elif not q.dtype == k.dtype == v.dtype:
        reasons.append("q, k and v have different dtypes")
    if enable_gqa and q.size(1) != k.size(1):
        reasons.append(
            "grouped-query attention (PyTorch 2.13's memory-efficient kernel takes none)"
        )
    align = minimum_gemm_alignment(q.dtype, sm)
    if q.size(-1) % align or v.size(-1) % align:
        reasons.append(f"head dim {q.size(-1)} not a multiple of {align} (memory-efficient)")
    if attn_mask is not None and attn_mask.requires_grad:
        reasons.append("an attention mask that requires grad")
    return reasons or ["no fused kernel's conditions hold (trace/emulation/sdpa_cuda.py)"]


def cuda_sdpa(
    q,
    k,
    v,
    attn_mask=None,
    dropout_p=0.0,
    is_causal=False,
    scale=None,
    enable_gqa=False,
    *,
    compute_capability: Sm = DEFAULT_COMPUTE_CAPABILITY,
    used: set[str] | None = None,
    why_math: set[str] | None = None,
):
    """``scaled_dot_product_attention`` as CUDA runs it (see module docstring); the backend
    chosen is added to ``used``, and when it is math the reasons to ``why_math``."""
    backend = select_backend(
        q, k, v, attn_mask, dropout_p, is_causal, enable_gqa, compute_capability=compute_capability
    )
    if used is not None:
        used.add(backend)
    if backend == "math" and why_math is not None:
        why_math.update(math_reasons(q, k, v, attn_mask, enable_gqa, compute_capability))
    if backend == "math" and _is_dtensor(q):
        # context parallelism (parallel/context.py): PyTorch's ring attention wraps the fused
        # kernels only (_attention.py _sdpa_handler: "CP only supports flash attention and
        # memory efficient attention now")
        raise InputError(
            f"context parallelism needs flash or memory-efficient attention, and this run's "
            f"attention ({q.dtype}, head dim {q.size(-1)}"
            f"{', grouped-query' if enable_gqa else ''}) falls back to the math kernel on CUDA",
            hint="train in bf16 or fp16 (--precision bf16-master), or drop --cp",
        )
    if scale is None:
        scale = 1.0 / math.sqrt(q.size(-1))
    if backend == "cudnn":
        bias = attn_mask
        if bias is not None and bias.dtype == torch.bool:
            # convert_boolean_attn_mask_cudnn: a float bias of the mask's shape
            bias = torch.where(bias, 0.0, torch.scalar_tensor(-math.inf, dtype=q.dtype))
        return aten._scaled_dot_product_cudnn_attention(
            q, k, v, bias, _requires_grad(q, k, v), dropout_p, is_causal, False, scale=scale
        )[0]
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
        return aten._scaled_dot_product_efficient_attention(
            q, k, v, bias, _requires_grad(q, k, v), dropout_p, is_causal, scale=scale
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


def cudnn_backward_workspace(args: tuple[Any, ...]) -> list[tuple[str, int]]:
    """``run_cudnn_SDP_bprop`` (aten/src/ATen/native/cudnn/MHA.cpp) allocates the graph's
    workspace: cudnn-frontend's SDPA backward node (``get_fe_workspace_size_node``) holds
    ``dQ_accum`` fp32 (B, Hq, Sq, D) and ``softmax_sum`` fp32 (B, Hq, Sq); for grouped queries
    its full-head dK/dV are virtual (not in the workspace) for dense inputs. The cuDNN engine's
    own workspace is not known without a GPU. ``grad_out`` is copied to the output's layout when
    its last stride is not 1 (cuDNN 9.5.1+ builds)."""
    grad_out, q = args[0], args[1]
    b, h, sq, d = q.shape
    f32 = torch.float32.itemsize
    items = [
        ("cudnn dQ_accum", b * h * sq * d * f32),
        ("cudnn softmax_sum", b * h * sq * f32),
    ]
    if grad_out.stride(-1) != 1:
        items.append(("cudnn grad_out copy", grad_out.numel() * grad_out.element_size()))
    return items


BACKWARD_WORKSPACE = {
    aten._scaled_dot_product_flash_attention_backward.default: flash_backward_workspace,
    aten._scaled_dot_product_efficient_attention_backward.default: efficient_backward_workspace,
    aten._scaled_dot_product_cudnn_attention_backward.default: cudnn_backward_workspace,
}
HOST_OUTPUTS = {
    # philox seed/offset of the efficient kernel are CPU int64 scalars in eager mode
    # (Note [Seed and Offset Device] in attention.cu).
    aten._scaled_dot_product_efficient_attention.default: (2, 3),
}


class CudaSdpa:
    """Route ``scaled_dot_product_attention`` on CPU tensors through :func:`cuda_sdpa` as a GPU
    of ``compute_capability`` would run it, while active; ``used`` collects the backends run."""

    def __init__(self, compute_capability: Sm = DEFAULT_COMPUTE_CAPABILITY) -> None:
        self.compute_capability = compute_capability
        self.used: set[str] = set()
        self.why_math: set[str] = set()
        self._lib: torch.library.Library | None = None

    def __enter__(self) -> CudaSdpa:
        cc, used, why_math = self.compute_capability, self.used, self.why_math

        def kernel(*args: Any, **kwargs: Any) -> Any:
            return cuda_sdpa(*args, **kwargs, compute_capability=cc, used=used, why_math=why_math)

        lib = torch.library.Library("aten", "IMPL")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            lib.impl("scaled_dot_product_attention", kernel, "AutogradCPU")
        self._lib = lib
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._lib is not None:
            self._lib._destroy()
            self._lib = None


def _is_dtensor(t: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)
