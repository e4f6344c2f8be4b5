"""Where a fake (meta) kernel's outputs differ in size from the real kernel's.

For the operators listed here the meta implementation returns outputs of a different dtype
than the real CPU and CUDA kernels; the tracker replaces those outputs by fake tensors of the
real dtype before anything sees them, so the ledger, the saved tensors and the backward all
match a real run. Each entry is checked against a real CPU run in ``tests/test_ground_truth.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

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


CORRECTIONS: dict[Any, Correction] = {
    aten.native_batch_norm.default: _batch_norm_stats,
    aten._native_batch_norm_legit.default: _batch_norm_stats,
    aten._native_batch_norm_legit.no_stats: _batch_norm_stats,
    aten._native_batch_norm_legit_no_training.default: _batch_norm_stats,
    aten._native_batch_norm_legit_functional.default: _batch_norm_stats,
}
