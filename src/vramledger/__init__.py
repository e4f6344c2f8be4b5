"""vramledger: will this training step fit, where does the memory go, and what would make it fit.

``estimate(...)`` predicts by running the real training step on fake tensors;
``measure(...)`` runs it for real and reports the same ledger.
"""

import functools
from typing import Any

from .categories import Category, Phase
from .chatter import library_chatter_quieted
from .errors import InputError, TraceError, VramledgerError
from .ledger import Ledger
from .predict import estimate as _estimate
from .spec import TrainingSpec
from .version import __version__


@functools.wraps(_estimate)
def estimate(*args: Any, **kwargs: Any) -> Ledger:
    # the libraries' log lines and warnings, quiet while the call runs (chatter.py), as the CLI
    # keeps them; vramledger.predict.estimate runs without this.
    with library_chatter_quieted():
        return _estimate(*args, **kwargs)


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
