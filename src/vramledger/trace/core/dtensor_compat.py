"""Where DTensor allocates during a trace what it would not allocate on a GPU.

DTensor's sharding propagation (``ShardingPropagator._propagate_tensor_meta_non_cached``) runs
each operator once on global-shape fake tensors to learn its output's shape and strides. On a
GPU it makes a fresh ``FakeTensorMode`` for that, so no memory is used; during a trace it finds
the trace's own fake mode (``detect_fake_mode()``) and the tracker would count those global-shape
tensors as temporaries of the rank (a full unsharded copy of every parameter an uncached foreach
optimizer step touches). This module runs that propagation outside the trace's modes (dispatch
and function modes), as on a GPU.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any
from unittest import mock  # torch imports it already

import torch


@contextlib.contextmanager
def untracked_sharding_propagation() -> Iterator[None]:
    try:
        from torch.distributed.tensor._sharding_prop import ShardingPropagator
    except ImportError:  # pragma: no cover - torch without torch.distributed
        yield
        return
    from torch.utils._python_dispatch import _disable_current_modes

    original = ShardingPropagator._propagate_tensor_meta_non_cached

    def outside_the_trace(self: Any, *args: Any, **kwargs: Any) -> Any:
        # no function mode either: a backward runs under the CUDA emulation's
        # (``cuda_calls._BACKWARD``), which would make the propagation's
        # ``torch.empty_strided(..., device="cuda")`` a tensor of the trace's fake mode
        with _disable_current_modes(), torch._C.DisableTorchFunction():
            return original(self, *args, **kwargs)

    with mock.patch.object(
        ShardingPropagator, "_propagate_tensor_meta_non_cached", outside_the_trace
    ):
        yield
