"""A launch config's fields against the flags given beside it (``--deepspeed``,
``--accelerate-config``).

A field given both ways with different values is refused (``--batch-size 3`` with a DeepSpeed
``train_micro_batch_size_per_gpu`` of 8; ``--precision bf16-mixed`` with accelerate's
``mixed_precision: fp16``): either value taken silently would answer for another run than the
one asked about. A field left at its default takes the config's value; the strategy's default is
the one the spec derives when none is given (none on one rank, ddp on several), so
``--strategy ddp`` on several ranks cannot be told from no ``--strategy``.
"""

from __future__ import annotations

from dataclasses import fields as dataclass_fields
from dataclasses import replace
from pathlib import Path
from typing import Any

from vramledger.inputs.errors import InputError
from vramledger.inputs.spec import TrainingSpec
from vramledger.inputs.spec_fields import option_flag


def check_agrees(spec: TrainingSpec, fields: dict[str, Any], config: str, path: str) -> None:
    """Refuse a field of ``spec`` set away from its default that the file at ``path`` (a
    ``config``: "DeepSpeed config") sets to another value in ``fields``."""
    defaults = {f.name: f.default for f in dataclass_fields(TrainingSpec)}
    defaults["strategy"] = _derived_strategy(spec)
    for name, value in fields.items():
        given = getattr(spec, name)
        if given != defaults[name] and given != value:
            option = option_flag(name)
            raise InputError(
                f"{option} {given} but the {config} {Path(path).name} sets {name} {value}",
                hint=f"drop {option} (the launch runs the config's value), or change the config",
            )


def _derived_strategy(spec: TrainingSpec) -> str | None:
    """The strategy ``spec`` would have with none given (FSDP units set aside: they need a
    sharding strategy, and a spec holding them has one)."""
    try:
        return replace(
            spec, strategy=None, shard_modules=(), shard_min_params=None, reshard_after_forward=None
        ).strategy
    except InputError:  # no strategy is valid for it: every strategy given is explicit
        return None
