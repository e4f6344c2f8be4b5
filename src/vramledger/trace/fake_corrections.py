"""Where a fake (meta) kernel's outputs differ in size from the real kernel's.

The tracker records a fake output's bytes from its storage; for the operators listed here the
meta implementation returns a different dtype than the real CPU and CUDA kernels, so the bytes
are corrected (the fake tensor itself is left as it is; only the ledger changes). Each entry is
checked against a real CPU run in ``tests/test_ground_truth.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

aten = torch.ops.aten

Correction = Callable[[Sequence[Any], Any], dict[int, int]]
"""(args, outputs) -> {id(output tensor): real nbytes}."""

_HALF = (torch.float16, torch.bfloat16)
ACC_ITEMSIZE = torch.float32.itemsize
"""Batch-norm statistics of half-precision inputs are kept in float32, the accumulate type
(``at::acc_type``): CPU ``batch_norm_cpu`` in aten/src/ATen/native/Normalization.cpp and CUDA
``batch_norm_cuda`` allocate ``save_mean``/``save_invstd`` with the accumulate dtype."""


def _batch_norm_stats(args: Sequence[Any], out: Any) -> dict[int, int]:
    x = args[0]
    if not isinstance(x, torch.Tensor) or x.dtype not in _HALF:
        return {}
    fixes = {}
    for stat in (out[1], out[2]):
        if isinstance(stat, torch.Tensor) and stat.dtype in _HALF:
            fixes[id(stat)] = stat.numel() * ACC_ITEMSIZE
    return fixes


CORRECTIONS: dict[Any, Correction] = {
    aten.native_batch_norm.default: _batch_norm_stats,
    aten._native_batch_norm_legit.default: _batch_norm_stats,
    aten._native_batch_norm_legit.no_stats: _batch_norm_stats,
    aten._native_batch_norm_legit_no_training.default: _batch_norm_stats,
    aten._native_batch_norm_legit_functional.default: _batch_norm_stats,
}
