"""DeepSpeed as a library vramledger drives: imported only when a DeepSpeed strategy is asked
for (with a clear error when it is missing), kept off standard output (``--json`` prints
there), and given a fake process group for one traced rank.

DeepSpeed's logger writes to ``sys.stdout``: its import (which logs the accelerator it chose)
runs with standard output sent to standard error, and ``quiet()`` raises its log level while
vramledger drives it (it logs every engine it builds).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import sys
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from vramledger.inputs.compat import check_tested
from vramledger.inputs.errors import InputError

INSTALL_HINT = (
    "pip install 'deepspeed>=0.19' (with your torch pinned, e.g. -c <(echo torch==2.13.0))"
)


@dataclass(frozen=True)
class DeepSpeedModules:
    deepspeed: ModuleType
    comm: ModuleType
    """``deepspeed.comm.comm`` (its backend lives in the module global ``cdb``)."""
    groups: ModuleType
    """``deepspeed.utils.groups`` (process groups cached in module globals)."""
    accelerators: ModuleType
    """``deepspeed.accelerator.real_accelerator``."""
    engine_class: type
    config_class: type
    zero_optimizer: type
    logger: logging.Logger


@functools.cache
def deepspeed_modules() -> DeepSpeedModules:
    check_tested("deepspeed")  # its engine's internals below are private (compat.py)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            import deepspeed
            import deepspeed.comm.comm as comm
            from deepspeed.accelerator import real_accelerator
            from deepspeed.runtime.config import DeepSpeedConfig
            from deepspeed.runtime.engine import DeepSpeedEngine
            from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
            from deepspeed.utils import groups
            from deepspeed.utils.logging import logger
    except ImportError as exc:
        raise InputError(
            f"zero0..zero3 run DeepSpeed's own engine, which is not installed ({exc})",
            hint=f"{INSTALL_HINT}; or use --strategy zero1-torch (ZeroRedundancyOptimizer) or "
            "fsdp (FSDP2)",
        ) from exc
    return DeepSpeedModules(
        deepspeed=deepspeed,
        comm=comm,
        groups=groups,
        accelerators=real_accelerator,
        engine_class=DeepSpeedEngine,
        config_class=DeepSpeedConfig,
        zero_optimizer=DeepSpeedZeroOptimizer,
        logger=logger,
    )


@contextlib.contextmanager
def quiet(level: int = logging.ERROR) -> Iterator[None]:
    """DeepSpeed's logger at ``level`` for the duration."""
    logger = deepspeed_modules().logger
    saved = logger.level
    logger.setLevel(level)
    try:
        yield
    finally:
        logger.setLevel(saved)


def version() -> str:
    return str(getattr(deepspeed_modules().deepspeed, "__version__", "?"))


UNBOUNDED_DEVICE_MEMORY = sys.maxsize
"""Free accelerator memory a fake run reports to DeepSpeed: it flattens the parameters on the
accelerator when the flat buffer fits in its free memory, else on the host and copies the
buffer over — the same memory once set up, and the set-up is in no step's peak."""
FAKE_RUN_WARNINGS = (
    "Accessing the data pointer of FakeTensor",  # DeepSpeed asserts partition alignment
    ".*torch.distributed.all_gather_into_tensor.* is deprecated",
)
"""Warnings DeepSpeed's code raises on fake tensors and a fake process group, not the user's."""
SHARED_MEMORY_OPS = ("ShareMemCommBuilder",)
"""Op builders a fake run refuses: the CPU accelerator's shared-memory collectives (a C++
extension DeepSpeed compiles and maps between real processes)."""


@contextlib.contextmanager
def real_deepspeed(*, skip_shared_memory_ops: bool) -> Iterator[None]:
    """DeepSpeed's own accelerator and its communication backend over the process group this
    process has (as ``deepspeed.initialize`` makes it), quiet. ``skip_shared_memory_ops``: do
    not compile the CPU accelerator's shared-memory collectives, which serve only DeepSpeed's
    ``inference_all_reduce`` (``deepspeed/comm/torch.py``), never a training step."""
    import torch.distributed as dist

    modules = deepspeed_modules()
    accelerator = modules.accelerators.get_accelerator()
    create_op_builder = accelerator.create_op_builder
    if skip_shared_memory_ops:
        accelerator.create_op_builder = lambda name: (
            None if name in SHARED_MEMORY_OPS else create_op_builder(name)
        )
    try:
        with quiet():
            modules.comm.init_distributed(
                dist_backend=dist.get_backend(),
                auto_mpi_discovery=False,
                dist_init_required=False,
                verbose=False,
            )
            yield
    finally:
        if skip_shared_memory_ops:
            del accelerator.create_op_builder  # the class's method again


def cpu_accelerator(*, fake: bool, device_name: str | None = None) -> Any:
    """DeepSpeed's CPU accelerator, refusing ``SHARED_MEMORY_OPS`` (a training step never uses
    them). ``fake``: it stands for a GPU in a fake run (fp16 supported,
    ``UNBOUNDED_DEVICE_MEMORY`` free). ``device_name``: the device type it names for its
    tensors, ``"cuda"`` under the CUDA emulation of a user's program
    (``program_deepspeed.py``: DeepSpeed's ``module.to(device)`` and its buffers then land on
    the emulated GPU); else the CPU, as DeepSpeed's own."""
    deepspeed_modules()
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

    accelerator = CPU_Accelerator()
    create_op_builder = accelerator.create_op_builder
    accelerator.create_op_builder = lambda name: (
        None if name in SHARED_MEMORY_OPS else create_op_builder(name)
    )
    if fake:
        accelerator.available_memory = lambda device_index=None: UNBOUNDED_DEVICE_MEMORY
        accelerator.is_fp16_supported = lambda: True
    if device_name is not None:
        accelerator.device_name = lambda device_index=None: (
            device_name if device_index is None else f"{device_name}:{device_index}"
        )
        accelerator.current_device_name = lambda: f"{device_name}:{os.environ.get('LOCAL_RANK', 0)}"
    return accelerator


@contextlib.contextmanager
def deepspeed_state(accelerator: Any) -> Iterator[DeepSpeedModules]:
    """DeepSpeed's global state for one run in this process, restored afterwards: its
    accelerator ``accelerator``, no communication backend yet (``deepspeed.comm``'s ``cdb``),
    empty caches of process groups and of its torch-autocast settings."""
    modules = deepspeed_modules()
    accelerators, comm, groups = modules.accelerators, modules.comm, modules.groups
    saved_accelerator, saved_backend = accelerators.ds_accelerator, comm.cdb
    saved_groups = _empty_group_caches(groups)
    from deepspeed.runtime import torch_autocast

    saved_autocast = (
        torch_autocast.TORCH_AUTOCAST_INITIALIZED,
        torch_autocast.TORCH_AUTOCAST_DTYPE,
    )
    torch_autocast.TORCH_AUTOCAST_INITIALIZED, torch_autocast.TORCH_AUTOCAST_DTYPE = False, None
    accelerators.ds_accelerator = accelerator
    comm.cdb = None
    try:
        yield modules
    finally:
        accelerators.ds_accelerator, comm.cdb = saved_accelerator, saved_backend
        torch_autocast.TORCH_AUTOCAST_INITIALIZED, torch_autocast.TORCH_AUTOCAST_DTYPE = (
            saved_autocast
        )
        for name, value in saved_groups.items():
            setattr(groups, name, value)


@contextlib.contextmanager
def fake_deepspeed_world() -> Iterator[None]:
    """DeepSpeed's global state over the fake process group this process has (one traced rank),
    restored afterwards: the CPU accelerator (fake tensors are CPU tensors), standing for a GPU
    (``cpu_accelerator(fake=True)``), its communication backend, empty caches
    (``deepspeed_state``), and ``LOCAL_RANK`` for the engine's launcher check (torchrun sets
    it)."""
    saved_env = os.environ.get("LOCAL_RANK")
    os.environ["LOCAL_RANK"] = "0"
    try:
        with (
            deepspeed_state(cpu_accelerator(fake=True)) as modules,
            quiet(),
            warnings.catch_warnings(),
        ):
            for message in FAKE_RUN_WARNINGS:
                warnings.filterwarnings("ignore", message=message)
            modules.comm.init_distributed(
                dist_backend="fake",
                auto_mpi_discovery=False,
                dist_init_required=False,
                verbose=False,
            )
            yield
    finally:
        if saved_env is None:
            os.environ.pop("LOCAL_RANK", None)
        else:
            os.environ["LOCAL_RANK"] = saved_env


def _empty_group_caches(groups: ModuleType) -> dict[str, object]:
    """Empty ``deepspeed.utils.groups``' module-level caches of process groups (``_X_GROUP``
    names, ``mpu``, ``mesh_device``); returns what they held."""
    saved: dict[str, object] = {}
    for name, value in list(vars(groups).items()):
        cache = (name.startswith("_") and name.isupper() and "GROUP" in name) or name in (
            "mpu",
            "mesh_device",
        )
        if not cache or callable(value):
            continue
        saved[name] = value
        setattr(groups, name, {} if isinstance(value, dict) else None)
    return saved
