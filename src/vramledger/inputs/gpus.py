"""The GPU catalogue (``data/gpus.json``): memory and compute capability per device, each row
with its source.

``memory_bytes`` is the device memory the driver reports (what ``nvidia-smi`` shows as total)
where that is known, else the vendor's datasheet figure (decimal GB). What a training process
can use is less: the CUDA context and libraries take some of it, which the explicit ``margin``
covers (``verdict.py``). The compute capability selects CUDA's per-architecture decisions in a
trace (``trace/emulation/cuda_policy.py``). AMD MI250X is listed per GCD (one device as PyTorch sees it);
AMD rows are refused for estimates (``modelled_compute_capability``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from vramledger.inputs.errors import InputError
from vramledger.inputs.notes import Note, Topic
from vramledger.inputs.units import format_bytes, parse_bytes
from vramledger.inputs.version import PACKAGE_DIR

CATALOGUE_FILE = PACKAGE_DIR / "data" / "gpus.json"

DEFAULT_COMPUTE_CAPABILITY: tuple[int, int] = (9, 0)
"""Assumed when no GPU is given (and for ``--gpu-memory`` alone): Hopper, an H100/H200."""
WHEEL_MIN_SM: tuple[int, int] = (7, 5)
"""PyPI's torch 2.13.0 wheel (CUDA 13.0) carries kernels for sm75, 80, 86, 90, 100 and 120
(the ``-gencode`` list in its libtorch_cuda.so): CUDA 13 dropped Volta."""
BF16_TENSOR_CORES: tuple[int, int] = (8, 0)
"""bf16 tensor cores from Ampere on: ``torch.cuda.is_bf16_supported(including_emulation=False)``
is ``major >= 8`` (torch/cuda/__init__.py); the default ``including_emulation=True`` also
answers True below sm80, where a bf16 tensor can be created but math is emulated."""


@dataclass(frozen=True, kw_only=True)
class Gpu:
    name: str
    memory_bytes: int
    compute_capability: tuple[int, int] | None
    """CUDA compute capability (None for AMD)."""
    source: str
    vendor: str = "nvidia"
    """nvidia or amd."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "memory_bytes": self.memory_bytes,
            "compute_capability": list(self.compute_capability)
            if self.compute_capability
            else None,
            "vendor": self.vendor,
            "source": self.source,
        }


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
            vendor=row.get("vendor", "nvidia"),
        )
        for row in rows
    }


CATALOGUE: dict[str, Gpu] = load_catalogue()


def resolve_gpu(name: str | None = None, memory: str | int | None = None) -> Gpu:
    """A catalogue GPU by name, or an anonymous one of ``memory`` ('24GiB', bytes); with both,
    the named GPU's architecture with that memory."""
    if memory is not None:
        size = memory if isinstance(memory, int) else parse_bytes(memory, option="--gpu-memory")
        base = CATALOGUE.get(name.strip().lower()) if name else None
        given = memory if isinstance(memory, int) else memory.strip().replace(" ", "")
        return Gpu(
            # the name says how the size was read: 24GB is 22.35 GiB
            name=base.name if base else name or f"gpu-{given} ({format_bytes(size)})",
            memory_bytes=size,
            compute_capability=base.compute_capability if base else DEFAULT_COMPUTE_CAPABILITY,
            source="given with --gpu-memory"
            + ("" if base else f"; compute capability {_cc(DEFAULT_COMPUTE_CAPABILITY)} assumed"),
            vendor=base.vendor if base else "nvidia",
        )
    if name is None:
        raise InputError("no GPU given", hint="pass --gpu NAME or --gpu-memory 24GiB")
    return _lookup(name)


def asked_gpu(gpu: str | Gpu | None, memory: str | int | None) -> Gpu | None:
    """The GPU a question predicts for (``TrainingSpec.gpu``/``gpu_memory``, the command line's
    ``--gpu``/``--gpu-memory``): a catalogue GPU, a ``Gpu``, or one of ``memory``; with a GPU and
    a memory, that GPU with this memory; None when neither is given."""
    if isinstance(gpu, Gpu):
        if memory is None:
            return gpu
        return replace(gpu, memory_bytes=resolve_gpu(memory=memory).memory_bytes)
    if gpu is None and memory is None:
        return None
    return resolve_gpu(gpu, memory)


def _lookup(name: str) -> Gpu:
    key = name.strip().lower()
    if key not in CATALOGUE:
        raise InputError(
            f"unknown GPU {name!r}",
            hint=f"use one of {', '.join(CATALOGUE)}, or --gpu-memory 24GiB",
        )
    return CATALOGUE[key]


def _cc(cc: tuple[int, int]) -> str:
    return f"{cc[0]}.{cc[1]}"


def modelled_compute_capability(gpu: Gpu) -> tuple[int, int]:
    """The compute capability whose CUDA decisions a trace applies; AMD GPUs are refused."""
    if gpu.compute_capability is None:
        raise InputError(
            f"{gpu.name} is an AMD GPU, which vramledger does not model: ROCm's hipBLASLt "
            "workspace, its attention kernels (AOTriton/CK) and the HIP caching allocator "
            "differ from the CUDA decisions a trace applies",
            hint="pass --gpu-memory SIZE to get CUDA's answer for that much memory",
        )
    return gpu.compute_capability


def precision_warnings(gpu: Gpu, precision: str) -> list[str]:
    """What the GPU does not do natively for this precision (the trace still runs it)."""
    cc = gpu.compute_capability
    if cc is not None and cc < BF16_TENSOR_CORES and "bf16" in precision:
        return [
            f"{gpu.name} (sm{cc[0]}{cc[1]}) has no bf16 tensor cores "
            "(torch.cuda.is_bf16_supported(including_emulation=False) is False): bf16 runs "
            "emulated and slow, and its attention runs the math path; fp16 (--precision "
            "fp16-master) is what this GPU computes natively"
        ]
    return []


def architecture_notes(cc: tuple[int, int], gpu: str | None) -> list[str]:
    """What the CUDA policy of this compute capability says before a trace
    (``trace/emulation/cuda_policy.py``, one note per decision): the GPU and its compute capability, and
    a torch wheel without its kernels. Kept here, without torch, so that the answer cache
    rewrites them for another GPU (``other_gpu.py``)."""
    sm = _cc(cc)
    if gpu is not None:
        notes = [f"CUDA behaviour of {gpu}: compute capability {sm}"]
    elif cc == DEFAULT_COMPUTE_CAPABILITY:
        notes = [f"no --gpu given: CUDA behaviour of compute capability {sm} (H100/H200) assumed"]
    else:
        notes = [f"CUDA behaviour of compute capability {sm}"]
    if cc < WHEEL_MIN_SM:
        notes.append(
            f"PyPI's torch 2.13 wheel (CUDA 13.0) has no kernels for sm{cc[0]}{cc[1]}: this GPU "
            "needs a torch build for CUDA 12.x"
        )
    return [Note(Topic.TARGET, n) for n in notes]
