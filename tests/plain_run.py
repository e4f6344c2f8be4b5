"""The bound a framework's unchanged recipe is held to under `vramledger run` (issue 31): the
`--target cpu` prediction plus the host tensors it names (`ProgramReport.host_tensors`: memory a
real CPU run's allocator counts and a GPU's never sees) within 0.5 % of the plain run's
allocator count (`run --measure`), at every step and in each optimizer's steady window."""

from __future__ import annotations

from typing import Any

PLAIN_RUN_RELATIVE = 0.005
"""0.5 % of the plain run's count (docs/own-program.md, the README's framework table)."""


def assert_matches_plain_run(predicted: Any, measured: Any) -> None:
    """``predicted`` (``run_program(..., target="cpu")``) against ``measured``
    (``measure_program``): the same steps and windows, each peak within
    :data:`PLAIN_RUN_RELATIVE` once the named host tensors are added."""
    host = sum(h.nbytes for h in predicted.host_tensors)
    assert predicted.steps == measured.steps
    assert predicted.ending == measured.ending
    assert predicted.step_peaks.keys() == measured.step_peaks.keys()
    pairs = [(f"step {k}", p, measured.step_peaks[k]) for k, p in predicted.step_peaks.items()]
    assert [w.optimizer for w in predicted.windows] == [w.optimizer for w in measured.windows]
    pairs += [
        (f"window {w.optimizer}", w.peak_bytes, m.peak_bytes)
        for w, m in zip(predicted.windows, measured.windows, strict=True)
    ]
    for where, peak, truth in pairs:
        assert abs(truth - peak - host) <= PLAIN_RUN_RELATIVE * truth, (where, peak, host, truth)
