"""Where in the user's program: which stack frames are the program's own (not the standard
library's, an installed package's or vramledger's), so that a note can say at which line of the
program something happened (``train.py:80: torch.save(...)``), by which name the program knows
an object (``opt_d``), and a traceback can begin at the program's first frame.
"""

from __future__ import annotations

import contextlib
import inspect
import linecache
import os
import runpy
import sys
import sysconfig
import traceback
from pathlib import Path
from typing import Any

from vramledger.inputs.version import PACKAGE_DIR

_LIBRARY_DIRS = tuple(
    str(Path(p).resolve())
    for p in {
        os.path.dirname(os.__file__),
        str(PACKAGE_DIR),
        *(str(Path(m.__file__).parent) for m in (contextlib, runpy) if m.__file__),
        # console scripts' launchers (bin/vramledger, the outermost frame of every run)
        sysconfig.get_path("scripts"),
    }
)
PROGRAM_DIRS: list[str] = []
"""The installed package a console script runs (``litgpt`` for ``litgpt finetune_lora``), and
the folder of each file the program runs with ``runpy`` (torchtune's ``tune run`` runs its
recipe, ``site-packages/recipes/lora_finetune_single_device.py``, so): their frames are the
program's, though they sit in site-packages (set while ``program.launch`` runs)."""


def library_frame(filename: str) -> bool:
    """A frame of the standard library, torch or vramledger (not the program's)."""
    if filename.startswith("<frozen"):
        return True
    try:
        resolved = str(Path(filename).resolve())
    except OSError:
        return False
    if resolved.startswith(tuple(PROGRAM_DIRS)):
        return False
    if "site-packages" in filename or "dist-packages" in filename:
        return True
    return resolved.startswith(_LIBRARY_DIRS)


def _program_frame() -> Any:
    """The innermost frame of the program's own code (outside the standard library, installed
    packages and vramledger), None when the call came from none."""
    frame = sys._getframe(1)
    while frame is not None:
        name = frame.f_code.co_filename
        if not name.startswith("<") and not library_frame(name):
            return frame
        frame = frame.f_back
    return None


def program_location() -> str | None:
    """``file:line: source`` of the program's line running now (``_program_frame``)."""
    frame = _program_frame()
    if frame is None:
        return None
    name = frame.f_code.co_filename
    source = linecache.getline(name, frame.f_lineno).strip()
    where = f"{Path(name).name}:{frame.f_lineno}"
    return f"{where}: {source}" if source else where


def program_name_of(obj: Any) -> str | None:
    """The program's name for ``obj`` where it runs now: a local or global variable bound to
    it (``opt_d``), or an attribute of ``self`` (``self.opt_d``)."""
    frame = _program_frame()
    if frame is None:
        return None
    local = frame_locals(frame)
    for scope in (local, frame.f_globals):
        for name, value in scope.items():
            if value is obj and not name.startswith("_"):
                return name
    owner = local.get("self")
    for name, value in getattr(owner, "__dict__", {}).items():
        if value is obj:
            return f"self.{name}"
    return None


def frame_locals(frame: Any) -> dict[str, Any]:
    """A copy of a function frame's local variables that leaves nothing behind.

    Before Python 3.13 (PEP 667), ``frame.f_locals`` of a function is a snapshot dict the frame
    keeps: it holds each local as it was when read, after the function rebinds the name. Read
    at a training loop's first ``optimizer.step()``, it kept that step's batch and activations
    alive through the next step's forward (``litgpt finetune_lora``: its 20,164-byte logits
    and batch), in the trace and in the real run alike. The snapshot is emptied once copied
    (the frame refreshes it from its fast locals whenever it is read again, a tracer's call
    included). A module's or class body's ``f_locals`` is its namespace: returned as it is."""
    local = frame.f_locals
    if not frame.f_code.co_flags & inspect.CO_OPTIMIZED or type(local) is not dict:
        return local
    copy = dict(local)
    local.clear()
    return copy


def program_traceback(exc: BaseException) -> str:
    """The exception's traceback, from the program's first frame (vramledger's and runpy's
    frames above it left out), with the exceptions it was raised from."""
    summary = traceback.TracebackException.from_exception(exc)
    frames = list(summary.stack)
    first = next((i for i, f in enumerate(frames) if not library_frame(f.filename)), 0)
    summary.stack = traceback.StackSummary.from_list(frames[first:])
    return "".join(summary.format())
