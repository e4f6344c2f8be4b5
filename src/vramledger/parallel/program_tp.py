"""Tensor parallelism (``torch.distributed.tensor.parallel.parallelize_module``) inside a user's
program run as several ranks (``program_world.py``).

``parallelize_module`` runs as it is, on the rank's fake process group and the program's own
device mesh (``init_device_mesh("cuda", ...)`` on the emulated GPU: DTensor's random operators
draw as on a CPU mesh, ``dtensor_rng.py``; its sharding propagation runs outside the trace,
``trace/core/dtensor_compat.py``), as the estimate's tensor-parallel engine runs it (``mesh.py``,
``tp_plans.py``). What the trace is told besides:

- **which parameters were replaced**: each ``ParallelStyle`` registers the rank's
  ``DTensor`` parameter in place of the module's own (``module.register_parameter``), so the
  model's parameters are counted once, at their global size, as for FSDP2's shards;
- **the activation collectives' outputs** are ``comm_buffers``: the functional collectives
  DTensor redistributes with (``mesh.COLLECTIVE_OP_CATEGORIES``), the estimate's categories
  for tensor and sequence parallelism;
- **what was set up**: 'tp' in the strategy, and a note naming the styles applied and the mesh.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any
from unittest import mock

import torch
from torch import nn

from vramledger.inputs.categories import Category
from vramledger.parallel.mesh import COLLECTIVE_OP_CATEGORIES

Replaced = Callable[[torch.Tensor, torch.Tensor], None]


def _styles() -> list[type]:
    """Every ``ParallelStyle`` class PyTorch defines (subclasses of subclasses too)."""
    from torch.distributed.tensor.parallel.style import ParallelStyle

    out, todo = [], [ParallelStyle]
    while todo:
        cls = todo.pop()
        out.append(cls)
        todo.extend(cls.__subclasses__())
    return [cls for cls in out if "_apply" in cls.__dict__]


@contextlib.contextmanager
def program_tensor_parallel(
    replaced: Replaced,
    op_categories: dict[str, Category],
    used: dict[str, None],
    notes: dict[str, None],
) -> Iterator[None]:
    """While the program runs: each ``ParallelStyle`` it applies noted (``used`` gets 'tp',
    ``op_categories`` the activation collectives'), each parameter it replaces by a DTensor
    told to ``replaced(old, new)``."""
    from torch.distributed.tensor import DTensor

    applied: dict[str, None] = {}
    sizes: dict[int, None] = {}

    def wrap(original: Any) -> Any:
        def apply(style: Any, module: nn.Module, device_mesh: Any) -> nn.Module:
            used["tp"] = None
            op_categories.update(COLLECTIVE_OP_CATEGORIES)
            applied[type(style).__name__] = None
            sizes[device_mesh.size()] = None
            return original(style, module, device_mesh)

        return apply

    register = nn.Module.__dict__["register_parameter"]

    def register_parameter(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        old = module._parameters.get(name) if "_parameters" in module.__dict__ else None
        register(module, name, param)
        if old is not None and isinstance(param, DTensor) and param is not old:
            replaced(old, param)

    with contextlib.ExitStack() as patches:
        for cls in _styles():
            patches.enter_context(mock.patch.object(cls, "_apply", wrap(cls.__dict__["_apply"])))
        patches.enter_context(
            mock.patch.object(nn.Module, "register_parameter", register_parameter)
        )
        try:
            yield
        finally:
            if applied:
                notes[_note(applied, sizes)] = None


def _note(applied: dict[str, None], sizes: dict[int, None]) -> str:
    return (
        f"tensor parallelism: the program's parallelize_module ({', '.join(applied)}) ran on a "
        f"{' and '.join(str(s) for s in sizes)}-rank device mesh on the fake process group; "
        "each parameter it replaced by its DTensor counted once, the activation collectives' "
        "outputs as comm_buffers"
    )
