"""vramledger: will this training step fit, where does the memory go, and what would make it fit.

``estimate(...)`` predicts by running the real training step on fake tensors;
``measure(...)`` runs it for real and reports the same ledger.

``estimate`` and ``TrainingSpec`` are imported on first use (PEP 562): ``import vramledger``
alone imports no torch, so the command line answers a repeated question from its cache
(``answer_cache.py``) without paying for torch's import.
"""

import functools
import importlib
from typing import TYPE_CHECKING, Any

from vramledger.inputs.categories import Category, Phase
from vramledger.inputs.errors import InputError, TraceError, VramledgerError
from vramledger.inputs.version import __version__
from vramledger.ledger.ledger import Ledger

if TYPE_CHECKING:
    from vramledger.inputs.spec import TrainingSpec

_LAZY = {"TrainingSpec": "inputs.spec"}
"""Public names whose modules import torch: imported when first asked for."""


def __getattr__(name: str) -> Any:
    if name == "estimate":
        value = _quiet_estimate()
    elif name in _LAZY:
        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def _quiet_estimate() -> Any:
    from vramledger.inputs.chatter import library_chatter_quieted
    from vramledger.predict.step import estimate as _estimate

    @functools.wraps(_estimate)
    def estimate(*args: Any, **kwargs: Any) -> Ledger:
        # the libraries' log lines and warnings, quiet while the call runs (chatter.py), as the
        # CLI keeps them; vramledger.predict.step.estimate runs without this.
        with library_chatter_quieted():
            return _estimate(*args, **kwargs)

    return estimate


__all__ = [
    "Category",
    "InputError",
    "Ledger",
    "Phase",
    "TraceError",
    "TrainingSpec",
    "VramledgerError",
    "__version__",
    "estimate",
]
