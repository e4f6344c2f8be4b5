"""The launch's own config files, read into the spec once: ``--deepspeed`` (``deepspeed_config.py``)
and ``--accelerate-config`` (``accelerate_config.py``).

Each file sets fields of the spec (strategy, offload, precision, micro-batch, accumulation, world
size, FSDP units). Every entry point (``estimate``, ``measure``, ``fit``, ``plan``, ``advise``)
reads them first, and the spec it gets back is marked (``TrainingSpec.configs_applied``). What an
entry then varies — fit's micro-batch and sequence length, plan's strategies and GPU counts,
advise's changes — keeps its value: the files are not read over it again. (Read again, a
config's ``train_micro_batch_size_per_gpu`` had set every micro-batch ``fit`` tried back to its
own: ``fit --deepspeed`` answered 1,048,576.)
"""

from __future__ import annotations

from dataclasses import replace

from vramledger.inputs.accelerate_config import apply_accelerate
from vramledger.inputs.deepspeed_config import apply_deepspeed, read_deepspeed_config
from vramledger.inputs.spec import TrainingSpec


def apply_configs(spec: TrainingSpec) -> tuple[TrainingSpec, list[str]]:
    """``spec`` with the fields its config files set, marked as read, and notes on what was
    read; a spec already marked is returned as it is, with the notes on what its files set."""
    if spec.configs_applied:
        notes = read_deepspeed_config(spec.deepspeed)[1] if spec.deepspeed is not None else []
        return spec, notes
    spec, notes = apply_deepspeed(spec)
    spec, read = apply_accelerate(spec)
    return replace(spec, configs_applied=True), [*notes, *read]
