"""A question the page asks, checked before any worker sees it: which answer (estimate, fit,
plan, advise), the model, and the TrainingSpec fields of the form.

Only what the server was started on is read. A model is a config (a ``.json`` file or a folder
holding ``config.json``) under the folder given on the command line, resolved and checked to
stay inside it (no ``..``, no absolute path, no symlink out); a pasted ``config.json``, parsed
here as JSON and nothing else; or, only when the server was started with ``--allow-code DIR``,
``FILE.py:FUNCTION`` under DIR (and so are ``inputs`` and ``loss``). Every other field is a name
or a number: an optimizer is a name (an import path would import a module), and the options
that read other files (``--deepspeed``, ``--accelerate-config``, ``--tp-plan``) are not offered.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any

from vramledger.cli.serve.form import CODE_FIELDS, spec_words
from vramledger.inputs.errors import InputError
from vramledger.inputs.jsonfile import parse_json_object

KINDS: tuple[str, ...] = ("estimate", "fit", "plan", "advise")
"""The answers the page asks for: each is the CLI command of the same name."""
OPTIONS: dict[str, dict[str, Any]] = {  # fit --max (its only choice option), plan --max-gpus
    "fit": {"maximize": ("batch-size", "seq-len", "both")},
    "plan": {"max_gpus": int},
}
"""The commands' own options (``fit --max``, ``plan --max-gpus``) the page offers."""
MAX_CONFIG_BYTES = 1 << 20
"""The largest config the page reads or takes pasted: a Hugging Face config.json is a few KiB
(the largest in transformers' tests, with long id2label maps, are under 200 KiB)."""
MAX_LISTED = 500
"""Configs listed under the folder, at most (the page takes a typed path beyond these)."""
MAX_DEPTH = 6
"""Folder levels searched for configs below the folder the server was started on."""
MAX_FOLDERS = 5000
"""Folders searched for configs at most (a server started on a home folder lists what it finds
in these, and takes a typed path beyond them)."""
PASTED = "pasted config.json"
"""What a pasted config is called in answers and errors."""
FUNCTION = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@dataclass(frozen=True, kw_only=True)
class Question:
    """What a worker runs: ``TrainingSpec(model=model, **spec)`` answered as ``kind``."""

    kind: str
    model: str
    """A resolved path (a config, its folder, or ``FILE.py:FUNCTION``) the server checked."""
    shown: str
    """The model as the page names it (the path under the folder, or 'pasted config.json')."""
    spec: dict[str, Any] = field(default_factory=dict)
    options: dict[str, Any] = field(default_factory=dict)

    def key(self) -> str:
        """Equal for equal questions: the answer cache's key."""
        return json.dumps(
            [self.kind, self.model, self.spec, self.options], sort_keys=True, default=str
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "model": self.model,
            "shown": self.shown,
            "spec": self.spec,
            "options": self.options,
        }


class Sources:
    """Where models may come from: the config folder, the code folder, and a private folder
    (the server's own, made for it) where pasted configs are written as JSON."""

    def __init__(self, configs: Path | None, code: Path | None, pasted: Path):
        self.configs = configs.resolve() if configs is not None else None
        self.code = code.resolve() if code is not None else None
        self.pasted = pasted

    def listed(self) -> list[str]:
        """Configs under the folder, as paths relative to it: ``.json`` files and folders
        holding a ``config.json``, hidden folders skipped, symlinks leading out left out."""
        if self.configs is None:
            return []
        found: list[str] = []
        for walked, (here, dirs, files) in enumerate(os.walk(self.configs)):
            if walked >= MAX_FOLDERS:
                break
            rel = Path(here).relative_to(self.configs)
            dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d != "__pycache__")
            if len(rel.parts) >= MAX_DEPTH:
                dirs[:] = []
            if "config.json" in files and rel.parts:
                found.append(rel.as_posix() + "/")
            for name in sorted(files):
                if name.endswith(".json") and not name.startswith("."):
                    try:
                        self._inside((rel / name).as_posix(), self.configs, "config")
                    except InputError:
                        continue
                    found.append((rel / name).as_posix())
            if len(found) >= MAX_LISTED:
                break
        return found[:MAX_LISTED]

    def config(self, rel: str) -> tuple[str, str]:
        """(resolved path, shown name) of a config under the folder."""
        if self.configs is None:
            raise InputError(
                "this server reads no config files",
                hint="paste a config.json, or start it as `vramledger serve DIR` to pick one "
                "under DIR",
            )
        path = self._inside(rel, self.configs, "config")
        file = path
        if path.is_dir():
            file = self._inside(f"{rel.rstrip('/')}/config.json", self.configs, "config")
        if not file.is_file():
            raise InputError(f"{rel} holds no config.json", hint="give a config.json or its folder")
        if file.suffix != ".json":
            raise InputError(f"{rel} is not a .json file", hint="give a config.json or its folder")
        if file.stat().st_size > MAX_CONFIG_BYTES:
            raise InputError(f"{rel} is larger than {MAX_CONFIG_BYTES} bytes for a config.json")
        return str(path), rel

    def code_model(self, ref: str) -> tuple[str, str]:
        """(``/resolved/FILE.py:FUNCTION``, shown name) of a model function under the code
        folder; refused unless the server was started with ``--allow-code DIR``."""
        if self.code is None:
            raise InputError(
                "this server runs no Python files",
                hint="start it with --allow-code DIR to build models from FILE.py:FUNCTION "
                "under DIR",
            )
        rel, colon, function = ref.rpartition(":")
        if not colon or not FUNCTION.fullmatch(function) or not rel.endswith(".py"):
            raise InputError(
                f"{ref!r} is not FILE.py:FUNCTION", hint="write it like models.py:build_model"
            )
        path = self._inside(rel, self.code, "Python file")
        if not path.is_file():
            raise InputError(f"{rel} is not a file", hint=f"give a .py file under {self.code}")
        return f"{path}:{function}", ref

    def paste(self, text: str) -> tuple[str, str]:
        """(path of the pasted config written as JSON in the private folder, shown name)."""
        if len(text.encode()) > MAX_CONFIG_BYTES:
            raise InputError(f"the pasted config is larger than {MAX_CONFIG_BYTES} bytes")
        data = parse_json_object(text, PASTED, "paste the contents of a Hugging Face config.json")
        if "model_type" not in data:
            raise InputError(
                f"{PASTED} has no 'model_type'",
                hint='a Hugging Face config.json names its model_type (e.g. "llama")',
            )
        canonical = json.dumps(data, sort_keys=True)
        folder = self.pasted / hashlib.sha256(canonical.encode()).hexdigest()[:16]
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / "config.json"
        if not path.exists():
            path.write_text(canonical, encoding="utf-8")
        return str(path), PASTED

    @staticmethod
    def _inside(rel: str, root: Path, what: str) -> Path:
        """``root / rel`` resolved, refused unless it stays inside ``root``."""
        if not rel or "\0" in rel:
            raise InputError(f"no {what} given", hint=f"pick one under {root}")
        parts = PurePosixPath(rel.replace("\\", "/")).parts
        if (
            PurePosixPath(rel).is_absolute()
            or PureWindowsPath(rel).is_absolute()
            or PureWindowsPath(rel).drive
            or ".." in parts
        ):
            raise InputError(
                f"{what} {rel!r} is not a path under the folder the server was started on",
                hint=f"give a path relative to {root}, without '..'",
            )
        path = (root / rel).resolve()
        if not path.is_relative_to(root):
            raise InputError(
                f"{what} {rel!r} leads outside the folder the server was started on",
                hint=f"give a file under {root} (a link out of it is not followed)",
            )
        if not path.exists():
            raise InputError(f"{what} {rel} not found", hint=f"pick one under {root}")
        return path


def parse_question(body: Any, sources: Sources) -> Question:
    """The page's request ``{"kind": ..., "source": ..., "model": ..., "form": {...}}`` as a
    Question; bad input raises the CLI's one-line InputError."""
    if not isinstance(body, dict):
        raise InputError("the request must be a JSON object")
    kind = body.get("kind")
    if kind not in KINDS:
        raise InputError(f"unknown question {kind!r}", hint=f"ask one of {', '.join(KINDS)}")
    source, model = body.get("source"), body.get("model")
    if not isinstance(model, str) or not model.strip():
        raise InputError("no model given", hint="pick a config, or paste a config.json")
    if source == "config":
        path, shown = sources.config(model.strip())
    elif source == "paste":
        path, shown = sources.paste(model)
    elif source == "code":
        path, shown = sources.code_model(model.strip())
    else:
        raise InputError(f"unknown model source {source!r}", hint="use config, paste or code")
    form = body.get("form") or {}
    if not isinstance(form, dict):
        raise InputError("the form must be a JSON object")
    form = dict(form)
    options_given = {name: form.pop(name) for name in _option_names() if name in form}
    spec = spec_words(form)
    for name in CODE_FIELDS:
        if name in spec:
            spec[name] = sources.code_model(spec[name])[0]
    optimizer = spec.get("optimizer", "")
    if any(mark in optimizer for mark in (":", ".", "/", "\\")):
        raise InputError(
            f"optimizer {optimizer!r}: the page takes optimizer names (adamw, sgd, adamw8bit, "
            "...), not import paths",
            hint="use the CLI's --optimizer for a class of your own",
        )
    options: dict[str, Any] = {}
    for name, kind_ in OPTIONS.get(kind, {}).items():
        if (value := _text(options_given, name)) is None:
            continue
        if kind_ is int:
            options[name] = _int(value, name)
        elif value not in kind_:
            raise InputError(f"unknown --max {value!r}", hint=f"use {', '.join(kind_)}")
        else:
            options[name] = value
    return Question(kind=kind, model=path, shown=shown, spec=spec, options=options)


def _option_names() -> set[str]:
    return {name for options in OPTIONS.values() for name in options}


def _text(form: dict[str, Any], name: str) -> str | None:
    value = form.get(name)
    if value is None or isinstance(value, bool):
        return None
    text = str(value).strip()
    return text or None


def _int(text: str, name: str) -> int:
    """As argparse's ``type=int`` reads the CLI option of the same name."""
    try:
        return int(text)
    except ValueError:
        raise InputError(
            f"argument --{name.replace('_', '-')}: invalid int value: {text!r}"
        ) from None
