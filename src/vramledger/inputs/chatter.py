"""Libraries' log messages and warnings that concern no user of vramledger.

torchao logs every GPU kernel library it cannot load on a machine without CUDA ("Failed to load
..._C_mxfp8...so"), torch's pytree registry warns about its own enum registrations, bitsandbytes
about missing CUDA, transformers about switches the traced step sets (``use_cache`` under
checkpointing, a config's unknown ``loss_type``) and its own deprecations; none of it changes an
answer. The CLI (unless ``--debug``) and the planner's worker processes raise these loggers to
ERROR for the whole process (``quiet_import_chatter``); the Python API quiets the same loggers
and warnings only while one of its calls runs (``library_chatter_quieted``) and leaves the
caller's logging and warning filters as they were.
"""

from __future__ import annotations

import contextlib
import logging
import os
import warnings
from collections.abc import Iterator

IMPORT_CHATTER_LOGGERS = (
    "torchao",
    "bitsandbytes",
    "torch._dynamo",
    "torch._inductor",
    "torch.utils._pytree",
)

CALL_CHATTER_LOGGERS = (*IMPORT_CHATTER_LOGGERS, "transformers", "peft", "accelerate", "deepspeed")
"""Quieted while a Python API call runs: the import chatter above, and the libraries whose
advisories about the traced step reach the user's terminal (transformers' ``[transformers]``
lines)."""

TRANSFORMERS_VERBOSITY = "TRANSFORMERS_VERBOSITY"
"""transformers sets its library logger's level from this variable when it first configures
itself (``transformers/utils/logging.py: _get_default_logging_level``), which a level set
beforehand does not survive."""


def quiet_import_chatter() -> None:
    for name in IMPORT_CHATTER_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)


@contextlib.contextmanager
def library_chatter_quieted() -> Iterator[None]:
    """Inside: the chatter loggers at ERROR, warnings ignored (as the CLI does), transformers
    configured at ``error`` if it first loads here. Afterwards every level, filter and the
    environment variable are restored."""
    loggers = [logging.getLogger(name) for name in CALL_CHATTER_LOGGERS]
    levels = [lg.level for lg in loggers]
    verbosity = os.environ.get(TRANSFORMERS_VERBOSITY)
    if verbosity is None:
        os.environ[TRANSFORMERS_VERBOSITY] = "error"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for lg in loggers:
                lg.setLevel(logging.ERROR)
            yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)
        if verbosity is None:
            os.environ.pop(TRANSFORMERS_VERBOSITY, None)
