"""A real run of DeepSpeed's engine (``zero0``..``zero3``) as one rank of a process group, built
by the same code as the estimate's (``parallel/deepspeed_engine.py``)."""

from __future__ import annotations

import contextlib
import gc
import os
from collections.abc import Callable, Iterator
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
from torch import nn

from vramledger.inputs.errors import InputError
from vramledger.inputs.launch_configs import apply_configs
from vramledger.inputs.recipe import count_parameters, module_names, resolve
from vramledger.inputs.spec import TrainingSpec
from vramledger.measure.counting import (
    PlainCountingObserver,
    RankMeasurement,
    allocator_counter,
    rank_measurement,
)
from vramledger.parallel.deepspeed_engine import build_run
from vramledger.parallel.deepspeed_runtime import deepspeed_modules, deepspeed_state, real_deepspeed
from vramledger.parallel.fake_group import forget_sharding_propagation
from vramledger.parallel.real import shut_down_group
from vramledger.trace.core.tracker import StorageTracker, TrackerObserver


def measure_deepspeed(spec: TrainingSpec, device: str = "cpu") -> RankMeasurement:
    """Run ``spec`` (``zero0``..``zero3``) for real with DeepSpeed's engine as this rank of the
        process group, twice: a plain run (no dispatch mode, no tensor subclass active: the
        tracker changes what autograd allocates, ``trace/core/plain_autograd.py``) counted by the
        allocator, then a tracked run of the same step for the ledger's categories.

        On CPU the allocator count is ``cpu_allocator_count`` (installed here, so it counts from
        before the model is built); DeepSpeed's shared-memory collectives, which serve only its
        ``inference_all_reduce``, are not compiled. Under torchrun, its process group; on one process
    without one, a gloo group of one (:func:`_process_group`).
    """
    spec, _ = apply_configs(spec)
    if not spec.parallelism.is_deepspeed:
        raise InputError(f"measure_deepspeed runs zero0..zero3, not {spec.strategy}")
    with _process_group(spec.world_size):
        return _measure(spec, device)


@contextlib.contextmanager
def _process_group(world_size: int) -> Iterator[None]:
    """The process group DeepSpeed's engine reduces over: torchrun's, or on one process not
    launched by torchrun a gloo group of one made here (DeepSpeed's engine all-reduces on one
    process too), with ``LOCAL_RANK`` 0 and DeepSpeed's global state fresh for it (its
    communication backend and cached groups belong to the group, destroyed afterwards)."""
    if dist.is_initialized() or world_size > 1:
        yield
        return
    accelerator = deepspeed_modules().accelerators.get_accelerator()
    with (
        mock.patch.dict(os.environ, {"LOCAL_RANK": os.environ.get("LOCAL_RANK", "0")}),
        deepspeed_state(accelerator),
    ):
        forget_sharding_propagation()  # DTensor's caches an earlier fake trace kept
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        try:
            yield
        finally:
            shut_down_group()


def _measure(spec: TrainingSpec, device: str) -> RankMeasurement:
    if not dist.is_initialized() or dist.get_world_size() != spec.world_size:
        raise InputError(f"measure_deepspeed needs a process group of {spec.world_size} ranks")
    cuda = device == "cuda"
    count_start, count_end = allocator_counter(cuda)
    counted: dict[tuple[int, str], int] = {}
    recipe = resolve(spec)
    torch_device = torch.device(device)
    with real_deepspeed(skip_shared_memory_ops=not cuda):
        plain = PlainCountingObserver(count_start, count_end, counted)
        _deepspeed_steps(spec, recipe, torch_device, plain, None)
        plain.close()
        gc.collect()
        tracker: Any = None

        def tracked_observer(model: nn.Module) -> TrackerObserver:
            nonlocal tracker
            tracker = StorageTracker(
                module_names=module_names(model), device_type=torch_device.type
            )
            return TrackerObserver(tracker)

        notes, counts = _deepspeed_steps(spec, recipe, torch_device, None, tracked_observer)
    return rank_measurement(tracker.close(), counted, spec, device, counts, notes)


def _deepspeed_steps(
    spec: TrainingSpec,
    recipe: Any,
    torch_device: torch.device,
    observer: Any,
    make_observer: Callable[[nn.Module], TrackerObserver] | None,
) -> tuple[list[str], tuple[int, int]]:
    """Build the model and DeepSpeed's run (same seed each time) and run ``spec.steps`` steps:
    plainly with ``observer``, or under the tracker ``make_observer(model)`` makes."""
    torch.manual_seed(spec.seed)
    model = recipe.build_model(torch_device)
    counts = count_parameters(model)
    if make_observer is not None:
        observer = make_observer(model)
    batch = recipe.make_batch(torch_device)
    mode = observer.tracker if make_observer is not None else contextlib.nullcontext()
    with mode:
        run, notes = build_run(
            model=model,
            batch=batch,
            loss_fn=recipe.loss_fn,
            optimizer=recipe.optimizer,
            precision=recipe.precision,
            spec=spec,
            observer=observer,
            fake=False,
        )
        for step in range(1, spec.steps + 1):
            run.step(step, observer)
    return notes, counts
