"""A fake process group in this process: PyTorch's own (``torch.testing._internal.distributed
.fake_pg``: the "fake" backend on a ``FakeStore``). Collectives return at once with exact shapes
and no other process exists, so one process traces any rank of a world (the estimate's engines,
``engines.py`` and ``mesh.py``; a user's program run as one of torchrun's ranks,
``program_world.py``).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist

from vramledger.inputs.errors import InputError

_kept: int | None = None
"""The rank of the last fake process group that made no other group: its DTensor
sharding-propagation caches are kept for the next one of the same rank."""


@contextlib.contextmanager
def fake_process_group(rank: int, world_size: int, **kwargs: Any) -> Iterator[None]:
    """The default process group: a fake one of ``world_size`` ranks, as ``rank``; destroyed on
    exit unless it was already (a program that destroys its own). ``kwargs`` are
    ``init_process_group``'s others (``timeout``, ``group_name``, ``pg_options``).

    DTensor's sharding-propagation caches (``forget_sharding_propagation``) are kept from one
    fake process group to the next when the first made no group beyond the default one and the
    next is the same rank: every mesh a cached output spec holds then names only the default
    group, named ``'0'`` in every process group (torch 2.13 ignores ``group_name`` for it;
    ``tests/test_fake_group.py``), and is this rank's (a mesh of another world size is another
    key in the caches: ``DeviceMesh`` compares its ranks and layout). Otherwise they
    are emptied before the new group's first DTensor operator (other groups are named by a
    counter, which another trace may give to another group). A 70B FSDP2 trace's first step
    propagated 13 operators' shardings again at each trace, 0.3 s, when they were emptied
    between ``fit``'s sizes (``benchmarks/estimate_phases.py``)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    global _kept
    if dist.is_initialized():
        raise InputError(
            "a distributed estimate cannot run inside an initialised process group",
            hint="run vramledger estimate outside torchrun",
        )
    hook = sys.excepthook  # init_process_group wraps it to prefix "[rankN]:" to tracebacks
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size, **kwargs)
    if rank != _kept:
        forget_sharding_propagation()
    try:
        yield
    finally:
        alone = dist.is_initialized() and len(dist.distributed_c10d._world.pg_names) == 1
        if dist.is_initialized():
            dist.destroy_process_group()
        if alone:
            _kept = rank
        else:
            forget_sharding_propagation()
        sys.excepthook = hook


def forget_sharding_propagation() -> None:
    """Empty DTensor's sharding-propagation caches (Python's and the C++ fast path's:
    ``torch.distributed.tensor.debug._clear_sharding_prop_cache``). They are keyed by the
    operator's input specs, whose meshes compare equal across ranks (``DeviceMesh.__eq__``
    compares the root rank map and the layout, not the rank's own row: the tp mesh of ranks
    0, 1 equals that of ranks 2, 3), and they return output specs holding the mesh they were
    first computed with. One process that traces several ranks in turn, each on its own fake
    process group, would otherwise run a collective on a group of an earlier process group
    (pipeline stages x tensor parallelism: stage 0's embedding reduce-scattering on the tp
    group that stage 1's rank had)."""
    global _kept
    _kept = None
    try:
        from torch.distributed.tensor import debug
    except ImportError:  # pragma: no cover - torch without torch.distributed
        return
    clear = getattr(debug, "_clear_sharding_prop_cache", None)
    if clear is not None:
        clear()
