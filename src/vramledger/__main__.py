"""``python -m vramledger``: the same command line as ``vramledger`` (a repeated question is
answered from the cache before torch is imported: ``answer_cache.py``)."""

import sys

from vramledger.answer_cache import run

sys.exit(run())
