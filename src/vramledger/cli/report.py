"""How the commands hand their answers over: JSON or terminal tables on stdout, the HTML report,
plot and memory snapshot written when asked, and a progress bar on stderr while they work."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any

from rich.console import Console

from vramledger.inputs.errors import InputError


def with_progress(args: argparse.Namespace, run: Callable[[Any], Any]) -> Any:
    """``run(progress)`` with a progress bar on stderr, or quietly for ``--json``."""
    if args.json:
        return run(None)
    bar, progress = _progress_bar()
    with bar:
        return run(progress)


def report(
    args: argparse.Namespace,
    result: Any,
    table: Callable[[Any], Any],
    plot: Callable[[Any, str], Any] | None = None,
    timing: Callable[[Any], str] | None = None,
) -> int:
    """Write the plot, HTML report and memory snapshot if asked, then print JSON or the
    terminal table. ``timing``: the table's line of how long the answer took, handed with the
    answer to the answer cache (``args.keep_answer``, set by ``cli.main``) so that a replay
    can say it is one."""
    plotted = plot is not None and getattr(args, "plot", None)
    if plotted:
        plot(result, args.plot)
    if getattr(args, "html", None):
        from vramledger.render.html import write_html

        write_html(result, args.html)
    if getattr(args, "memory_snapshot", None):
        from vramledger.render.snapshot import write_memory_snapshot

        write_memory_snapshot(result, args.memory_snapshot)
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        from vramledger.render.terminal import print_renderable

        print_renderable(table(result))
        if plotted:
            print(f"plot: {args.plot}")
    keep = getattr(args, "keep_answer", None)
    if keep is not None:
        keep(result, [timing(result)] if timing is not None and not args.json else [])
    return 0


TRAINED_ON_HOST_EXIT = 4
"""`vramledger run`'s exit status where the program trained on the CPU, nothing on the GPU (3 is
a --timeout stop)."""
PATCH_MISSING_EXIT = 4
"""`vramledger compat`'s exit status where a patched target of an installed package in its
tested range is missing (the check ran; what it checked failed)."""


def report_program(args: argparse.Namespace, result: Any) -> int:
    """Write the HTML report and memory snapshot of the program's ledger if asked, then print
    JSON or the tables; the exit status says how the program ended."""
    from vramledger.render.program import measured_program_table, program_table
    from vramledger.render.terminal import print_renderable

    ledger = getattr(result, "ledger", None)
    for option in ("html", "memory_snapshot"):
        if getattr(args, option, None) and ledger is None:
            raise InputError(
                f"--{option.replace('_', '-')} needs a prediction with two optimizer steps or more",
                hint="let the program step (--max-steps, --timeout), without --measure",
            )
    if args.html:
        from pathlib import Path

        from vramledger.render.html import ledger_html

        try:
            Path(args.html).write_text(
                ledger_html(ledger, title=f"vramledger run: {result.program}"), encoding="utf-8"
            )
        except OSError as exc:
            raise InputError(
                f"cannot write {args.html}: {exc.strerror}", hint="check the path"
            ) from exc
    if args.memory_snapshot:
        from vramledger.render.snapshot import write_memory_snapshot

        write_memory_snapshot(ledger, args.memory_snapshot)
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        table = measured_program_table if args.measure else program_table
        print_renderable(table(result))
    if (host := getattr(result, "trained_on_host_bytes", 0)) and not args.allow_host_training:
        from vramledger.predict.program import TRAINED_ON_HOST

        print(
            f"vramledger: warning: {TRAINED_ON_HOST.format(nbytes=host)} (exit status "
            f"{TRAINED_ON_HOST_EXIT}; --allow-host-training to accept it)",
            file=sys.stderr,
        )
        return TRAINED_ON_HOST_EXIT
    if result.ending == "timeout":
        print(
            f"vramledger: the program was stopped by --timeout {args.timeout:g} after "
            f"{result.steps} optimizer step{'s' if result.steps != 1 else ''}",
            file=sys.stderr,
        )
        return 3
    return result.exit_code


def _progress_bar() -> Any:
    """A rich progress bar and a ``progress(name, done, total)`` callback that drives it."""
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
    )

    bar = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        transient=True,
        console=Console(stderr=True),
    )
    tasks: dict[str, Any] = {}

    def progress(name: str, done: int, total: int) -> None:
        if name not in tasks:
            tasks[name] = bar.add_task(name, total=total)
        bar.update(tasks[name], completed=done, total=total)

    return bar, progress
