"""vramledger: will this training step fit, where does the memory go, and what would make it fit.

``estimate(...)`` predicts by running the real training step on fake tensors;
``measure(...)`` runs it for real and reports the same ledger.
"""

from .categories import Category, Phase
from .errors import InputError, TraceError, VramledgerError
from .ledger import Ledger
from .predict import estimate
from .spec import TrainingSpec
from .version import __version__

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
