"""What a trace runs under: the engine that spreads the step over ranks, as the tracer sees it.

The tracer does not know strategies. It is given an :class:`Engine` (``parallel/`` provides the
data-parallel ones; :class:`SingleDevice` is the default) and asks it, per traced run, for a
:class:`RankEngine` that wraps the model (FSDP2's ``fully_shard``), chooses the parameters this
rank's optimizer steps (ZeRO-1/2), adds the buffers the engine allocates outside operators (DDP's
gradient buckets), and names the categories of the storages its operators make. After the
trace, the engine finishes the timeline (what offload keeps in host memory). An engine that runs
its own training step (DeepSpeed's) also builds it (``assemble``, optional).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import nn

from vramledger.inputs.categories import Category
from vramledger.inputs.recipe import Recipe
from vramledger.record.timeline import Timeline

Track = Callable[[list[torch.Tensor], Category], None]


class RankEngine(Protocol):
    """One rank's engine during one traced run."""

    notes: list[str]
    op_categories: dict[str, Category]
    """Operator name -> category of the storages it makes (FSDP2's all-gather buffers)."""
    resize_category: Category | None
    """Category of storages brought to life by ``UntypedStorage.resize_`` (FSDP2)."""

    def wrap(self, model: nn.Module, blocks: list[nn.Module], precision_name: str) -> nn.Module: ...

    def owned(self, params: list[nn.Parameter]) -> list[nn.Parameter]: ...

    def add_buckets(self, model: nn.Module, track: Track) -> None: ...

    # Optional, read with getattr by the tracer:
    # ``scalar_answer: int`` — what ``.item()`` in the optimizer phase is answered (default 1);
    # ``assemble(**same keywords as training.assemble)`` — builds the step instead of
    # ``training.assemble``, for an engine that runs its own step (DeepSpeed); returns an object
    # with ``run(steps, observer)``.


class Engine(Protocol):
    """How one estimate spreads the step over ranks."""

    def adapt(self, recipe: Recipe) -> Recipe:
        """The recipe as this engine runs it (FSDP2 keeps fp32 shards under mixed precision)."""
        ...

    def rank(self, rank: int) -> contextlib.AbstractContextManager[RankEngine]:
        """A rank's engine for one traced run (with its process group, if any)."""
        ...

    def finish(self, timeline: Timeline, recipe: Recipe) -> list[str]:
        """Apply what the engine does outside the trace (offload); returns notes."""
        ...


@dataclass
class _NoRank:
    notes: list[str] = field(default_factory=list)
    op_categories: dict[str, Category] = field(default_factory=dict)
    resize_category: Category | None = None

    def wrap(self, model: nn.Module, blocks: list[nn.Module], precision_name: str) -> nn.Module:
        return model

    def owned(self, params: list[nn.Parameter]) -> list[nn.Parameter]:
        return params

    def add_buckets(self, model: nn.Module, track: Track) -> None:
        pass


class SingleDevice:
    """One device, no engine."""

    def adapt(self, recipe: Recipe) -> Recipe:
        return recipe

    @contextlib.contextmanager
    def rank(self, rank: int) -> Iterator[RankEngine]:
        yield _NoRank()

    def finish(self, timeline: Timeline, recipe: Recipe) -> list[str]:
        return []
