"""``python -m vramledger``: the same command line as ``vramledger``."""

import sys

from .cli import main

sys.exit(main())
