"""Does a peak fit a GPU? One answer for ``estimate``, ``plan`` and ``advise``.

A step fits when the memory it needs on the device plus an explicit ``margin`` is at most the
GPU's memory. What it needs is the CUDA caching allocator's reserved peak
(``Ledger.reserved_peak_bytes``, as ``torch.cuda.max_memory_reserved()``): the allocator holds
those bytes from the device, used or cached. The margin covers what no trace sees: the CUDA
context and the libraries loaded into it (several hundred MiB on recent GPUs), NCCL buffers, and
fragmentation beyond the modelled allocator.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vramledger.inputs.errors import InputError
from vramledger.inputs.gpus import Gpu, asked_gpu, modelled_compute_capability
from vramledger.inputs.units import GIB, format_bytes, parse_bytes

DEFAULT_MARGIN = 2 * GIB
"""Kept back when no ``--margin`` is given (the planner's default since it was written)."""
MARGIN_SOURCE = (
    "default: CUDA context and libraries (~0.5-1 GiB on recent GPUs), NCCL buffers and "
    "fragmentation beyond the modelled caching allocator"
)


@dataclass(frozen=True, kw_only=True)
class Verdict:
    gpu: Gpu
    margin_bytes: int
    peak_bytes: int
    """What has to fit on the device: the reserved peak on CUDA."""

    @property
    def budget_bytes(self) -> int:
        """What the step may use: the GPU's memory less the margin."""
        return self.gpu.memory_bytes - self.margin_bytes

    @property
    def headroom_bytes(self) -> int:
        """Memory left beside the peak and the margin; negative when it does not fit."""
        return self.budget_bytes - self.peak_bytes

    @property
    def fits(self) -> bool:
        return self.headroom_bytes >= 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "gpu": self.gpu.to_dict(),
            "margin_bytes": self.margin_bytes,
            "fits": self.fits,
            "headroom_bytes": self.headroom_bytes,
        }


def check_margin(gpu: Gpu, margin_bytes: int) -> None:
    """Refuse a margin that leaves nothing of the GPU."""
    if margin_bytes < 0 or margin_bytes >= gpu.memory_bytes:
        raise InputError(
            f"the margin ({format_bytes(margin_bytes)}) leaves nothing of {gpu.name}'s "
            f"{format_bytes(gpu.memory_bytes)}",
            hint="pass a smaller --margin",
        )


def check_gpu_options(
    target: str, gpu: str | Gpu | None, gpu_memory: str | int | None, margin: str | int | None
) -> int | None:
    """A question's GPU, its memory and the margin checked (``TrainingSpec``'s ``gpu``,
    ``gpu_memory``, ``margin``): sizes that parse, a GPU only for the CUDA target, a modelled
    (NVIDIA) kind, a margin that leaves some of its memory. Returns the margin in bytes (None
    when not given). Without torch: the answer cache checks a question's GPU options so
    (``answer_cache.py``)."""
    for value, option in ((gpu_memory, "--gpu-memory"), (margin, "--margin")):
        if isinstance(value, str):
            value = parse_bytes(value, allow_zero=option == "--margin", option=option)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
            raise InputError(f"{option} must be a size like 24GiB, not {value!r}")
    if isinstance(margin, str):
        margin = parse_bytes(margin, allow_zero=True)
    kind = asked_gpu(gpu, gpu_memory)
    if kind is None:
        return margin
    if target != "cuda":
        raise InputError(
            f"--gpu {kind.name} predicts a CUDA GPU, and the target is {target}",
            hint="drop --target cpu",
        )
    modelled_compute_capability(kind)
    check_margin(kind, DEFAULT_MARGIN if margin is None else int(margin))
    return margin


def verdict(gpu: Gpu, peak_bytes: int, margin_bytes: int = DEFAULT_MARGIN) -> Verdict:
    """Whether ``peak_bytes`` (the reserved peak on CUDA) plus ``margin_bytes`` fits ``gpu``."""
    check_margin(gpu, margin_bytes)
    return Verdict(gpu=gpu, margin_bytes=margin_bytes, peak_bytes=peak_bytes)
