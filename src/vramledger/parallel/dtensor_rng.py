"""DTensor's random operators on a mesh of the emulated GPU (a program's "cuda" device mesh, made
where ``torch.cuda.is_available()``: torchtitan's ``init_device_mesh("cuda", ...)``) draw as on a
CPU mesh: locally, with no RNG tracker.

On a CUDA mesh DTensor makes an ``OffsetBasedRNGTracker`` at its first random operator (or at
``torch.distributed.tensor._random.manual_seed``): it reads the device's Philox state with
``torch.cuda.get_rng_state().to(device)`` (``_get_device_state`` in
torch/distributed/tensor/_random.py), a copy to CUDA made inside DTensor's dispatch where no
function mode sees it, which a CPU-only PyTorch refuses ("Could not run 'aten::empty_strided'
... from the 'CUDA' backend"), and it keeps the state as 16 bytes per random operator, made and
freed around the draw. A CPU mesh has no tracker (``is_rng_supported_mesh`` is False for the
CPU); the emulation answers so for the "cuda" mesh too, in the trace and in the real CPU run
alike. The draws' values differ from a GPU run's (no memory depends on them); the 16-byte state
copies (one 512-byte block of the CUDA caching allocator each, while a random operator runs:
parameter initialisation, dropout) are not counted.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator
from typing import Any

_OWNERS = (
    "torch.distributed.tensor._random",
    "torch.distributed.tensor._dispatch",
    "torch.distributed.tensor._api",
)
"""Where ``is_rng_supported_mesh`` is looked up (``_dispatch`` and ``_api`` import the name)."""


@contextlib.contextmanager
def host_rng_on_emulated_mesh() -> Iterator[None]:
    """While active, ``is_rng_supported_mesh`` is False for a "cuda" mesh (module docstring)."""
    owners = [importlib.import_module(name) for name in _OWNERS]
    original = owners[0].is_rng_supported_mesh

    def is_rng_supported_mesh(device_mesh: Any) -> bool:
        return device_mesh.device_type != "cuda" and original(device_mesh)

    saved = [(owner, owner.__dict__.get("is_rng_supported_mesh")) for owner in owners]
    for owner in owners:
        owner.is_rng_supported_mesh = is_rng_supported_mesh
    try:
        yield
    finally:
        for owner, function in saved:
            if function is not None:
                owner.is_rng_supported_mesh = function
            else:  # the name was not there (``_api`` of torch 2.13 has none): not left behind
                del owner.is_rng_supported_mesh
