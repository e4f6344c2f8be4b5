"""NCCL's ``PREMUL_SUM`` reduction on the gloo group of a real CPU run.

FSDP2 reduce-scatters gradients with ``ReduceOp.PREMUL_SUM(1 / factor)`` when a program sets
its own gradient divide factor (``FSDPModule.set_gradient_divide_factor``; torchtitan sets 1.0
and divides by the global token count itself): ``_get_gradient_divide_factors`` in
torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py. NCCL has that reduction; gloo refuses
it ("Cannot use ReduceOp.PREMUL_SUM with Gloo"). In ``run --measure`` ("cuda" is the CPU and
the program's NCCL group is answered by gloo) the collective runs as a SUM and its result is
then multiplied in place by the factor: the same values, and no memory NCCL would not take (an
in-place multiply allocates nothing; NCCL scales as it reduces).
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch.distributed import ReduceOp

REDUCTIONS = {
    dist.all_reduce: "tensor",
    dist.reduce_scatter_single: "output",
    dist.reduce_scatter: "output",
}
"""The collectives that take ``op`` and reach a ``TorchFunctionMode`` (their
``handle_torch_function``), and the argument they write their result into."""


def premul_factor(kwargs: dict[str, Any]) -> Any:
    """The factor of a ``PREMUL_SUM`` ``op`` (a number or a tensor), None for any other op."""
    op = kwargs.get("op")
    # ReduceOp.SUM and the like are RedOpType members, with no .op
    if getattr(op, "op", None) == ReduceOp.PREMUL_SUM:
        return op.factor
    return None


def reduce_then_scale(func: Any, args: tuple, kwargs: dict[str, Any]) -> Any:
    """``func`` (one of :data:`REDUCTIONS`) with ``PREMUL_SUM(f)`` run as SUM, then its result
    multiplied by ``f`` in place (after the wait of an ``async_op``, whose work is returned,
    done). Any other op runs as asked."""
    factor = premul_factor(kwargs)
    if factor is None:
        return func(*args, **kwargs)
    work = func(*args, **{**kwargs, "op": ReduceOp.SUM})
    if work is not None:
        work.wait()
    result = args[0] if args else kwargs[REDUCTIONS[func]]
    result.mul_(factor)
    return work
