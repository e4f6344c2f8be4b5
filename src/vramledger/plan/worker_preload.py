"""What the planner's worker processes import before their first re-estimate.

``runner.py`` forks its workers from a fork server that imports this module once: torch,
transformers' modelling code, torchao's optimizers and vramledger's engines. On the 2-core VM
a spawned worker spent 1.5 s importing vramledger's modules and its first tiny estimate took
3.5-3.8 s against 0.4-0.5 s for the next (``transformers.modeling_utils`` alone imports in 3 s);
this module imports in 3.2-3.5 s, once, and a forked worker's first estimate then takes
0.7-0.8 s. Each worker inherits the imports instead of making them itself. Only imports run
here (no tensor operation, no thread started by Python code), so forking from this process is
safe.
"""

from __future__ import annotations

import contextlib
import importlib

from ..chatter import quiet_import_chatter

PRELOADED = (
    "vramledger.predict",
    "vramledger.trace.fake",
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
