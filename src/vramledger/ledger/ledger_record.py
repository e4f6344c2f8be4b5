"""A Ledger kept whole as JSON and read back, its timeline aside: the answer cache keeps an
estimate's ledger so, to answer the same question for another GPU of the same compute capability
or another margin without torch (``answer_cache.py``, ``other_gpu.py``).

Unlike ``Ledger.to_dict`` (the JSON contract, which keeps the first ``TOP_MODULES`` modules at
the peak and adds derived figures), the record holds every field as it is, so that
:func:`ledger_from_record` gives a Ledger equal to the one recorded, its ranks' ledgers included,
and its tables and JSON are the same. Each field has its codec (:data:`CODECS`);
``tests/test_trace_cache.py`` fails on a Ledger field that has none.
"""

from __future__ import annotations

from dataclasses import asdict, fields
from typing import Any

from vramledger.inputs.categories import Category, Phase
from vramledger.inputs.gpus import Gpu
from vramledger.inputs.notes import from_records, records
from vramledger.inputs.verdict import Verdict
from vramledger.ledger.ledger import Ledger
from vramledger.ledger.peak_modules import ModuleBytes


def _same(value: Any) -> Any:
    return value


def _by_category(value: dict[Category, int]) -> dict[str, int]:
    return {c.value: b for c, b in value.items()}


def _categories(value: dict[str, int]) -> dict[Category, int]:
    return {Category(c): b for c, b in value.items()}


def _by_phase(value: dict[Phase, int]) -> dict[str, int]:
    return {p.value: b for p, b in value.items()}


def _phases(value: dict[str, int]) -> dict[Phase, int]:
    return {Phase(p): b for p, b in value.items()}


def _verdict(value: Verdict | None) -> dict[str, Any] | None:
    if value is None:
        return None
    return {
        "gpu": asdict(value.gpu),
        "margin_bytes": value.margin_bytes,
        "peak_bytes": value.peak_bytes,
    }


def _from_verdict(value: dict[str, Any] | None) -> Verdict | None:
    if value is None:
        return None
    gpu = dict(value["gpu"])
    if gpu["compute_capability"] is not None:
        gpu["compute_capability"] = tuple(gpu["compute_capability"])
    return Verdict(
        gpu=Gpu(**gpu), margin_bytes=value["margin_bytes"], peak_bytes=value["peak_bytes"]
    )


CODECS: dict[str, tuple[Any, Any]] = {
    **{
        name: (_same, _same)
        for name in (
            "target",
            "allocator",
            "peak_bytes",
            "allocated_peak_bytes",
            "reserved_peak_bytes",
            "first_step_peak_bytes",
            "first_step_allocated_peak_bytes",
            "step_start_bytes",
            "host_bytes",
            "model_state_bytes",
            "parameters",
            "trainable_parameters",
            "stage_parameters",
            "optimizer_state_bytes",
            "optimizer_state_method",
            "spec",
            "seconds",
            "version",
            "world_size",
            "strategy",
            "worst_rank",
            "mesh_coords",
            "warnings",
            "moe_routing_peaks",
            "blocks_extended",
        )
    },
    "notes": (records, from_records),
    "peak_phase": (lambda p: p.value, Phase),
    "first_step_peak_phase": (lambda p: p.value, Phase),
    "at_peak": (_by_category, _categories),
    "allocated_at_peak": (_by_category, _categories),
    "first_step_at_peak": (_by_category, _categories),
    "phases": (_by_phase, _phases),
    "allocated_phases": (_by_phase, _phases),
    "top_modules": (
        lambda v: [[module, nbytes] for module, nbytes in v],
        lambda v: [(module, nbytes) for module, nbytes in v],
    ),
    "peak_modules": (
        lambda v: [asdict(m) for m in v],
        lambda v: [ModuleBytes(**m) for m in v],
    ),
    "timeline": (lambda v: None, lambda v: None),
    "ranks": (
        lambda v: [[list(ids), ledger_record(ledger)] for ids, ledger in v],
        lambda v: [(list(ids), ledger_from_record(ledger)) for ids, ledger in v],
    ),
    "verdict": (_verdict, _from_verdict),
}
"""How each Ledger field is written and read. The timeline is not kept (a record is for the
tables and JSON, which do not read it): a ledger read back has none."""


def ledger_record(ledger: Ledger) -> dict[str, Any]:
    """``ledger`` as JSON-ready values, every field but its timeline."""
    out = {}
    for f in fields(ledger):
        if f.name not in CODECS:
            raise KeyError(f"Ledger.{f.name} has no codec in ledger_record.py")
        out[f.name] = CODECS[f.name][0](getattr(ledger, f.name))
    return out


def ledger_from_record(record: dict[str, Any]) -> Ledger:
    """The Ledger :func:`ledger_record` wrote."""
    return Ledger(**{f.name: CODECS[f.name][1](record[f.name]) for f in fields(Ledger)})
