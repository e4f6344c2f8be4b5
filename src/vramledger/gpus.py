"""The GPU catalogue (``data/gpus.json``): memory per device, each row with its source.

``memory_bytes`` is the device memory the driver reports (what ``nvidia-smi`` shows as total)
where that is known, else the vendor's datasheet figure (decimal GB). What a training process
can use is less: the CUDA context and libraries take some of it,
which the planner's explicit ``margin`` covers. AMD MI250X is listed per GCD (one device as
PyTorch sees it).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from .errors import InputError
from .units import format_bytes, parse_bytes

CATALOGUE_FILE = Path(__file__).parent / "data" / "gpus.json"


@dataclass(frozen=True, kw_only=True)
class Gpu:
    name: str
    memory_bytes: int
    compute_capability: tuple[int, int] | None
    """CUDA compute capability (None for AMD)."""
    source: str


def load_catalogue(path: Path = CATALOGUE_FILE) -> dict[str, Gpu]:
    rows = json.loads(path.read_text())["gpus"]
    return {
        row["name"]: Gpu(
            name=row["name"],
            memory_bytes=parse_bytes(row["memory"]),
            compute_capability=tuple(row["compute_capability"])
            if row["compute_capability"]
            else None,
            source=row["source"],
        )
        for row in rows
    }


CATALOGUE: dict[str, Gpu] = load_catalogue()


def resolve_gpu(name: str | None = None, memory: str | int | None = None) -> Gpu:
    """A catalogue GPU by name, or an anonymous one of ``memory`` ('24GiB', bytes)."""
    if memory is not None:
        size = memory if isinstance(memory, int) else parse_bytes(memory, option="--gpu-memory")
        base = CATALOGUE.get(name or "") if name else None
        given = memory if isinstance(memory, int) else memory.strip().replace(" ", "")
        return Gpu(
            # the name says how the size was read: 24GB is 22.35 GiB
            name=name or f"gpu-{given} ({format_bytes(size)})",
            memory_bytes=size,
            compute_capability=base.compute_capability if base else (9, 0),
            source="given with --gpu-memory",
        )
    if name is None:
        raise InputError("no GPU given", hint="pass --gpu NAME or --gpu-memory 24GiB")
    key = name.strip().lower()
    if key not in CATALOGUE:
        raise InputError(
            f"unknown GPU {name!r}",
            hint=f"use one of {', '.join(CATALOGUE)}, or --gpu-memory 24GiB",
        )
    return CATALOGUE[key]
