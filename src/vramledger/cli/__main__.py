"""``python -m vramledger.cli``: the command line without the answer cache (``cli.main``)."""

import sys

from . import main

sys.exit(main())
