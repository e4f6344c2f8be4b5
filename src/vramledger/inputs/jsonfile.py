"""Reading a user's JSON file (a model config, a DeepSpeed config, a rehearsal) or pasted JSON
text, with a one-line error that names the file and what to do."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from vramledger.inputs.errors import InputError


def read_json_object(path: str | Path, what: str, hint: str) -> dict[str, Any]:
    """The JSON object in ``path``; ``what`` names the file in errors ('config file')."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"{what} {path} not found", hint=hint)
    return parse_json_object(path.read_text(), str(path), hint)


def parse_json_object(text: str, name: str, hint: str) -> dict[str, Any]:
    """The JSON object ``text`` holds; ``name`` names it in errors (a path, 'pasted
    config.json')."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InputError(
            f"{name} is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}",
            hint=hint,
        ) from exc
    if not isinstance(data, dict):
        raise InputError(f"{name} must be a JSON object, not {type(data).__name__}", hint=hint)
    return data
