"""The least memory a training step needs on its devices, known before any trace.

Whatever the strategy, each parameter lives on the device of at least one rank: replicated by
DDP and ZeRO-1/2, sharded by FSDP and ZeRO-3, split by tensor and pipeline parallelism. Only
``--offload params`` (or ``both``) keeps it in host memory. Each tensor of a micro-batch is
moved to a device too. So the bytes of the model's parameters and of one default batch are a
floor on the sum of every rank's memory. They are counted on the meta device: the model as it
trains (its precision's dtypes, a quantized base, adapters: ``Recipe.build_model``) and the
batch the task makes (``tasks.py``). Gradients, optimizer state and activations add to the
floor, and are not counted.

When the floor exceeds ``world_size`` GPUs of the largest memory in the catalogue
(``data/gpus.json``), or of the memory asked for where that is larger, no GPU could run the
step. ``vramledger estimate`` refuses it in one line, with the fewest such GPUs that could hold
it. Without the refusal the trace answered "does not fit" after it ran (8 s for Llama-2-70B in
fp32 on one GPU; minutes for a pipeline estimate, which traces every layer), failed past the
simulated allocator's 256 TiB of addresses (``allocator.py``), or failed making a batch of
10^12 tokens on the host.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch
from torch.utils._pytree import tree_leaves

from vramledger.inputs.errors import InputError
from vramledger.inputs.gpus import CATALOGUE, Gpu
from vramledger.inputs.recipe import Recipe, count_parameters, resolve
from vramledger.inputs.spec import TrainingSpec
from vramledger.inputs.units import format_bytes

logger = logging.getLogger(__name__)

HOST_PARAMETERS: tuple[str, ...] = ("params", "both")
"""``--offload`` settings that keep the parameters in host memory."""


@dataclass(frozen=True, kw_only=True)
class MemoryFloor:
    """Bytes that some rank's device must hold, summed over all ranks."""

    parameters: int
    """Parameters of the model (tied ones once)."""
    parameter_bytes: int
    """Their bytes as stored in training; 0 when they are offloaded to the host."""
    input_bytes: int
    """One micro-batch of the default inputs; 0 for the user's own (``--inputs``), which are
    not made here."""

    @property
    def total_bytes(self) -> int:
        return self.parameter_bytes + self.input_bytes


def memory_floor(spec: TrainingSpec) -> MemoryFloor:
    """The floor of ``spec``'s step, its launch config files already applied
    (``launch_configs.apply_configs``)."""
    recipe = resolve(spec)
    model = recipe.build_model("meta")
    on_host = spec.offload in HOST_PARAMETERS
    return MemoryFloor(
        parameters=count_parameters(model)[0],
        # tied parameters once (Module.parameters() yields a shared one once)
        parameter_bytes=0 if on_host else sum(p.nbytes for p in model.parameters()),
        input_bytes=_input_bytes(recipe) if spec.inputs is None else 0,
    )


def _input_bytes(recipe: Recipe) -> int:
    """One micro-batch of the default inputs, made on the meta device; 0 where a task's inputs
    cannot be made there (the floor is then the parameters')."""
    try:
        batch = recipe.make_batch("meta")
    except (NotImplementedError, RuntimeError) as exc:
        logger.debug("the default batch cannot be made on the meta device: %s", exc)
        return 0
    return sum(t.nbytes for t in tree_leaves(batch) if isinstance(t, torch.Tensor))


def largest_gpu(spec: TrainingSpec) -> tuple[Gpu, str]:
    """The GPU of the most memory, and what it is: the catalogue's largest, or the one asked for
    (``--gpu``, ``--gpu-memory``) where that is larger."""
    largest = max(CATALOGUE.values(), key=lambda gpu: gpu.memory_bytes)
    asked = spec.gpu_kind()
    if asked is not None and asked.memory_bytes > largest.memory_bytes:
        return asked, "the GPU asked for"
    return largest, f"{largest.name}, the largest GPU in the catalogue"


def check_floor(spec: TrainingSpec) -> None:
    """Refuse ``spec`` when its floor exceeds what ``world_size`` of the largest GPU hold. Only
    for a CUDA target (a CPU's memory is the host's), and only where the floor is known: a model
    that cannot be built here is left to the trace, which says why in its own words."""
    if spec.target != "cuda":
        return
    try:
        floor = memory_floor(spec)
    except Exception as exc:  # the trace builds the same model, and reports the failure
        logger.debug("no memory floor: %s", exc)
        return
    gpu, which = largest_gpu(spec)
    if floor.total_bytes <= spec.world_size * gpu.memory_bytes:
        return
    parameters = f"its {floor.parameters:,} parameters"
    inputs = "one micro-batch of inputs"
    if floor.parameter_bytes and floor.input_bytes:
        what = (
            f"{parameters} ({format_bytes(floor.parameter_bytes)}) and {inputs} "
            f"({format_bytes(floor.input_bytes)}) come to {format_bytes(floor.total_bytes)}"
        )
    elif floor.parameter_bytes:
        what = f"{parameters} take {format_bytes(floor.parameter_bytes)}"
    else:
        what = f"{inputs} takes {format_bytes(floor.input_bytes)}"
    if floor.input_bytes > gpu.memory_bytes:
        hint = "check --batch-size, --seq-len and --image-size"
    else:
        needed = math.ceil(floor.total_bytes / gpu.memory_bytes)
        hint = (
            f"it needs {needed:,} such GPUs or more (`vramledger plan --gpu NAME` finds how many)"
        )
        if floor.parameter_bytes:
            hint += " or the parameters offloaded (--offload params)"
    raise InputError(
        f"no GPU could hold this step: {what}, more than {spec.world_size:,} × "
        f"{format_bytes(gpu.memory_bytes)} ({which})",
        hint=f"{hint}, or give --gpu-memory SIZE to trace it on a GPU that large",
    )
