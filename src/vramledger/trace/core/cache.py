"""Traces kept on disk (``cache.py``): a question that needs a trace made before reuses it.

The key is made from the traced spec itself: every field of ``TrainingSpec`` is in it except
those in :data:`NOT_IN_KEY`, each excluded with the reason it cannot change the trace, so a field
added later is in the key until someone says why it need not be (``tests/test_trace_cache.py``
fails on a name that is neither). Files the spec names (the model's config.json or folder, a
DeepSpeed or accelerate config, a LoRA adapter folder) enter by their contents. A spec that
names code (``FILE.py:FUNCTION``, a module object, a callable, an optimizer class from a package
whose version is not in the fingerprint) is not cached: its code can change under the same
name. Beside the spec: the device policy (its target and compute capability, and on the CPU the
thread count and instruction sets its kernels' scratch was measured with), the engine, the
rank, the MoE routing and the block-extension switches ``trace`` takes. The versions of every
package whose code runs in a trace, and vramledger's own files, are in the entry's fingerprint.

What is stored is :class:`~vramledger.trace.core.fake.TraceResult` field by field, its Timeline as
typed arrays (``array`` bytes, base64) and string tables. Notes that name the GPU (the policy's
notes before the trace) are stored apart and rewritten for the GPU asked, so GPUs of one compute
capability share their traces.
"""

from __future__ import annotations

import base64
import sys
from array import array
from dataclasses import fields
from pathlib import Path
from typing import Any

from vramledger.inputs.cache import VERSIONED_PACKAGES, Store, path_fingerprint
from vramledger.inputs.categories import Category, Phase
from vramledger.inputs.notes import from_records, records
from vramledger.inputs.spec import TrainingSpec
from vramledger.record.timeline import Timeline

NOT_IN_KEY: dict[str, str] = {
    "gpu": "enters as the device policy's compute capability (what CUDA decides by); its name "
    "is only in the policy's notes, rewritten on reuse",
    "gpu_memory": "read after the trace: whether the step fits (verdict.py)",
    "margin": "read after the trace: whether the step fits (verdict.py)",
}
"""TrainingSpec fields that are not in a trace's key, and why they cannot change the trace."""

TRACES = Store("traces")
_CATEGORIES = list(Category)
_PHASES = list(Phase)
_NONE = -(2**31)
"""Stands for None in an integer column (block indices are never negative)."""
_CODE_PACKAGES = ("torch", *VERSIONED_PACKAGES)
"""Import paths from these packages name code whose version the fingerprint holds."""


class _Uncacheable(Exception):
    """The spec names code whose changes the key could not see."""


def trace_key(
    spec: TrainingSpec,
    policy: Any,
    engine: Any,
    *,
    extend_blocks: bool,
    rank: int,
    routing: str,
    blocks_verified: bool,
) -> dict[str, Any] | None:
    """Everything that changes what ``trace`` returns, JSON-ready; None when the spec names
    code (not cached)."""
    try:
        values = {
            f.name: _value(f.name, getattr(spec, f.name))
            for f in fields(spec)
            if f.name not in NOT_IN_KEY
        }
    except _Uncacheable:
        return None
    return {
        "spec": values,
        "policy": [
            type(policy).__qualname__,
            policy.name,
            list(getattr(policy, "compute_capability", ()) or ()),
            *policy.conditions(),
        ],
        "engine": f"{type(engine).__module__}.{type(engine).__qualname__}",
        "extend_blocks": extend_blocks,
        "rank": rank,
        "routing": routing,
        "blocks_verified": blocks_verified,
    }


def _value(name: str, value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float)):
        return value
    if isinstance(value, Path):
        value = str(value)
    if isinstance(value, str):
        return _text(name, value)
    if isinstance(value, (tuple, list)):
        return [_value(name, v) for v in value]
    if isinstance(value, dict):
        if name == "model" and "model_type" in value:
            return {"config": _plain(value)}
        return {str(k): _value(name, v) for k, v in sorted(value.items())}
    if name == "model" and hasattr(value, "model_type") and hasattr(value, "to_json_string"):
        return {"config": value.to_json_string(use_diff=False)}  # a transformers config
    raise _Uncacheable(name)


def _text(name: str, text: str) -> Any:
    if text.endswith(".py") or ".py:" in text:
        raise _Uncacheable(name)
    package = text.replace(":", ".").split(".")[0]
    if name == "optimizer" and ("." in text or ":" in text) and package not in _CODE_PACKAGES:
        raise _Uncacheable(name)
    if name == "model" and ":" in text:  # package.module:FUNCTION
        raise _Uncacheable(name)
    found = path_fingerprint(text) if len(text) < 4096 else None
    return text if found is None else {"value": text, "file": found}


def _plain(value: Any) -> Any:
    """A JSON value, or not cached."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    raise _Uncacheable("model")


# -- storing -------------------------------------------------------------------------------
def load(key: dict[str, Any] | None, names: set[str], gpu_notes: list[str]) -> dict | None:
    """The stored fields (``names``: TraceResult's) for ``key``, its notes said for the GPU
    whose policy notes (before the trace) are ``gpu_notes``; None when not stored."""
    if key is None:
        return None
    stored = TRACES.get(key)
    if stored is None or set(stored["result"]) != names:
        return None
    values = dict(stored["result"])
    try:
        values["timeline"] = decode_timeline(values["timeline"])
    except (KeyError, ValueError, TypeError):
        return None
    values["notes"] = list(dict.fromkeys([*gpu_notes, *from_records(values["notes"])]))
    return values


def save(key: dict[str, Any] | None, result: Any, gpu_notes: list[str]) -> None:
    """Store ``result`` under ``key``; the GPU's notes (``gpu_notes``) are left out of it."""
    if key is None:
        return
    values = {f.name: getattr(result, f.name) for f in fields(result)}
    values["timeline"] = encode_timeline(result.timeline)
    values["notes"] = records(n for n in result.notes if n not in gpu_notes)
    TRACES.put(key, {"result": values})


def _ints(values: list[int], code: str = "q") -> str:
    return base64.b64encode(array(code, values).tobytes()).decode()


def _from_ints(text: str, code: str = "q") -> list[int]:
    out = array(code)
    out.frombytes(base64.b64decode(text))
    return out.tolist()


def _optional(values: list[int | None]) -> list[int]:
    return [_NONE if v is None else v for v in values]


def _from_optional(values: list[int]) -> list[int | None]:
    return [None if v == _NONE else v for v in values]


def _strings(values: list[str | None]) -> dict[str, Any]:
    table: dict[str, int] = {}
    index = [-1 if v is None else table.setdefault(v, len(table)) for v in values]
    return {"table": list(table), "index": _ints(index, "i")}


def _from_strings(coded: dict[str, Any]) -> list[str | None]:
    table = coded["table"]
    return [None if i < 0 else table[i] for i in _from_ints(coded["index"], "i")]


_CODECS: dict[str, tuple[Any, Any]] = {
    "nbytes": (_ints, _from_ints),
    "tags": (
        lambda v: _ints([-1 if c is None else _CATEGORIES.index(c) for c in v], "b"),
        lambda s: [None if i < 0 else _CATEGORIES[i] for i in _from_ints(s, "b")],
    ),
    "on_host": (
        lambda v: _ints([int(bool(h)) for h in v], "b"),
        lambda s: [bool(h) for h in _from_ints(s, "b")],
    ),
    "module": (_strings, _from_strings),
    "recomputed": (
        lambda v: _ints([int(bool(r)) for r in v], "b"),
        lambda s: [bool(r) for r in _from_ints(s, "b")],
    ),
    "op": (_strings, _from_strings),
    "origin": (
        lambda v: [_ints([s for s, _ in v]), _ints([_PHASES.index(p) for _, p in v], "b")],
        lambda s: [
            (step, _PHASES[p])
            for step, p in zip(_from_ints(s[0]), _from_ints(s[1], "b"), strict=True)
        ],
    ),
    "labels": (
        lambda v: [[k, label] for k, label in v.items()],
        lambda s: {int(k): label for k, label in s},
    ),
    "events": (_ints, _from_ints),
    "marks": (
        lambda v: [[i, step, phase.value] for i, step, phase in v],
        lambda s: [(i, step, Phase(phase)) for i, step, phase in s],
    ),
    "block": (lambda v: _ints(_optional(v)), lambda s: _from_optional(_from_ints(s))),
    "event_block": (lambda v: _ints(_optional(v)), lambda s: _from_optional(_from_ints(s))),
}
"""How each Timeline field is written and read (``tests/test_trace_cache.py`` fails when a
field has none)."""


def encode_timeline(timeline: Timeline) -> dict[str, Any]:
    out: dict[str, Any] = {"byteorder": sys.byteorder}
    for f in fields(timeline):
        if f.name not in _CODECS:
            raise KeyError(f"Timeline.{f.name} has no codec in trace/core/cache.py")
        out[f.name] = _CODECS[f.name][0](getattr(timeline, f.name))
    return out


def decode_timeline(coded: dict[str, Any]) -> Timeline:
    if coded.get("byteorder") != sys.byteorder:
        raise ValueError("the entry was written on a machine of the other byte order")
    return Timeline(**{f.name: _CODECS[f.name][1](coded[f.name]) for f in fields(Timeline)})
