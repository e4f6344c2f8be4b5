"""Expert parallelism: the experts of each mixture-of-experts layer split over ``ep`` ranks,
tokens sent to their experts' ranks and back with all-to-all.

Run by transformers 5's own expert parallelism (``transformers.distributed.expert_parallel``,
the path ``from_pretrained(..., distributed_config=DistributedConfig(ep_size=...))`` takes),
with the model family's ``ep_plan``: ``grouped_gemm`` (``MoEParamShard``: each expert weight
``Shard(0)`` on the ep mesh, whole experts per rank, ``num_experts`` set to the local count) and
``ep_dispatch_experts`` (``EpDispatchExpertsParallel`` with ``AllToAllEP``, what training
runs: each (token, expert) pair gathered by expert, an all-to-all of the counts, an all-to-all of
the token rows to the experts' ranks, the experts, and an all-to-all back). The ep ranks are
borrowed from the data-parallel x context-parallel ranks as torchtitan does
(``mesh.py``); FSDP2 then shards each experts module over the remaining data-parallel ranks
(torchtitan's ``dp_shard_mod_ep``) before the blocks are sharded over all of them.

What a fake process group cannot give: the counts every rank sends to this one (the first
all-to-all). They are answered from this rank's own counts — every rank of the group routes
its batch with the same policy (``trace/core/values.py``: balanced, first or last), so each sends
this rank what this rank sends itself. Under ``balanced`` routing every rank receives the same;
under ``first`` the rank owning the first experts (rank 0, the one traced) receives the most.
"""

from __future__ import annotations

import contextlib
import fnmatch
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from vramledger.inputs.errors import InputError


def ep_plan(model: nn.Module) -> dict[str, str]:
    """The family's expert-parallel plan, patterns expanded to module and parameter names."""
    family = getattr(model, "ep_plan", None) or getattr(model, "_ep_plan", None)
    if not family:
        raise InputError(
            f"{type(model).__name__} has no expert-parallel plan (transformers' ep_plan)",
            hint="--ep applies to mixture-of-experts models whose family declares one",
        )
    names = [n for n, _ in model.named_modules()] + [n for n, _ in model.named_parameters()]
    plan = {}
    for pattern, style in family.items():
        for name in names:
            if fnmatch.fnmatchcase(name, pattern):
                plan[name] = style
    return plan


def expert_modules(model: nn.Module, plan: dict[str, str]) -> list[nn.Module]:
    """The modules whose tokens are dispatched (``ep_dispatch_experts``)."""
    modules = dict(model.named_modules())
    return [modules[n] for n, style in plan.items() if style == "ep_dispatch_experts"]


def apply_expert_parallel(model: nn.Module, ep_mesh: Any, tp_mesh: Any) -> list[nn.Module]:
    """transformers' ``apply_expert_parallelism`` with the family's plan and ``AllToAllEP``;
    returns the experts modules."""
    from transformers.distributed.expert_parallel import apply_expert_parallelism

    plan = ep_plan(model)
    experts = expert_modules(model, plan)
    if not experts:
        raise InputError(f"{type(model).__name__}'s ep_plan names no experts module")
    for module in experts:
        n = getattr(module, "num_experts", None)
        if n is not None and n % ep_mesh.size():
            raise InputError(
                f"{n} experts do not split evenly over ep {ep_mesh.size()} ranks",
                hint="use an ep that divides the number of experts",
            )
    apply_expert_parallelism(model, ep_mesh, tp_mesh, plan, ep_implementation="all_to_all")
    return experts


@contextlib.contextmanager
def symmetric_count_exchange(rank_in_group: int) -> Iterator[None]:
    """On a fake process group: the all-to-all of token counts answered as every rank of the
    group would send them (module docstring) — this rank's own row, from each rank."""
    from transformers.distributed import expert_parallel

    original = expert_parallel.all_to_all_single

    def exchange(output: torch.Tensor, input: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        if output.dim() != 2 or output.shape != input.shape:  # not the count exchange
            original(output, input, *args, **kwargs)
            return
        output.copy_(input[rank_in_group].expand_as(output))

    expert_parallel.all_to_all_single = exchange
    try:
        yield
    finally:
        expert_parallel.all_to_all_single = original
