"""What CUDA decides differently from the CPU, applied to a trace on fake CPU tensors.

Each decision is named with its source in PyTorch 2.13; those that depend on the GPU's compute
capability (``CudaPolicy(compute_capability=...)``, from ``--gpu``; 9.0 when none is given) say
so:

- **Optimizer implementation.** ``torch.optim`` picks the multi-tensor (``foreach``)
  implementation by default when every parameter is a CUDA tensor, the for-loop one on CPU
  (``_default_to_fused_or_foreach`` in ``torch/optim/optimizer.py``). The trace passes
  ``foreach=True`` unless the user chose ``foreach`` or ``fused``. Same on every GPU.
- **Step counters on the host.** Non-capturable, non-fused torch.optim optimizers keep
  ``state["step"]`` as a CPU scalar even for CUDA parameters (``_init_group`` in ``adam.py``:
  "Deliberately host `step` on CPU if both capturable and fused are off"); reported as host
  bytes, not device bytes. Same on every GPU.
- **Autocast operator lists** (``autocast_cuda.py``): the same on every GPU (bf16 below sm80
  runs emulated: ``gpus.precision_warnings``).
- **Attention kernel choice and what it keeps** (``sdpa_cuda.py``): per compute capability —
  cuDNN attention first on sm90/sm10x, flash from sm80, memory-efficient alignment and dtypes
  below sm80, flash's training head-dim limits on sm86–89/sm120–121.
- **cuBLAS workspace**, per compute capability. The first cuBLAS call of each thread allocates
  a workspace through the caching allocator, kept for the life of the process
  (``setWorkspaceForHandle`` / ``getNewWorkspace`` in aten/src/ATen/cuda/CublasHandlePool.cpp).
  Its default size (``parseChosenWorkspaceSize``) is ``:4096:8`` = 32 MiB when the major
  compute capability is 9, 10 or 12 (Hopper, Blackwell) and ``:4096:2:16:8`` = 8 MiB + 128 KiB
  otherwise (Volta to Ada, and 11.x) — read from the torch 2.13.0 CUDA wheel's
  libtorch_cuda.so, whose ``parseChosenWorkspaceSize`` compares ``major - 9 <= 1 || major ==
  12``. Handles are per thread and backward runs on the autograd engine's CUDA device thread,
  so a training step holds two. cuBLASLt shares it: ``unified_cublas_and_lt_workspaces()`` is
  on unless ``TORCH_CUBLASLT_UNIFIED_WORKSPACE=0`` (and its own default would be 1 MiB,
  ``parseCUDABlasLtWorkspaceSize``), on every GPU.
- **Dropout's kernel.** ``at::native::dropout`` (aten/src/ATen/native/Dropout.cpp) takes the
  fused ``native_dropout`` when ``is_fused_kernel_acceptable`` — a CUDA tensor, 0 < p < 1 — and
  keeps a 1-byte bool mask for backward; on CPU tensors it decomposes into ``bernoulli_`` of a
  mask in the input's dtype and a multiply that keeps it (2 bytes per element in bf16). The
  trace runs ``native_dropout`` as CUDA would (``fused_dropout``).
- **Allocator rounding**: the CUDA caching allocator's 512-byte blocks (``allocator.py``), on
  every GPU.

Not modelled: the CUDA context and library code (the margin, ``verdict.py``), cuDNN's own
attention-engine workspace, and anything of ROCm (AMD GPUs are refused, ``gpus.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from vramledger.inputs.categories import Category, Phase
from vramledger.inputs.gpus import DEFAULT_COMPUTE_CAPABILITY, architecture_notes
from vramledger.inputs.notes import Note, Topic
from vramledger.inputs.optimizers import OptimizerChoice
from vramledger.inputs.units import format_bytes
from vramledger.record.allocator import CUDA_CACHING_ALLOCATOR, AllocatorModel
from vramledger.trace.core.tracker import OpObserver, StorageTracker
from vramledger.trace.emulation.autocast_cuda import CudaAutocast
from vramledger.trace.emulation.policy import DevicePolicy
from vramledger.trace.emulation.sdpa_cuda import (
    BACKENDS,
    BACKWARD_WORKSPACE,
    FLASH_MAX_HEAD_DIM,
    FLASH_SMS,
    FLASH_TRAINING_HEAD_DIM,
    FLASH_TRAINING_HEAD_DIM_NO_DROPOUT,
    FLASH_TRAINING_HEAD_DIM_SMS,
    HOST_OUTPUTS,
    CudaSdpa,
    minimum_gemm_alignment,
    priority_order,
)

aten = torch.ops.aten

CUBLAS_WORKSPACE_HOPPER = 4096 * 1024 * 8
"""``:4096:8`` (32 MiB): the default where the major compute capability is 9, 10 or 12."""
CUBLAS_WORKSPACE_DEFAULT = 4096 * 1024 * 2 + 16 * 1024 * 8
"""``:4096:2:16:8`` (8 MiB + 128 KiB): the default on every other GPU (sm70 to sm89, sm11x)."""
CUBLAS_WORKSPACE_LARGE_MAJORS = (9, 10, 12)
"""``parseChosenWorkspaceSize`` in CublasHandlePool.cpp of PyTorch 2.13: Hopper and Blackwell."""
CUBLAS_OPS = frozenset(
    getattr(getattr(aten, name), overload)
    for name in (
        "mm",
        "addmm",
        "bmm",
        "baddbmm",
        "addbmm",
        "mv",
        "addmv",
        "dot",
        "vdot",
        "_addmm_activation",
    )
    for overload in ("default", "out")
)
"""Operators whose CUDA kernels call cuBLAS/cuBLASLt (``at::cuda::blas``), and their ``out=``
variants, which Inductor's generated code calls (``extern_kernels.mm(..., out=buf)``): a
compiled region's matrix products take the workspace too."""


class CudaPolicy(DevicePolicy):
    """CUDA's decisions on a GPU of ``compute_capability``; ``gpu`` names it for the notes (None:
    none was given, the default is assumed)."""

    name = "cuda"
    allocator: AllocatorModel = CUDA_CACHING_ALLOCATOR

    def __init__(
        self,
        *,
        compute_capability: tuple[int, int] = DEFAULT_COMPUTE_CAPABILITY,
        gpu: str | None = None,
    ) -> None:
        self.compute_capability = compute_capability
        self._attention_used: set[str] = set()
        self._cublas_threads: set[str] = set()
        self._math_reasons: set[str] = set()
        """Why the math path ran where it did (``sdpa_cuda.math_reasons``)."""
        """Threads ("main", "autograd") whose cuBLAS workspace the trace added."""
        self._notes: list[str] = architecture_notes(compute_capability, gpu)

    @property
    def cublas_workspace_bytes(self) -> int:
        return cublas_workspace_bytes(self.compute_capability)

    def optimizer(self, choice: OptimizerChoice) -> OptimizerChoice:
        user_chose = "foreach" in choice.kwargs or choice.kwargs.get("fused")
        if choice.accepts("foreach") and not user_chose:
            self._notes.append(
                Note(
                    Topic.KERNELS, f"{choice.cls.__name__}: foreach implementation (CUDA's default)"
                )
            )
            return choice.with_defaults(foreach=True)
        return choice

    @contextlib.contextmanager
    def context(self) -> Iterator[None]:
        sdpa = CudaSdpa(self.compute_capability)
        with CudaAutocast(), sdpa, fused_dropout():
            yield
        self._attention_used |= sdpa.used
        self._math_reasons |= sdpa.why_math

    def op_observer(self) -> OpObserver:
        # per trace (each trace adds its own workspace); the notes collect every trace's threads
        threads_with_workspace: set[str] = set()
        workspace = self.cublas_workspace_bytes

        def observe(func: Any, args: Any, kwargs: Any, out: Any, tracker: StorageTracker) -> None:
            if func in CUBLAS_OPS:
                thread = "autograd" if tracker.phase is Phase.BACKWARD else "main"
                if thread not in threads_with_workspace:
                    threads_with_workspace.add(thread)
                    self._cublas_threads.add(thread)
                    tracker.add_synthetic(
                        workspace, f"cuBLAS workspace ({thread} thread)", Category.WORKSPACE
                    )
            scratch = BACKWARD_WORKSPACE.get(func)
            if scratch is not None:
                for label, nbytes in scratch(args):
                    tracker.add_transient(nbytes, label)
            host = HOST_OUTPUTS.get(func)
            if host is not None:
                tracker.mark_host(out[i] for i in host if isinstance(out[i], torch.Tensor))

        return observe

    def host_resident(self, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
        if not type(optimizer).__module__.startswith("torch.optim"):
            return []
        out = []
        for group in optimizer.param_groups:
            if group.get("capturable") or group.get("fused"):
                continue
            for p in group["params"]:
                step = optimizer.state.get(p, {}).get("step")
                if isinstance(step, torch.Tensor) and step.dim() == 0:
                    out.append(step)
        return out

    def notes(self) -> list[str]:
        notes = list(self._notes)
        if self._cublas_threads:
            notes.append(cublas_note(self.compute_capability, self._cublas_threads))
        if self._attention_used:
            notes.extend(sdpa_priority_notes(self.compute_capability))
            kernels = ", ".join(ATTENTION_NAMES[b] for b in BACKENDS if b in self._attention_used)
            notes.append(Note(Topic.KERNELS, f"scaled_dot_product_attention ran as {kernels}"))
            if self._math_reasons:
                notes.append(
                    Note(
                        Topic.KERNELS,
                        "attention: the math path ran because "
                        + "; ".join(sorted(self._math_reasons)),
                    )
                )
        return list(dict.fromkeys(notes))


ATTENTION_NAMES = {
    "cudnn": "cuDNN attention",
    "flash": "flash attention",
    "efficient": "memory-efficient attention",
    "math": "the math path (S×S scores in fp32)",
}


def cublas_workspace_bytes(compute_capability: tuple[int, int]) -> int:
    """The cuBLAS workspace PyTorch 2.13 allocates per thread on this GPU."""
    if compute_capability[0] in CUBLAS_WORKSPACE_LARGE_MAJORS:
        return CUBLAS_WORKSPACE_HOPPER
    return CUBLAS_WORKSPACE_DEFAULT


def cublas_note(cc: tuple[int, int], threads: set[str]) -> str:
    """The cuBLAS workspace the trace added, on the threads whose matrix products it ran."""
    workspace = cublas_workspace_bytes(cc)
    config = ":4096:8" if workspace == CUBLAS_WORKSPACE_HOPPER else ":4096:2:16:8"
    return Note(
        Topic.KERNELS,
        f"cuBLAS workspace {format_bytes(workspace)} per thread that ran a matrix product "
        f"({', '.join(sorted(threads))}; {config}, PyTorch's default "
        f"{'on sm9x/sm10x/sm12x' if workspace == CUBLAS_WORKSPACE_HOPPER else 'below sm90 and on sm11x'}"
        "; CublasHandlePool.cpp), shared with cuBLASLt",
    )


def sdpa_priority_notes(cc: tuple[int, int]) -> list[str]:
    """The order scaled_dot_product_attention tries its CUDA kernels on this compute capability
    (noted only for a trace that called it)."""
    notes: list[str] = []
    order = priority_order(cc)
    if order[0] == "cudnn":
        notes.append(
            "attention: cuDNN attention first (PyTorch prefers it on sm9x/sm10x with cuDNN newer "
            "than 9.15; the torch 2.13 wheel ships 9.20), then flash, memory-efficient, math"
        )
    elif cc >= FLASH_SMS[0]:
        notes.append(
            "attention: flash, then memory-efficient, then math (cuDNN attention goes first "
            "only on sm9x/sm10x)"
        )
    else:
        notes.append(
            f"attention: no flash or cuDNN attention below sm80; memory-efficient attention "
            f"takes fp16 and fp32 only (head dims multiples of "
            f"{minimum_gemm_alignment(torch.float16, cc)} for fp16), so bf16 runs the math path"
        )
    if any(lo <= cc <= hi for lo, hi in FLASH_TRAINING_HEAD_DIM_SMS):
        notes.append(
            f"attention: on sm{cc[0]}{cc[1]} flash does not train head dims in "
            f"({FLASH_TRAINING_HEAD_DIM}, {FLASH_TRAINING_HEAD_DIM_NO_DROPOUT}], nor up to "
            f"{FLASH_MAX_HEAD_DIM} with dropout"
        )
    return [Note(Topic.KERNELS, n) for n in notes]


@contextlib.contextmanager
def fused_dropout() -> Iterator[None]:
    """``F.dropout`` as on a CUDA tensor: ``native_dropout`` (bool mask) whenever
    ``is_fused_kernel_acceptable`` (training, 0 < p < 1, a non-empty input); in place, the
    result copied back (``dropout_`` in Dropout.cpp)."""
    original = torch.nn.functional.dropout

    def dropout(input, p=0.5, training=True, inplace=False):
        if not training or not 0 < p < 1 or input.numel() == 0:
            return original(input, p, training, inplace)
        out = torch.native_dropout(input, p, True)[0]
        return input.copy_(out) if inplace else out

    torch.nn.functional.dropout = dropout
    try:
        yield
    finally:
        torch.nn.functional.dropout = original
