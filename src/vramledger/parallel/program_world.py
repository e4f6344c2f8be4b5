"""A user's program as one rank of a ``torchrun`` launch, traced in this process on fake tensors
(``predict/program.py`` runs it once per rank; ``trace/program/program_trace.py`` enters this around it).

What the program's own distributed code meets:

- **its process group** is a fake one (``fake_group.py``): ``init_process_group`` with any
  backend (``nccl``, ``gloo``, none) makes PyTorch's "fake" backend for the rank traced, in
  torchrun's environment (``torchrun_env.py``). Collectives return at once with exact shapes.
- **DDP** (``DistributedDataParallel``): its C++ reducer allocates its gradient buckets with
  ``at::empty`` outside any fake mode, and cannot run on fake gradients (the estimate never runs
  it either, ``engines.RankEngine.add_buckets``). While the program runs, ``DDP(model, ...)``
  builds DDP's wrapper without the reducer: the same class (``isinstance`` holds), ``.module``,
  ``no_sync()``, a forward that calls the module, and the gradient buckets of DDP's own bucket
  assignment (``engines.ddp_bucket_buffers``, ``bucket_cap_mb`` honoured), fake, tagged
  ``gradient_buckets``. The all-reduce adds no memory: DDP copies each gradient into its bucket,
  reduces the bucket in place and copies it back.
- **FSDP2** (``fully_shard``) runs as it is, on the fake process group, as in the estimate. On a
  CPU mesh (the default mesh of a CPU-only PyTorch, and what the real gloo run has) it makes its
  buffers with ``device=torch.device("cpu")``; given the device object emulated tensors report
  instead (``device_mappings.FakeCuda.device``), they are fake, and FSDP2 still takes the CPU
  path the real gloo run takes.

Not modelled: DDP's ``gradient_as_bucket_view=True`` (the gradients are counted beside the
buckets: an upper bound by one copy of the gradients), the transient flattened copies of DDP's
broadcasts (module states once at construction, buffers in each forward with
``broadcast_buffers``), DDP's ``find_unused_parameters`` bitmap.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_map_only

from vramledger.inputs.categories import Category
from vramledger.inputs.torchrun_env import TorchrunRank, as_rank
from vramledger.parallel.dtensor_rng import host_rng_on_emulated_mesh
from vramledger.parallel.engines import FSDP_OP_CATEGORIES, ddp_bucket_buffers
from vramledger.parallel.fake_group import fake_process_group
from vramledger.parallel.program_deepspeed import program_deepspeed
from vramledger.parallel.program_pipeline import StageMail, program_pipelines
from vramledger.parallel.program_tp import program_tensor_parallel

Register = Callable[[list[torch.Tensor], Category], None]
"""Tags tensors with a category in the trace (``program_trace._Phases.register``)."""
Replaced = Callable[[torch.Tensor, torch.Tensor], None]
"""Tells the trace a parameter was replaced by another (``program_trace._Phases.replaced``)."""

MIB = 1024**2
"""DDP's ``bucket_cap_mb`` is in MiB (``_MB_TO_BYTES = 1024 * 1024`` in
torch/nn/parallel/distributed.py)."""

_FSDP_DEVICE_OWNERS = (
    "torch.distributed.fsdp._fully_shard._fsdp_init",
    "torch.distributed.fsdp._fully_shard._fully_shard",
    "torch.distributed._composable.replicate_with_fsdp",
)
"""Where ``_get_device_from_mesh`` is looked up when ``fully_shard`` (and FSDP2's
``replicate``) picks its device."""


class ProgramWorld:
    """One rank of a program's torchrun launch on fake tensors (``trace_program``'s ``world``)."""

    resize_category = Category.ALL_GATHER_BUFFERS
    """FSDP2 gathers a unit's parameters into storages it resizes (``engines.RankEngine``)."""

    def __init__(self, where: TorchrunRank, mail: StageMail | None = None) -> None:
        self.where = where
        self.op_categories = dict(FSDP_OP_CATEGORIES)
        """FSDP2's copy-in and chunk-cat outputs are its all-gather and reduce-scatter buffers;
        the activation collectives' are comm_buffers once the program applies tensor
        parallelism (``program_tp.py``: the trace holds this dict and sees it grow)."""
        self.mail = mail if mail is not None else StageMail()
        """What the ranks' pipeline stages told each other (shared by every rank's world)."""
        self.used: dict[str, None] = {}
        """What the program set up, in order: 'ddp', 'fsdp', 'zero0'…'zero3', 'tp', 'pp'."""
        self.backends: list[str] = []
        self._notes: dict[str, None] = {}

    @property
    def strategy(self) -> str:
        """'ddp', 'fsdp', 'zero0'…'zero3', 'tp', 'pp' (several: 'tp+fsdp'), or 'none' when the
        program wrapped nothing."""
        return "+".join(self.used) or "none"

    def notes(self) -> list[str]:
        asked = ", ".join(dict.fromkeys(self.backends)) or "none (never called)"
        return [
            f"rank {self.where.rank} of {self.where.world_size} (torchrun: --nnodes "
            f"{self.where.nnodes} --nproc-per-node {self.where.nproc_per_node}); "
            f"init_process_group({asked}) answered by a fake process group",
            *self._notes,
        ]

    @contextlib.contextmanager
    def entered(
        self, device: torch.device, register: Register, replaced: Replaced
    ) -> Iterator[None]:
        """The rank's environment, process group, DDP and FSDP2 while the program runs;
        ``device``: the object emulated tensors report (FSDP2's device); ``register`` tags
        tensors, ``replaced(old, new)`` says a parameter was replaced by its shard."""
        groups = contextlib.ExitStack()
        where = self.where

        def init(_backend: str | None, kwargs: dict[str, Any]) -> None:
            keep = {k: v for k, v in kwargs.items() if k in ("timeout", "group_name", "pg_options")}
            groups.enter_context(fake_process_group(where.rank, where.world_size, **keep))

        with contextlib.ExitStack() as stack:
            self.backends = stack.enter_context(as_rank(where, init))
            stack.callback(groups.close)
            stack.enter_context(self._ddp(register))
            stack.enter_context(self._fsdp_device(device))
            stack.enter_context(self._fsdp_shards(replaced))
            stack.enter_context(host_rng_on_emulated_mesh())
            stack.enter_context(program_deepspeed(register, self.used, self._notes))
            stack.enter_context(
                program_tensor_parallel(replaced, self.op_categories, self.used, self._notes)
            )
            stack.enter_context(
                program_pipelines(self.mail, where.rank, register, self.used, self._notes)
            )
            yield

    @contextlib.contextmanager
    def _fsdp_shards(self, replaced: Replaced) -> Iterator[None]:
        """Each parameter FSDP2 replaces by its sharded DTensor is told to the trace (its count
        of the model's parameters keeps one of the two)."""
        from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam

        original = FSDPParam.__dict__["_init_sharded_param"]

        def init_sharded_param(fsdp_param: Any, param: nn.Parameter, *args: Any, **kw: Any) -> None:
            original(fsdp_param, param, *args, **kw)
            replaced(param, fsdp_param.sharded_param)

        FSDPParam._init_sharded_param = init_sharded_param  # type: ignore[method-assign]
        try:
            yield
        finally:
            FSDPParam._init_sharded_param = original  # type: ignore[method-assign]

    @contextlib.contextmanager
    def _fsdp_device(self, device: torch.device) -> Iterator[None]:
        import importlib

        owners = [importlib.import_module(name) for name in _FSDP_DEVICE_OWNERS]
        original = owners[0]._get_device_from_mesh
        used = self.used

        notes = self._notes

        def device_from_mesh(mesh: Any) -> torch.device:
            used["fsdp"] = None
            notes[
                "FSDP2: the program's fully_shard ran on the fake process group, its buffers "
                "made on the emulated GPU"
            ] = None
            return device if mesh.device_type == "cpu" else original(mesh)

        for owner in owners:
            owner._get_device_from_mesh = device_from_mesh
        try:
            yield
        finally:
            for owner in owners:
                owner._get_device_from_mesh = original

    @contextlib.contextmanager
    def _ddp(self, register: Register) -> Iterator[None]:
        from torch.nn.parallel import DistributedDataParallel as DDP

        saved = {name: DDP.__dict__[name] for name in ("__init__", "forward")}
        world = self

        def init(
            ddp: Any,
            module: nn.Module,
            device_ids: Any = None,
            output_device: Any = None,
            *_args: Any,
            process_group: Any = None,
            bucket_cap_mb: float | None = None,
            gradient_as_bucket_view: bool = False,
            **_kwargs: Any,
        ) -> None:
            nn.Module.__init__(ddp)
            world.used["ddp"] = None
            ddp.module = module
            ddp.device_ids, ddp.output_device = device_ids, output_device
            ddp.process_group = process_group or dist.distributed_c10d._get_default_group()
            ddp.require_backward_grad_sync = True
            ddp.require_forward_param_sync = True
            ddp.gradient_as_bucket_view = gradient_as_bucket_view
            ddp.static_graph = False
            buckets = _buckets(module, bucket_cap_mb)
            ddp._vramledger_buckets = buckets  # held as the reducer holds them
            register(buckets, Category.GRADIENT_BUCKETS)
            world._notes[
                "DDP: its wrapper without the C++ reducer (which cannot run on fake tensors), with "
                "the gradient buckets of DDP's own bucket assignment"
            ] = None
            if gradient_as_bucket_view:
                world._notes[
                    "DDP gradient_as_bucket_view=True is not modelled: the gradients are counted "
                    "beside the buckets (an upper bound by one copy of the gradients)"
                ] = None

        def forward(ddp: Any, *inputs: Any, **kwargs: Any) -> Any:
            if ddp.device_ids:  # DDP moves the inputs to its device (``_to_kwargs``)
                first = ddp.device_ids[0]
                device = torch.device("cuda", first) if isinstance(first, int) else first
                inputs, kwargs = tree_map_only(
                    torch.Tensor, lambda t: t.to(device), (inputs, kwargs)
                )
            return ddp.module(*inputs, **kwargs)

        DDP.__init__, DDP.forward = init, forward  # type: ignore[method-assign]
        try:
            yield
        finally:
            for name, value in saved.items():
                setattr(DDP, name, value)


def _buckets(module: nn.Module, bucket_cap_mb: float | None) -> list[torch.Tensor]:
    """DDP's gradient buckets for ``module``'s trainable parameters
    (``engines.ddp_bucket_buffers``). A ``bucket_cap_mb`` given caps the first bucket too
    (``_BucketConfig`` in torch/nn/parallel/distributed.py)."""
    params = [p for p in module.parameters() if p.requires_grad]
    if bucket_cap_mb is None:
        return ddp_bucket_buffers(params)
    return ddp_bucket_buffers(params, (int(bucket_cap_mb * MIB),) * 2)
