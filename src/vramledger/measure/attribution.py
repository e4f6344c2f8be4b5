"""Whose failure it is: when a program raises under ``vramledger run``'s trace, the same program
is run plainly, and the answer says which side failed.

A trace runs the program on fake tensors with CUDA emulated; an exception it raises may be the
program's own (a bug, a missing file) or vramledger's (an operator fake tensors cannot run, a
library branch the emulation does not cover). Only a run without the trace can tell: the same
program, its arguments and folder, run for real on the CPU ("cuda" mapped onto the CPU, as
``run --measure`` does: no fake tensor, no tracker, no dispatch mode), stopped one optimizer
step after the step the trace failed in. Then:

- the plain run raises the same exception type: the error is the program's, and
  :class:`~vramledger.inputs.program.ProgramFailed` says so (``confirmed``), unless vramledger's own
  code is in it (:func:`in_vramledger`): the plain run maps "cuda" onto the CPU with the same
  ``torch.cuda`` answers as the trace, so a failure of those answers shows in both runs, and it
  is vramledger's (:class:`TraceFailed`);
- the plain run gets past where the trace failed: the failure is vramledger's, and
  :class:`TraceFailed` says so, with the trace's exception;
- the plain run fails otherwise: both exceptions are given, and neither side is blamed.

The plain run's output goes to the standard error, and its exception's traceback is not shown
(the trace's is).
"""

from __future__ import annotations

import contextlib
import sys
import traceback
from dataclasses import replace
from pathlib import Path
from typing import Any

from vramledger.inputs.errors import VramledgerError
from vramledger.inputs.program import ProgramFailed, ProgramSpec
from vramledger.inputs.version import PACKAGE_DIR

PROGRAMS_OWN = (
    "its plain run on the CPU (no vramledger trace) raised the same: the error is the program's"
)


PACKAGE = str(PACKAGE_DIR)
"""vramledger's own source folder."""


def in_vramledger(exc: BaseException) -> bool:
    """Whether the plain run's ``exc`` was raised by vramledger's own code: in a frame of it
    (the innermost; a program's error that merely passes through one of vramledger's wrappers,
    ``torch.load`` of a missing file, is raised in torch's), or as an attribute missing from
    one of its objects (``AttributeError.obj``: an emulated ``torch.cuda`` stream that lacks a
    method)."""
    obj = getattr(exc, "obj", None) if isinstance(exc, AttributeError) else None
    if obj is not None and type(obj).__module__.startswith("vramledger."):
        return True
    frames = traceback.extract_tb(exc.__traceback__)
    return bool(frames) and str(Path(frames[-1].filename).resolve()).startswith(PACKAGE)


class TraceFailed(VramledgerError):
    """The program ran plainly past where vramledger's trace of it failed, or failed in
    vramledger's own code: vramledger's failure. ``failed`` is the trace's
    :class:`ProgramFailed` (its traceback is the trace's)."""

    def __init__(self, failed: ProgramFailed, plain_steps: int | None) -> None:
        exc = failed.exception
        plain = (
            "where the program's plain run on the CPU failed the same way in vramledger's "
            "code (its mapping of CUDA onto the CPU answers as the trace's emulation does)"
            if plain_steps is None
            else f"where the program's plain run on the CPU made {plain_steps} "
            f"step{'s' if plain_steps != 1 else ''} without error"
        )
        super().__init__(
            f"vramledger's trace of the program failed with {type(exc).__name__}: "
            f"{_first_line(exc)} (after {failed.steps} optimizer step"
            f"{'s' if failed.steps != 1 else ''}), {plain}",
            hint="the failure is vramledger's, not the program's: please report it with the "
            "traceback above (--debug adds vramledger's own frames)",
        )
        self.failed = failed
        self.plain_steps = plain_steps
        self.program_traceback = failed.program_traceback


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""


def attributed(failed: ProgramFailed, spec: ProgramSpec, gpu: str | None) -> VramledgerError:
    """What to raise for a trace that failed with ``failed``: the program's confirmed failure,
    :class:`TraceFailed`, or ``failed`` with both sides' exceptions (module docstring)."""
    from vramledger.measure.program import measure_program

    plain = replace(spec, max_steps=failed.steps + 1, timeout=spec.timeout)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            measured = measure_program(plain, gpu=gpu, quiet=True)
    except ProgramFailed as also:
        if in_vramledger(also.exception):
            return TraceFailed(failed, None)
        if type(also.exception) is type(failed.exception):
            failed.confirmed = True
            failed.hint = f"its traceback is above; {PROGRAMS_OWN}"
            return failed
        failed.hint = (
            f"its traceback is above; the program's plain run on the CPU failed too, "
            f"otherwise ({type(also.exception).__name__}: {_first_line(also.exception)})"
        )
        return failed
    except VramledgerError as refused:  # the plain run cannot be made here (Lightning's QLoRA)
        failed.hint = (
            f"its traceback is above; a plain run to check it could not be made ({refused.message})"
        )
        return failed
    return TraceFailed(failed, measured.steps)


def run_program_checked(spec: ProgramSpec, **kwargs: Any) -> Any:
    """``predict_program.run_program(spec, **kwargs)``; a failure is attributed after the plain
    run (:func:`attributed`)."""
    from vramledger.predict.program import run_program

    try:
        return run_program(spec, **kwargs)
    except ProgramFailed as failed:
        raise attributed(failed, spec, kwargs.get("gpu")) from failed.exception
