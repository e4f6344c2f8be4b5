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

from ..errors import InputError

_kept: object = None
"""The world whose sharding-propagation caches are kept between traces (``keep_caches_of``);
None: the caches hold nothing kept."""


@contextlib.contextmanager
def fake_process_group(
    rank: int, world_size: int, *, keep_caches: bool = False, **kwargs: Any
) -> Iterator[None]:
    """The default process group: a fake one of ``world_size`` ranks, as ``rank``; destroyed on
    exit unless it was already (a program that destroys its own). ``kwargs`` are
    ``init_process_group``'s others (``timeout``, ``group_name``, ``pg_options``).
    ``keep_caches``: DTensor's sharding-propagation caches are neither emptied on entry nor on
    exit; the caller names its world with ``keep_caches_of`` once its mesh is made, before any
    DTensor operator runs, and they are emptied there unless the last world kept was the
    same."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise InputError(
            "a distributed estimate cannot run inside an initialised process group",
            hint="run vramledger estimate outside torchrun",
        )
    hook = sys.excepthook  # init_process_group wraps it to prefix "[rankN]:" to tracebacks
    if not keep_caches:
        forget_sharding_propagation()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size, **kwargs)
    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        if not keep_caches:
            forget_sharding_propagation()
        sys.excepthook = hook


def keep_caches_of(world: object) -> None:
    """Keep DTensor's sharding-propagation caches for the traces of ``world`` (a value equal
    for worlds in which this process is the same rank and every mesh that compares equal names
    the same process groups: then a cached output spec's mesh, from an earlier trace, has this
    trace's rank and groups): emptied when the caches were made for another, or by a trace
    that does not keep them. A 70B FSDP2 trace's first step propagated 13 operators' shardings
    again at each trace, 0.3 s, when the caches were emptied between traces of the same world
    (``fit``'s sizes)."""
    global _kept
    if world != _kept:
        forget_sharding_propagation()
        _kept = world


def forget_unless_default_group_only() -> None:
    """Empty the sharding-propagation caches if this process group made groups beyond the
    default one: named by a counter, a name in a cached mesh could name another group in the
    next trace (call before the group is destroyed)."""
    if len(dist.distributed_c10d._world.pg_names) > 1:
        forget_sharding_propagation()


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
