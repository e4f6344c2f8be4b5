"""An estimate's answer for another GPU of the same compute capability, or another margin, made
from the answer to the same question asked before, without a trace and without torch.

A trace depends on the GPU only through its compute capability (``trace/core/cache.py``'s
``NOT_IN_KEY``): H100 and H200 share their traces. What ``estimate`` adds after its traces, and
the only parts of its answer that name the GPU or read its memory or the margin (``predict/step.py``,
``trace/emulation/target_policy.py``), are:

- the spec's ``gpu``, ``gpu_memory`` and ``margin`` in every ledger's ``spec`` (``summary``);
- the device policy's notes before its trace (``gpus.architecture_notes``: "CUDA behaviour of
  h100-80gb: compute capability 9.0"), which the trace cache stores apart and writes for the
  GPU asked, in every ledger's ``notes``;
- the GPU's precision warnings (``gpus.precision_warnings``), last in ``warnings``;
- the verdict (``verdict.py``), made from the reserved peak, the GPU and the margin.

:func:`for_gpu` rewrites those four for the GPU and margin asked, and leaves every other field
as estimate made it. The command line's answer cache answers such a question so
(``answer_cache.py``); ``tests/test_trace_cache.py`` compares its answers with ``estimate``'s,
field for field.
"""

from __future__ import annotations

from dataclasses import replace

from vramledger.inputs.gpus import (
    DEFAULT_COMPUTE_CAPABILITY,
    Gpu,
    architecture_notes,
    asked_gpu,
    modelled_compute_capability,
    precision_warnings,
)
from vramledger.inputs.verdict import DEFAULT_MARGIN, verdict
from vramledger.ledger.ledger import Ledger


class _Unlike(Exception):
    """The ledger does not hold the GPU's notes or warnings where estimate puts them."""


def compute_capability(gpu: Gpu | None) -> tuple[int, int]:
    """The compute capability a trace for ``gpu`` applies (9.0 when none is given:
    ``trace/emulation/target_policy.py``)."""
    return DEFAULT_COMPUTE_CAPABILITY if gpu is None else modelled_compute_capability(gpu)


def policy_notes(target: str, gpu: Gpu | None) -> list[str]:
    """What ``policy_for``'s device policy says before a trace (``trace/emulation/target_policy.py``): the
    CPU's nothing; CUDA's the architecture notes of the GPU asked, or of the 9.0 assumed."""
    if target != "cuda":
        return []
    return architecture_notes(compute_capability(gpu), None if gpu is None else gpu.name)


def for_gpu(
    ledger: Ledger, *, gpu: str | None, gpu_memory: str | None, margin: int | None
) -> Ledger | None:
    """``ledger``, an ``estimate`` answer, as estimate answers the same question for ``gpu``,
    ``gpu_memory`` and ``margin`` (the spec's values, checked: ``verdict.check_gpu_options``);
    None where the GPU's compute capability differs (another trace) or where the ledger does
    not hold the made-for GPU's notes and warnings as estimate puts them."""
    spec = ledger.spec
    made = asked_gpu(spec.get("gpu"), spec.get("gpu_memory"))
    asked = asked_gpu(gpu, gpu_memory)
    if compute_capability(made) != compute_capability(asked):
        return None
    target, precision = spec.get("target", ""), spec.get("precision", "")
    old_notes, new_notes = policy_notes(target, made), policy_notes(target, asked)
    old_warnings = precision_warnings(made, precision) if made is not None else []
    new_warnings = precision_warnings(asked, precision) if asked is not None else []
    kept = len(ledger.warnings) - len(old_warnings)
    if kept < 0 or ledger.warnings[kept:] != old_warnings:
        return None
    values = {"gpu": gpu, "gpu_memory": gpu_memory, "margin": margin}

    def rewritten(one: Ledger) -> Ledger:
        return replace(
            one,
            spec={**one.spec, **values},
            notes=_swapped(one.notes, old_notes, new_notes),
        )

    try:
        answer = rewritten(ledger)
        ranks = [(ids, rewritten(one)) for ids, one in ledger.ranks]
    except _Unlike:
        return None
    return replace(
        answer,
        ranks=ranks,
        warnings=[*ledger.warnings[:kept], *new_warnings],
        verdict=(
            verdict(asked, ledger.reserved_peak_bytes, DEFAULT_MARGIN if margin is None else margin)
            if asked is not None
            else None
        ),
    )


def _swapped(notes: list[str], old: list[str], new: list[str]) -> list[str]:
    """``notes`` with the block ``old`` (the policy's notes, where the trace put them) replaced
    by ``new``."""
    if old == new:
        return list(notes)
    for i in range(len(notes) - len(old) + 1):
        if old and notes[i : i + len(old)] == old:
            return [*notes[:i], *new, *notes[i + len(old) :]]
    raise _Unlike
