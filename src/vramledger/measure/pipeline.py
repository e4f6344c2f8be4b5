"""A real run of pipeline stages (``--pp``) as one rank of a process group: the same stages,
schedule and step as the estimate's (``parallel/pipeline.py``: :class:`PipelineRank`), gloo on
CPU, NCCL on GPUs."""

from __future__ import annotations

import contextlib
import gc
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist

from vramledger.inputs.errors import InputError
from vramledger.inputs.recipe import count_parameters, module_names, resolve
from vramledger.inputs.spec import TrainingSpec
from vramledger.measure.counting import (
    PlainCountingObserver,
    RankMeasurement,
    allocator_counter,
    rank_measurement,
)
from vramledger.parallel.mesh import build_mesh, mesh_coords
from vramledger.parallel.pipeline import PipelineParallel, PipelineRank, whole_model_parameters
from vramledger.trace.core.tracker import StorageTracker, TrackerObserver


def measure_pipeline(spec: TrainingSpec, device: str = "cpu") -> RankMeasurement:
    """Run ``spec`` for real as this rank of the process group: the same stages, schedule and
    step as the estimate's (:class:`PipelineRank`, the warm-up vote included), twice: a plain
    run (no dispatch mode, no tensor subclass active: the tracker changes what autograd
    allocates, ``trace/core/plain_autograd.py``) counted by the allocator (``cpu_allocator_count`` on
    CPU, installed before the model is built; ``max_memory_allocated`` on CUDA), then a tracked
    run of the same step for the ledger."""
    if not dist.is_initialized() or dist.get_world_size() != spec.world_size:
        raise InputError(f"measure_pipeline needs a process group of {spec.world_size} ranks")
    count_start, count_end = allocator_counter(device == "cuda")
    counted: dict[tuple[int, str], int] = {}
    rank = dist.get_rank()
    torch_device = torch.device(device)

    def steps(tracked: bool) -> tuple[Any, Any, tuple[int, int]]:
        torch.manual_seed(spec.seed)
        engine = PipelineParallel(spec, rank)
        recipe = engine.adapt(resolve(spec))
        model = recipe.build_model(torch_device)
        counts = count_parameters(model)
        rank_engine = PipelineRank(
            spec=spec, rank=rank, mesh=build_mesh(spec, device), plans=engine.plans, fake=False,
            hidden_dtype=engine.hidden_dtype,
        )  # fmt: skip
        model = rank_engine.wrap(model, [], recipe.precision.name)
        tracker = None
        observer: Any = PlainCountingObserver(count_start, count_end, counted)
        if tracked:
            tracker = StorageTracker(
                module_names=module_names(model),
                device_type=torch_device.type,
                op_categories=rank_engine.op_categories,
                resize_category=rank_engine.resize_category,
            )
            observer = TrackerObserver(tracker)
        batch = recipe.make_batch(torch_device)
        with tracker if tracker is not None else contextlib.nullcontext():
            run = rank_engine.assemble(
                model=model, batch=batch, loss_fn=recipe.loss_fn, optimizer=recipe.optimizer,
                precision=recipe.precision, device=torch_device, grad_accum=1, observer=observer,
            )  # fmt: skip
            for step in range(1, spec.steps + 1):
                run.step(step, observer)
        if not tracked:
            observer.close()
        return tracker, rank_engine, counts

    steps(tracked=False)
    gc.collect()
    tracker, rank_engine, stage_counts = steps(tracked=True)
    counts = whole_model_parameters(resolve(spec))  # the ledger counts the whole model
    run = rank_measurement(tracker.close(), counted, spec, device, counts, rank_engine.notes)
    ledger = replace(
        run.ledger, mesh_coords=mesh_coords(rank, spec), stage_parameters=stage_counts[0]
    )
    return replace(run, ledger=ledger)
