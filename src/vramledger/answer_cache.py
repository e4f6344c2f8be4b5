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

An ``estimate`` question that differs from an earlier one only in ``--gpu``, ``--gpu-memory``
or ``--margin`` (:data:`GPU_OPTIONS`), on a GPU of the same compute capability, needs the same
traces; it is answered here too, without torch (:func:`derived`): beside each estimate's output
the cache keeps its ledger (``ledger_record.py``), and ``other_gpu.py`` makes from it the
ledger estimate makes for the GPU and margin asked (their notes, warnings and verdict; every
other field is the same). Its timings are this call's, and its ``answer_cache`` field (JSON) or
its line of how long it took (tables) says which question's answer it was made from.

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
from dataclasses import replace
from typing import Any

from vramledger.inputs.cache import (
    CACHE_DIR_VARIABLE,
    NO_CACHE_VARIABLE,
    Store,
    enabled,
    path_fingerprint,
)
from vramledger.inputs.errors import InputError
from vramledger.inputs.gpus import asked_gpu
from vramledger.inputs.host_cpu import CPU_KERNEL_VARIABLES, THREAD_VARIABLES
from vramledger.inputs.verdict import check_gpu_options
from vramledger.ledger.ledger import Ledger
from vramledger.ledger.ledger_record import ledger_from_record, ledger_record
from vramledger.ledger.other_gpu import compute_capability, for_gpu

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
    *THREAD_VARIABLES,
    *CPU_KERNEL_VARIABLES,
)
"""Environment variables that change an answer or how it is drawn (rich reads the terminal
ones; the thread counts and the kernels' instruction sets change a CPU target's kernel scratch,
``trace/core/cpu_scratch.py``); every ``VRAMLEDGER_*`` variable but the cache's own is in the key too."""

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
    return _said(text, [(line, cache_line(seconds, made_at, line)) for line in stored["timings"]])


def _said(text: str, lines: list[tuple[str, str]]) -> str:
    """The table ``text`` with each line of how long it took replaced by what the cache says."""
    for line, said in lines:
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


def cache_line(seconds: float, made_at: str, original: str, made_for: str = "") -> str:
    """What a replayed table says instead of its line ``original`` of how long it took;
    ``made_for``: the question the answer was made for, where it was another."""
    where = f" for {made_for}" if made_for else ""
    return (
        f"answered from the cache in {seconds:.2f} s; the answer was made {_when(made_at)}"
        f"{where} ({original})"
    )


# -- another GPU, another margin ------------------------------------------------------------
GPU_OPTIONS = ("--gpu", "--gpu-memory", "--margin")
"""``estimate``'s options that change its traces only through the GPU's compute capability
(``trace/core/cache.py``'s ``NOT_IN_KEY``): a question that differs from an earlier one only in these,
on a GPU of the same compute capability, is answered from the earlier answer's ledger
(``other_gpu.py``), kept beside it."""


def _without_gpu_options(argv: Sequence[str]) -> tuple[list[str], dict[str, str], list[int]]:
    """``argv`` without its GPU options; their values; and where each stood (the index, in the
    words left, of the word it came before). ValueError when one is given twice or without a
    value, or after ``--``."""
    rest: list[str] = []
    values: dict[str, str] = {}
    slots: list[int] = []
    words = iter(argv)
    for word in words:
        if word == "--":
            raise ValueError("positional words follow")
        option, equals, value = word.partition("=")
        if option not in GPU_OPTIONS:
            rest.append(word)
            continue
        if not equals:
            value = next(words, "")
        if not value or value.startswith("-") or option in values:
            raise ValueError(f"{option} without one value")
        values[option] = value
        slots.append(len(rest))
    return rest, values, slots


def other_gpu_key(
    argv: Sequence[str],
) -> tuple[dict[str, Any], list[str], dict[str, str], list[int]] | None:
    """The key of the ``estimate`` question ``argv`` asks, its GPU options aside (the GPU's
    compute capability in their place), and :func:`_without_gpu_options`' parts; None when it
    is not answered from the cache."""
    if not argv or argv[0] != "estimate":
        return None
    try:
        rest, values, slots = _without_gpu_options(argv)
        base = answer_key(rest)
        cc = compute_capability(asked_gpu(values.get("--gpu"), values.get("--gpu-memory")))
    except (InputError, ValueError):
        return None
    if base is None:
        return None
    return {"estimate, any GPU": base, "compute_capability": list(cc)}, rest, values, slots


def _placed_as_before(rest: list[str], slots: list[int], before: list[int]) -> bool:
    """Whether the GPU options stand where the command line reads them as it did the earlier
    question's: where that question had one, at the end, or after a word that is no option (the
    command, the model, a value); never between an option and its value. (Every ``estimate``
    option takes at most one value, and the model is its one positional word.)"""
    for slot in slots:
        if slot in before or slot == len(rest):
            continue
        if slot > 0 and (not rest[slot - 1].startswith("-") or "=" in rest[slot - 1]):
            continue
        return False
    return True


def derived(argv: Sequence[str], start: float) -> str | None:
    """The output of the ``estimate`` question ``argv`` made from the kept ledger of an earlier
    one that differs only in its GPU options, on a GPU of the same compute capability
    (``other_gpu.py``); None when there is none (or it cannot answer this question: then the
    command runs). ``start``: when this call started."""
    found = other_gpu_key(argv)
    if found is None:
        return None
    key, rest, values, slots = found
    stored = ANSWERS.get(key)
    if stored is None or not _placed_as_before(rest, slots, stored.get("slots", [])):
        return None
    gpu, memory = values.get("--gpu"), values.get("--gpu-memory")
    try:
        made = ledger_from_record(stored["ledger"])
        margin = check_gpu_options(made.spec["target"], gpu, memory, values.get("--margin"))
        answer = for_gpu(made, gpu=gpu, gpu_memory=memory, margin=margin)
    except (InputError, KeyError, TypeError, ValueError):
        return None
    if answer is None:
        return None
    seconds = time.perf_counter() - start
    answer = replace(
        answer,
        seconds=seconds,
        ranks=[(ids, replace(one, seconds=seconds)) for ids, one in answer.ranks],
    )
    if "--json" in rest:
        out = answer.to_dict()
        out["answer_cache"] = {
            "answered_from_cache": True,
            "made_at": stored.get("made_at", ""),
            "made_in_seconds": stored.get("seconds"),
            "original_timings": {"seconds": round(made.seconds, 3)},
            "made_for": {name: made.spec.get(name) for name in ("gpu", "gpu_memory", "margin")},
        }
        return json.dumps(out, indent=2) + "\n"
    from vramledger.render.terminal import ledger_table, ledger_timing, output_console

    table = ledger_table(answer)
    console = output_console(table)
    with console.capture() as captured:
        console.print(table)
    options = stored.get("gpu_options", {})
    made_for = " ".join(f"{option} {value}" for option, value in options.items())
    said = cache_line(
        seconds,
        stored.get("made_at", ""),
        ledger_timing(made),
        f"the same question with {made_for}"
        if made_for
        else "the same question without " + ", ".join(GPU_OPTIONS),
    )
    return _said(captured.get(), [(ledger_timing(answer), said)])


def _keep_for_other_gpus(
    found: tuple[dict[str, Any], list[str], dict[str, str], list[int]],
    ledger: Ledger,
    made_at: str,
    seconds: float,
) -> None:
    """Keep the ledger ``estimate`` answered with, for :func:`derived`; ``found``: the
    question's :func:`other_gpu_key`, made before the command ran (it sets environment
    variables of the key)."""
    key, _, values, slots = found
    entry = {
        "ledger": ledger_record(ledger),
        "slots": slots,
        "gpu_options": values,
        "made_at": made_at,
        "seconds": seconds,
    }
    try:
        ANSWERS.put(key, entry)
    except (TypeError, ValueError):  # a spec value JSON cannot hold: answered by the command
        pass


def _answered(text: str, source: str) -> int:
    """Write an answer the cache gave; on a terminal, say on standard error where it came from."""
    sys.stdout.write(text)
    sys.stdout.flush()
    if sys.stderr.isatty():
        print(
            f"vramledger: answered from the cache ({source}; {NO_CACHE} recomputes it)",
            file=sys.stderr,
        )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """The ``vramledger`` command: a stored answer to this question, else ``cli.main``'s."""
    start = time.perf_counter()
    args = list(sys.argv[1:] if argv is None else argv)
    key = answer_key(args) if enabled() and NO_CACHE not in args else None
    if key is not None:
        stored = ANSWERS.get(key)
        if stored is not None:
            return _answered(
                replayed(stored, time.perf_counter() - start), "the earlier run's answer"
            )
        text = derived(args, start)
        if text is not None:
            return _answered(text, "an earlier answer's ledger for another GPU or margin")
    from vramledger.cli import main as cli_main

    if key is None:
        return cli_main(args)
    made_at = _now()
    other_gpus = other_gpu_key(args)  # before the command sets HF_HUB_OFFLINE (cli.main)
    kept = _Kept()
    tee = _Tee(sys.stdout)
    sys.stdout = tee  # type: ignore[assignment]
    try:
        code = cli_main(args, keep=kept)
    finally:
        sys.stdout = tee._stream
    if code == 0:
        seconds = round(time.perf_counter() - start, 3)
        ANSWERS.put(
            key,
            {
                "stdout": "".join(tee.parts),
                "json": "--json" in args,
                "timings": kept.timings,
                "made_at": made_at,
                "seconds": seconds,
            },
        )
        if other_gpus is not None and isinstance(kept.result, Ledger):
            _keep_for_other_gpus(other_gpus, kept.result, made_at, seconds)
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
