"""Libraries' import-time log messages that concern no user of vramledger.

torchao logs every GPU kernel library it cannot load on a machine without CUDA ("Failed to load
..._C_mxfp8...so"), torch's pytree registry warns about its own enum registrations, bitsandbytes
about missing CUDA; none of it changes an answer. The CLI (unless ``--debug``) and the
planner's worker processes raise these loggers to ERROR before importing them.
"""

from __future__ import annotations

import logging

IMPORT_CHATTER_LOGGERS = (
    "torchao",
    "bitsandbytes",
    "torch._dynamo",
    "torch._inductor",
    "torch.utils._pytree",
)


def quiet_import_chatter() -> None:
    for name in IMPORT_CHATTER_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
