"""One rank of a program launched as ``torchrun`` launches it: the environment each process gets,
and the program's ``torch.distributed.init_process_group`` answered by whoever runs the rank.

torchrun (``torch/distributed/elastic/agent/server/local_elastic_agent.py``, ``_start_workers``)
gives every process it starts ``RANK``, ``LOCAL_RANK``, ``GROUP_RANK``, ``ROLE_RANK``,
``ROLE_NAME``, ``LOCAL_WORLD_SIZE``, ``WORLD_SIZE``, ``GROUP_WORLD_SIZE``, ``ROLE_WORLD_SIZE``,
``MASTER_ADDR``, ``MASTER_PORT`` and the ``TORCHELASTIC_*`` variables
(``torch.distributed.is_torchelastic_launched()`` reads ``TORCHELASTIC_RUN_ID``). A program reads
them directly (``int(os.environ["LOCAL_RANK"])``) or through ``init_process_group``'s default
``env://`` rendezvous. Here ``init_process_group`` is replaced while the program runs: whatever
backend it asks for (``nccl``, ``gloo``, none), the process group is the one :func:`as_rank`'s
caller makes (a fake one in a trace, ``parallel/program_world.py``; the real gloo group of a
measured run, ``measure/program.py``).

Nothing here knows of memory or tensors; ranks are numbered as torchrun numbers them (node-major:
rank = node x nproc_per_node + local rank).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

MASTER_ADDR = "127.0.0.1"
MASTER_PORT = 29500
"""torchrun's default ``--master-port`` (``torch/distributed/run.py``)."""
RUN_ID = "vramledger"
"""``TORCHELASTIC_RUN_ID`` (torchrun's ``--rdzv-id``; its default is "none")."""

InitGroup = Callable[[str | None, dict[str, Any]], None]
"""``init(backend, kwargs)``: make the default process group for the program's
``init_process_group(backend, **kwargs)``."""


@dataclass(frozen=True, kw_only=True)
class TorchrunRank:
    """Where one process sits in a torchrun launch."""

    rank: int
    """Global rank (``RANK``)."""
    nproc_per_node: int
    nnodes: int = 1
    master_port: int = MASTER_PORT

    def __post_init__(self) -> None:
        assert 0 <= self.rank < self.world_size, (self.rank, self.world_size)

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes

    @property
    def local_rank(self) -> int:
        return self.rank % self.nproc_per_node

    @property
    def node(self) -> int:
        """``GROUP_RANK``: the node's index."""
        return self.rank // self.nproc_per_node

    def environment(self) -> dict[str, str]:
        """The variables torchrun sets for this process."""
        return {
            "RANK": str(self.rank),
            "LOCAL_RANK": str(self.local_rank),
            "GROUP_RANK": str(self.node),
            "ROLE_RANK": str(self.rank),
            "ROLE_NAME": "default",
            "LOCAL_WORLD_SIZE": str(self.nproc_per_node),
            "WORLD_SIZE": str(self.world_size),
            "GROUP_WORLD_SIZE": str(self.nnodes),
            "ROLE_WORLD_SIZE": str(self.world_size),
            "MASTER_ADDR": MASTER_ADDR,
            "MASTER_PORT": str(self.master_port),
            "TORCHELASTIC_RESTART_COUNT": "0",
            "TORCHELASTIC_MAX_RESTARTS": "0",
            "TORCHELASTIC_RUN_ID": RUN_ID,
            "TORCHELASTIC_USE_AGENT_STORE": "False",
        }


@contextlib.contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@contextlib.contextmanager
def as_rank(where: TorchrunRank, init: InitGroup) -> Iterator[list[str]]:
    """The program runs as ``where``: torchrun's environment, and its ``init_process_group``
    (``torch.distributed``'s, wherever the program looks it up) made by ``init``. Yields the
    backends the program asked for, in order (notes)."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    asked: list[str] = []
    original = c10d.init_process_group

    def init_process_group(backend: Any = None, init_method: Any = None, **kwargs: Any) -> None:
        name = None if backend is None else str(backend)
        asked.append(name or "default")
        _set(original)  # ``init`` makes the group with the real one
        try:
            init(name, kwargs)
        finally:
            _set(init_process_group)

    owners = (dist, c10d)

    def _set(function: Any) -> None:
        for owner in owners:
            owner.init_process_group = function

    _set(init_process_group)
    try:
        with _environment(where.environment()):
            yield asked
    finally:
        _set(original)
