"""An exception described for the results: vramledger's one line, operator, module, frames."""

from __future__ import annotations

import os
import re
import traceback
from pathlib import Path
from typing import Any


def describe_error(exc: BaseException) -> dict[str, Any]:
    """The exception type, vramledger's one line and its message without the hint (operator
    and module parsed out of it), the underlying exception and the innermost frames."""
    from vramledger.inputs.errors import VramledgerError

    cause = exc.__cause__ or exc.__context__
    is_ours = isinstance(exc, VramledgerError)
    message = exc.message if is_ours else _exc_line(exc)
    op = re.search(r"operator (\S+)", message)
    module = re.search(r"in module ([^\s:)(]+)", message)
    frames = traceback.extract_tb((cause or exc).__traceback__)
    return {
        "type": type(exc).__name__,
        "vramledger_error": is_ours,
        "one_line": (exc.one_line() if is_ours else message)[:800],
        "message": message[:600],
        "operator": op.group(1) if op else None,
        "module": module.group(1) if module else None,
        "cause_type": type(cause).__name__ if cause is not None else None,
        "cause": _exc_line(cause)[:600] if cause is not None else None,
        "where": [f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in frames[-3:]],
        "model_frame": _model_frame(frames),
    }


def _model_frame(frames: list[traceback.FrameSummary]) -> str | None:
    """The innermost frame in transformers' code: where the model did what failed."""
    for f in reversed(frames):
        if f"{os.sep}transformers{os.sep}" in f.filename:
            return f"{Path(f.filename).name}:{f.lineno} {f.name}: {(f.line or '').strip()}"[:300]
    return None


def _exc_line(exc: BaseException) -> str:
    text = str(exc).strip()
    first = text.splitlines()[0] if text else ""
    return f"{type(exc).__name__}: {first}"
