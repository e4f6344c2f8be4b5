"""DeepSpeed ZeRO-3 on a fake process group: what both its traces need, the estimate's
(``deepspeed_engine.py``, ``--strategy zero3``) and a user's program's
(``program_deepspeed.py``, its own ``deepspeed.initialize`` with stage 3).

``DeepSpeedZeroOptimizer_Stage3`` partitions each parameter on its own (``ds_tensor``, a
``ceil(numel / N)``-element slice, the last rank's padded; parameters under
``stage3_param_persistence_threshold`` elements stay whole on every rank), flattens this rank's
slices into its flat half-precision shard, keeps the fp32 partition and optimizer state of it
per sub-group (``sub_group_size``) and a flat buffer of its gradients' slices, and gathers each
module's parameters in a forward/backward pre-hook (``PartitionedParameterCoordinator``:
prefetching up to ``stage3_prefetch_bucket_size`` elements ahead, at most
``stage3_max_live_parameters`` gathered, ``stage3_max_reuse_distance``), releasing them after.
All of it runs as DeepSpeed runs it; two things are changed, each the least that lets it run
on a fake process group and say what it made:

1. its checks that every rank sees rank 0's order of parameters (a broadcast of a few int64s)
   answer with the rank's own list (:func:`rank0_lists_own`);
2. each module's gathered parameters are told to the trace as ``all_gather_buffers``, as
   FSDP2's gathered units are (:func:`gathers_tagged`; persistent parameters, whole on every
   rank from the set-up on, are among them once their module is fetched).

Categories (``deepspeed_engine.tag_optimizer_buffers``): the flat half-precision shard
``sharded_parameters``, the fp32 partitions ``master_weights``, the flat gradient slices
``sharded_gradients``, the reduce bucket ``gradient_buckets``, the gathered parameters
``all_gather_buffers``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any
from unittest import mock

import torch

from vramledger.inputs.categories import Category
from vramledger.inputs.notes import Note, Topic

Register = Callable[[list[torch.Tensor], Category], None]

ZERO3_CHECKS_NOTE = Note(
    Topic.ENGINE,
    "DeepSpeed ZeRO-3's checks that every rank sees rank 0's order of parameters (a broadcast of "
    "a few int64s from rank 0) answered with the rank's own: every traced rank runs the same "
    "program, and a fake process group carries no values",
)


@contextlib.contextmanager
def zero3_on_fake_group(register: Register, notes: dict[str, None]) -> Iterator[None]:
    """Both changes of the module docstring, for as long as the context is active."""
    with rank0_lists_own(notes), gathers_tagged(register):
        yield


@contextlib.contextmanager
def rank0_lists_own(notes: dict[str, None] | list[str]) -> Iterator[None]:
    """ZeRO-3's ``assert_ints_same_as_other_ranks`` (``deepspeed/runtime/zero/utils.py``)
    broadcasts rank 0's list of ints and compares it with the rank's own; on a fake process
    group the broadcast leaves each rank's placeholder (-1), so the check would fail on every
    rank but 0. Rank 0's list is the rank's own here, and ``ZERO3_CHECKS_NOTE`` is added to
    ``notes`` (a program's notes, a dict; the estimate's rank's, a list) when DeepSpeed ran a
    check."""
    from deepspeed.runtime.zero import utils

    def own(lst: list[int]) -> list[int]:
        if isinstance(notes, dict):
            notes[ZERO3_CHECKS_NOTE] = None
        elif ZERO3_CHECKS_NOTE not in notes:
            notes.append(ZERO3_CHECKS_NOTE)
        return list(lst)

    with (
        mock.patch.object(utils, "assert_lst_len_same_as_other_ranks", own),
        mock.patch.object(utils, "get_lst_from_rank0", own),
    ):
        yield


@contextlib.contextmanager
def gathers_tagged(register: Register) -> Iterator[None]:
    """ZeRO-3's gathered parameters are ``all_gather_buffers``, as FSDP2's gathered units in the
    estimate: each module's parameters, once ``PartitionedParameterCoordinator.fetch_sub_module``
    has gathered them (views of the all-gather's flat output)."""
    from deepspeed.runtime.zero.partitioned_param_coordinator import (
        PartitionedParameterCoordinator,
        iter_params,
    )

    fetch = PartitionedParameterCoordinator.__dict__["fetch_sub_module"]

    def fetched(coordinator: Any, module: Any, *args: Any, **kwargs: Any) -> None:
        fetch(coordinator, module, *args, **kwargs)
        gathered = [p.data for p in iter_params(module, recurse=True) if p.data.numel()]
        register(gathered, Category.ALL_GATHER_BUFFERS)

    with mock.patch.object(PartitionedParameterCoordinator, "fetch_sub_module", fetched):
        yield
