"""The command line's answer cache: a repeated ``estimate``, ``fit`` or ``plan`` answered from
disk (``cache.py``) before torch is imported.

Importing torch and transformers takes seconds, longer than reading an answer. So the command
line's entry point (this module's :func:`main`) first makes the question's key from the command
line as typed: its words, the working directory, the contents of every file or folder a word
names (the model's config.json among them), the environment variables that change an answer
or its look (:data:`ENVIRONMENT`) and whether standard output is a terminal and how wide. When
the cache holds an answer for that key, made by this version (``cache.fingerprint``), it writes
it and stops; else it runs the command (``cli/``) and keeps what it wrote to standard output.

A replayed answer is the earlier run's output but for its timings, which are this call's and
say that it is a replay (:func:`replayed`). In JSON every ``seconds`` field is this call's time
(``search_seconds`` 0: nothing was searched) and an ``answer_cache`` field says when the answer
was made and what its timings were then. In the tables, the line that said how long the answer
took (``ledger_timing``, ``fit_timing``, ``plan_timing`` in ``render/``, handed over by
``cli/report.py``) says instead that it was answered from the cache, in how long, and when the
answer was made and what that line said then.

Questions that are not answered from here (the command runs as usual, and the trace cache
still applies): other commands, ``--no-cache``, options that write files or logs
(:data:`SIDE_EFFECTS`), a model that is not a local file or folder (a Hub name), and words that
name Python code (``FILE.py:FUNCTION``: code can change under the same name).
"""

from __future__ import annotations

import datetime
import gc
import json
import os
import shutil
import sys
import time
from collections.abc import Sequence
from typing import Any

from .cache import CACHE_DIR_VARIABLE, NO_CACHE_VARIABLE, Store, enabled, path_fingerprint

ANSWERED = ("estimate", "fit", "plan")
"""Commands whose answers are kept: predictions from the files and options given."""
NO_CACHE = "--no-cache"
SIDE_EFFECTS = ("--html", "--memory-snapshot", "--plot", "--debug", "--help", "-h")
"""Options that write files or logs (or help): such a run is never replaced by a replay."""
ENVIRONMENT = (
    "COLUMNS",
    "LINES",
    "TERM",
    "COLORTERM",
    "NO_COLOR",
    "FORCE_COLOR",
    "TTY_COMPATIBLE",
    "TTY_INTERACTIVE",
    "HF_HUB_OFFLINE",
    "HF_HOME",
)
"""Environment variables that change an answer or how it is drawn (rich reads the terminal
ones); every ``VRAMLEDGER_*`` variable but the cache's own is in the key too."""

ANSWERS = Store("answers")


def answer_key(argv: Sequence[str]) -> dict[str, Any] | None:
    """The key of the question ``argv`` asks, or None when it is not answered from the cache."""
    if not argv or argv[0] not in ANSWERED or len(argv) < 2:
        return None
    words = list(argv)
    files: dict[str, Any] = {}
    for word in words[1:]:
        if (
            word in SIDE_EFFECTS
            or word == NO_CACHE
            or any(word.startswith(option + "=") for option in SIDE_EFFECTS)
        ):
            return None
        for part in (word, word.partition("=")[2]):
            if part.endswith(".py") or ".py:" in part:
                return None
            if part and part not in files and len(part) < 4096:
                found = path_fingerprint(part)
                if found is not None:
                    files[part] = found
    if words[1] not in files:  # the model: a Hub name or code, whose contents are not here
        return None
    environment = {
        name: value
        for name, value in sorted(os.environ.items())
        if name in ENVIRONMENT
        or (name.startswith("VRAMLEDGER_") and name not in (CACHE_DIR_VARIABLE, NO_CACHE_VARIABLE))
    }
    terminal = sys.stdout.isatty()
    return {
        "argv": words,
        "cwd": os.getcwd(),
        "files": files,
        "environment": environment,
        "terminal": terminal,
        "size": list(shutil.get_terminal_size()) if terminal else None,
    }


class _Tee:
    """Standard output, kept as it is written: a terminal stays a terminal to rich (``isatty``,
    ``fileno`` and the rest are the real stream's)."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream
        self.parts: list[str] = []

    def write(self, text: str) -> int:
        self.parts.append(text)
        return self._stream.write(text)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


class _Kept:
    """What the command's ``report`` hands over (``cli.main``'s ``keep``): its answer and the
    lines of its table that say how long it took."""

    def __init__(self) -> None:
        self.result: Any = None
        self.timings: list[str] = []

    def __call__(self, result: Any, timings: list[str]) -> None:
        self.result, self.timings = result, list(timings)


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def _when(made_at: str) -> str:
    """``2026-12-07 00:20 UTC`` for a stored ISO time."""
    try:
        moment = datetime.datetime.fromisoformat(made_at)
    except (TypeError, ValueError):
        return str(made_at)
    return moment.astimezone(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def replayed(stored: dict[str, Any], seconds: float) -> str:
    """The stored answer's output as this call writes it, ``seconds`` after it started: its
    timings this call's, and said to come from the cache (module docstring)."""
    text = stored["stdout"]
    made_at = stored.get("made_at", "")
    answer = None
    if stored.get("json"):
        try:
            answer = json.loads(text)
        except ValueError:
            pass
    if isinstance(answer, dict):
        answer["answer_cache"] = {
            "answered_from_cache": True,
            "made_at": made_at,
            "made_in_seconds": stored.get("seconds"),
            "original_timings": {k: answer[k] for k in TIMINGS if k in answer},
        }
        _this_call(answer, seconds)
        return json.dumps(answer, indent=2) + "\n"
    for line in stored.get("timings", []):
        said = cache_line(seconds, made_at, line)
        if line in text:
            text = text.replace(line, said, 1)
        else:  # rich wrapped the line on a narrow terminal: say it after the answer
            text += f"{said}; the timings above are that run's\n"
    return text


TIMINGS = ("seconds", "search_seconds")
"""JSON fields that say how long an answer took; a replay writes this call's."""


def _this_call(value: Any, seconds: float) -> None:
    """Every timing field of a JSON answer, at any depth (a ledger's ranks have their own), set
    to what this call spent on it; the ``answer_cache`` field keeps the stored ones."""
    if isinstance(value, dict):
        for key in value:
            if key == "answer_cache":
                continue
            if key == "seconds":
                value[key] = round(seconds, 3)
            elif key == "search_seconds":
                value[key] = 0.0
            else:
                _this_call(value[key], seconds)
    elif isinstance(value, list):
        for item in value:
            _this_call(item, seconds)


def cache_line(seconds: float, made_at: str, original: str) -> str:
    """What a replayed table says instead of its line ``original`` of how long it took."""
    return (
        f"answered from the cache in {seconds:.2f} s; the answer was made {_when(made_at)} "
        f"({original})"
    )


def main(argv: Sequence[str] | None = None) -> int:
    """The ``vramledger`` command: a stored answer to this question, else ``cli.main``'s."""
    start = time.perf_counter()
    args = list(sys.argv[1:] if argv is None else argv)
    key = answer_key(args) if enabled() and NO_CACHE not in args else None
    if key is not None:
        stored = ANSWERS.get(key)
        if stored is not None:
            sys.stdout.write(replayed(stored, time.perf_counter() - start))
            sys.stdout.flush()
            if sys.stderr.isatty():
                print(
                    "vramledger: answered from the cache (the earlier run's answer; "
                    f"{NO_CACHE} recomputes it)",
                    file=sys.stderr,
                )
            return 0
    from .cli import main as cli_main

    if key is None:
        return cli_main(args)
    made_at = _now()
    kept = _Kept()
    tee = _Tee(sys.stdout)
    sys.stdout = tee  # type: ignore[assignment]
    try:
        code = cli_main(args, keep=kept)
    finally:
        sys.stdout = tee._stream
    if code == 0:
        ANSWERS.put(
            key,
            {
                "stdout": "".join(tee.parts),
                "json": "--json" in args,
                "timings": kept.timings,
                "made_at": made_at,
                "seconds": round(time.perf_counter() - start, 3),
            },
        )
    return code


def run() -> int:
    """The process's entry (the ``vramledger`` script, ``python -m vramledger``): ``main``, then
    the objects made so far frozen out of the garbage collector, whose passes over them at
    interpreter exit (torch's and the tracer's caches: millions of objects) otherwise take
    seconds. Measured on a 70B estimate: 1.9 s from the answer to the exit, 0.3 s frozen
    (``benchmarks/results/README-cache-speed.md``)."""
    code = main()
    gc.freeze()
    return code


if __name__ == "__main__":
    sys.exit(run())
