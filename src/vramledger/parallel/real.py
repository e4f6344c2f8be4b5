"""Real data-parallel runs: wrap a real model with the real engine of a strategy, in a process
group that torchrun (or a test) started — gloo on CPU, NCCL on GPUs.

========  ==================================================================================
ddp       ``DistributedDataParallel``
zero1     ``DistributedDataParallel`` + ``ZeroRedundancyOptimizer`` over the optimizer class
zero3     ``fully_shard`` (FSDP2) on each block of the largest stack of identical blocks and on
fsdp      the root
zero2     not measurable here: it is DeepSpeed's engine (the estimate models its layout)
========  ==================================================================================
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..errors import InputError
from ..optimizers import OptimizerChoice
from ..spec import TrainingSpec
from ..trace.blocks import find_block_stack


def check_world(spec: TrainingSpec) -> None:
    if not dist.is_initialized():
        raise InputError(
            f"measuring {spec.strategy} on {spec.world_size} ranks needs a process group",
            hint=f"launch with torchrun --nproc-per-node {spec.world_size} -m vramledger.cli measure ...",
        )
    if dist.get_world_size() != spec.world_size:
        raise InputError(
            f"--world-size {spec.world_size} but the process group has {dist.get_world_size()} ranks"
        )
    if spec.strategy == "zero2":
        raise InputError(
            "zero2 is DeepSpeed's engine, which is not run here",
            hint="measure zero1, zero3 or fsdp",
        )
    if spec.precision.endswith("-mixed") and spec.strategy == "zero1":
        raise InputError(
            "measuring zero1 with master weights is not supported", hint="use fsdp, or fp32"
        )


def wrap_real(model: nn.Module, spec: TrainingSpec, precision_name: str) -> nn.Module:
    if spec.strategy in ("ddp", "zero1"):
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model)
    if spec.strategy in ("zero3", "fsdp"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        device = "cuda" if next(model.parameters()).is_cuda else "cpu"
        mesh = init_device_mesh(device, (spec.world_size,))
        mp = MixedPrecisionPolicy()
        if precision_name in ("bf16-mixed", "fp16-mixed"):
            half = torch.bfloat16 if precision_name == "bf16-mixed" else torch.float16
            mp = MixedPrecisionPolicy(param_dtype=half, reduce_dtype=torch.float32)
        stack = find_block_stack(model, min_blocks=1)
        if stack is not None:
            for block in model.get_submodule(stack.fqn):
                fully_shard(block, mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=mp)
        return model
    return model


def real_optimizer(choice: OptimizerChoice, spec: TrainingSpec) -> OptimizerChoice:
    """ZeRO-1: the user's optimizer inside a ZeroRedundancyOptimizer."""
    if spec.strategy != "zero1":
        return choice
    from torch.distributed.optim import ZeroRedundancyOptimizer

    def build(params: list[torch.Tensor], c: OptimizerChoice) -> Any:
        return ZeroRedundancyOptimizer(params, optimizer_class=c.cls, **c.kwargs)

    return choice.with_builder(build, "measured")


def gather_peaks(value: dict[str, Any]) -> list[dict[str, Any]]:
    """Every rank's result, on every rank (rank 0 reports them)."""
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
"""Environment variables torchrun sets for each process it launches."""


def launched_by_torchrun() -> bool:
    import os

    return all(name in os.environ for name in TORCHRUN_ENV)


@contextlib.contextmanager
def torchrun_group(device: str) -> Iterator[int | None]:
    """The process group of a torchrun launch (gloo on CPU, NCCL on CUDA), made here if the
    launcher did not make it; yields the world size, or None outside torchrun."""
    if not launched_by_torchrun() or dist.is_initialized():
        yield dist.get_world_size() if dist.is_initialized() else None
        return
    dist.init_process_group("nccl" if device == "cuda" else "gloo")
    try:
        yield dist.get_world_size()
    finally:
        shut_down_group()


def shut_down_group() -> None:
    """Destroy the process group once every rank is done with it and the engines that used it
    are gone: a gloo group torn down under a live engine can abort the process."""
    import gc

    gc.collect()
    dist.barrier()
    dist.destroy_process_group()
