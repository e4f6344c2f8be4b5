"""Log every ``vramledger.predict.step.estimate`` a command makes, in every process it starts.

Put this folder first on ``PYTHONPATH`` and name a file in ``VRAMLEDGER_ESTIMATE_LOG``: Python
imports ``sitecustomize`` at start-up in the command and in each worker process (the fork server
starts a fresh interpreter), and this one wraps ``estimate`` as ``vramledger.predict.step`` is loaded.
Each estimate appends one JSON line: process, wall-clock start, seconds, and what was estimated.
Nothing changes what the command computes. Used by ``README-cache-speed.md`` to say where a cold
``fit`` or ``plan`` spends its time.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import json
import os
import sys
import time

LOG = os.environ.get("VRAMLEDGER_ESTIMATE_LOG")
FIELDS = (
    "world_size",
    "strategy",
    "tp",
    "pp",
    "batch_size",
    "seq_len",
    "offload",
    "optimizer",
    "precision",
    "grad_checkpointing",
)


def _wrap(module):
    estimate = module.estimate

    @functools.wraps(estimate)
    def logged(spec=None, /, *, blocks_verified=False, **fields):
        start, clock = time.time(), time.perf_counter()
        try:
            return estimate(spec, blocks_verified=blocks_verified, **fields)
        finally:
            line = {"pid": os.getpid(), "start": round(start, 3)}
            line["seconds"] = round(time.perf_counter() - clock, 3)
            line.update({f: getattr(spec, f, fields.get(f)) for f in FIELDS})
            line["blocks_verified"] = blocks_verified
            with open(LOG, "a") as out:
                out.write(json.dumps(line) + "\n")

    module.estimate = logged


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "vramledger.predict.step":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            _wrap(module)

        spec.loader.exec_module = exec_module
        return spec


if LOG:
    sys.meta_path.insert(0, _Finder())
