"""The ``vramledger`` command line. Each spec option sets the TrainingSpec field of the same name
and is made from it (options.py); the library computes, and ``render/`` draws.

``parser.py`` holds the subcommands and their own options, ``commands.py`` what each runs and
``report.py`` how its answer is written. ``python -m vramledger.cli`` runs :func:`main`
(``python -m vramledger`` and the ``vramledger`` script first look in the answer cache).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable, Sequence

from vramledger.cli.options import spec_from_args
from vramledger.cli.parser import build_parser
from vramledger.inputs import cache
from vramledger.inputs.chatter import quiet_import_chatter
from vramledger.inputs.errors import VramledgerError

__all__ = ["build_parser", "main", "spec_from_args"]


def _quiet_libraries(debug: bool) -> None:
    if debug:
        logging.basicConfig(level=logging.INFO)
        return
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import warnings

    warnings.filterwarnings("ignore")
    quiet_import_chatter()


def main(
    argv: Sequence[str] | None = None, *, keep: Callable[[object, list[str]], None] | None = None
) -> int:
    """Run the command ``argv`` asks. ``keep``: called with the answer and the lines of its
    table that say how long it took (``report.py``), for the answer cache (``answer_cache.py``)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    args.keep_answer = keep
    debug = getattr(args, "debug", False)
    if getattr(args, "no_cache", False):  # the planner's workers inherit it
        os.environ[cache.NO_CACHE_VARIABLE] = "1"
    _quiet_libraries(debug)
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except VramledgerError as exc:
        if debug:
            raise
        print(f"vramledger: error: {exc.one_line()}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("vramledger: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        if debug:
            raise
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        print(
            f"vramledger: error: {type(exc).__name__}: {first} (pass --debug for the traceback)",
            file=sys.stderr,
        )
        return 1
