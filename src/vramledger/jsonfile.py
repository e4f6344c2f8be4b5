"""Reading a user's JSON file (a model config, a DeepSpeed config, a rehearsal) with a one-line
error that names the file and what to do."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .errors import InputError


def read_json_object(path: str | Path, what: str, hint: str) -> dict[str, Any]:
    """The JSON object in ``path``; ``what`` names the file in errors ('config file')."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"{what} {path} not found", hint=hint)
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise InputError(
            f"{path} is not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})",
            hint=hint,
        ) from exc
    if not isinstance(data, dict):
        raise InputError(f"{path} must hold a JSON object, not {type(data).__name__}", hint=hint)
    return data
