"""Real data-parallel engines: wrap a real model with the real engine of a strategy, in a process
group that torchrun (or a test) started — gloo on CPU, NCCL on GPUs. The runs that measure them
live in ``measure/``.

=============  ==============================================================================
ddp            ``DistributedDataParallel``
zero1-torch    ``DistributedDataParallel`` + ``ZeroRedundancyOptimizer`` over the optimizer class
fsdp           ``fully_shard`` (FSDP2) on the units the estimate shards (``fsdp_units.py``: each
               block of the largest stack of identical blocks, or the named units) and the root
zero0..zero3   DeepSpeed's own engine (``deepspeed_engine.py``), built by the same code as the
               estimate's: ``measure/deepspeed.py`` (``vramledger measure`` runs it there)
=============  ==============================================================================
"""

from __future__ import annotations

import contextlib
import gc
import os
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

from vramledger.inputs.errors import InputError
from vramledger.inputs.optimizers import OptimizerChoice
from vramledger.inputs.spec import TrainingSpec
from vramledger.parallel.fake_group import forget_sharding_propagation
from vramledger.parallel.fsdp_units import apply_fully_shard
from vramledger.parallel.mesh import applied, apply_inner_parallelism, build_mesh, uses_mesh
from vramledger.parallel.mesh import in_step_context as mesh_step_context


def wrap_real(model: nn.Module, spec: TrainingSpec, precision_name: str) -> nn.Module:
    if uses_mesh(spec):  # tensor / context / expert parallel (and FSDP2 over data parallel)
        if spec.parallelism.is_ddp and spec.dp_degree * spec.cp > 1:
            raise InputError(
                "measuring DDP over a tensor/context/expert-parallel model is not supported",
                hint="measure it with --strategy fsdp over the data-parallel ranks",
            )
        device = "cuda" if next(model.parameters()).is_cuda else "cpu"
        return apply_inner_parallelism(model, build_mesh(spec, device), spec, [], precision_name)
    if spec.parallelism.is_ddp:
        return DistributedDataParallel(model)
    if spec.parallelism.is_fsdp:
        device = "cuda" if next(model.parameters()).is_cuda else "cpu"
        mesh = init_device_mesh(device, (spec.world_size,))
        apply_fully_shard(model, spec, mesh, precision_name)  # as the estimate wraps it
        return model
    return model


def in_step_context(run: Any, model: nn.Module) -> Any:
    """The run, its steps inside what the parallelized model needs around them (loss parallel,
    context parallel: ``mesh.step_context``), as in the estimate."""
    return mesh_step_context(run, model) if applied(model).words else run


def real_optimizer(choice: OptimizerChoice, spec: TrainingSpec) -> OptimizerChoice:
    """zero1-torch: the user's optimizer inside a ZeroRedundancyOptimizer."""
    if not spec.parallelism.is_zero_redundancy:
        return choice

    def build(params: list[torch.Tensor], c: OptimizerChoice) -> Any:
        return ZeroRedundancyOptimizer(params, optimizer_class=c.cls, **c.kwargs)

    return choice.with_builder(build, "measured")


TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
"""Environment variables torchrun sets for each process it launches."""


def launched_by_torchrun() -> bool:
    return all(name in os.environ for name in TORCHRUN_ENV)


@contextlib.contextmanager
def torchrun_group(device: str) -> Iterator[int | None]:
    """The process group of a torchrun launch (gloo on CPU, NCCL on CUDA), made here if the
    launcher did not make it; yields the world size, or None outside torchrun. DTensor's caches
    kept by an earlier fake trace in this process are emptied first (``fake_group.py``)."""
    forget_sharding_propagation()
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
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()
