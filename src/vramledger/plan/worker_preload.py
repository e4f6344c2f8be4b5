"""What the planner's worker processes import before their first re-estimate.

``runner.py`` forks its workers from a fork server that imports this module once: torch,
transformers' modelling code, torchao's optimizers and vramledger's engines. A spawned worker
would make these imports itself before its first estimate, several times slower than the next
(``transformers.modeling_utils`` alone takes seconds); a forked worker inherits them, made once
(measured: ``benchmarks/results/README-startup.md``). Only imports run
here (no tensor operation, no thread started by Python code), so forking from this process is
safe.
"""

from __future__ import annotations

import contextlib
import importlib

from vramledger.inputs.chatter import quiet_import_chatter

PRELOADED = (
    "vramledger.predict.step",
    "vramledger.trace.core.fake",
    "vramledger.parallel.engines",
    "vramledger.parallel.mesh",
    "vramledger.parallel.pipeline",
    "transformers.modeling_utils",
    "torchao.optim",
)

quiet_import_chatter()
for _name in PRELOADED:
    with contextlib.suppress(ImportError):  # an optional library missing: imported on use
        importlib.import_module(_name)
