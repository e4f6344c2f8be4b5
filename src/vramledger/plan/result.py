"""What ``plan`` answers (``search.py``): ``Plan``, the fewest GPUs per optimizer with and
without offload, the Pareto front and the model-parallel layouts, and its JSON."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vramledger.inputs.gpus import Gpu
from vramledger.inputs.notes import records
from vramledger.plan.candidates import DEFAULT_GPUS_PER_NODE, Candidate
from vramledger.plan.layouts import LayoutResult


@dataclass(frozen=True, kw_only=True)
class Plan:
    gpu: Gpu
    margin_bytes: int
    margin_source: str
    max_gpus: int
    fewest_gpus: dict[str, Candidate | None]
    fewest_gpus_without_offload: dict[str, Candidate | None]
    front: list[Candidate]
    configurations: int
    traces: int
    seconds: float
    search_seconds: float = 0.0
    """Tracing and deriving every configuration (the rest re-estimates what is shown)."""
    estimates: int = 0
    """Re-estimates with the real engines made to check what is shown."""
    workers: int = 1
    """Processes the traces after the first and the re-estimates ran in (1: this one)."""
    host_memory_bytes: int | None = None
    gpus_per_node: int = DEFAULT_GPUS_PER_NODE
    notes: list[str] = field(default_factory=list)
    layouts: dict[str, list[LayoutResult]] = field(default_factory=dict)
    """Per optimizer, the model-parallel layouts (tp x pp x FSDP over dp) searched from its
    answer without offload, each re-estimated (``layouts.py``)."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "gpu": {
                "name": self.gpu.name,
                "memory_bytes": self.gpu.memory_bytes,
                "source": self.gpu.source,
            },
            "margin_bytes": self.margin_bytes,
            "margin_source": self.margin_source,
            "max_gpus": self.max_gpus,
            "host_memory_bytes": self.host_memory_bytes,
            "gpus_per_node": self.gpus_per_node,
            "fewest_gpus": {k: (v.to_dict() if v else None) for k, v in self.fewest_gpus.items()},
            "fewest_gpus_without_offload": {
                k: (v.to_dict() if v else None) for k, v in self.fewest_gpus_without_offload.items()
            },
            "front": [c.to_dict() for c in self.front],
            "configurations": self.configurations,
            "traces": self.traces,
            "seconds": round(self.seconds, 2),
            "search_seconds": round(self.search_seconds, 2),
            "estimates": self.estimates,
            "workers": self.workers,
            "notes": self.notes,
            "note_records": records(self.notes),
            "layouts": {k: [r.to_dict() for r in v] for k, v in self.layouts.items()},
        }
