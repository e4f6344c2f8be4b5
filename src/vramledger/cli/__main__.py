"""``python -m vramledger.cli``: the command line without the answer cache (``cli.main``)."""

import sys

from vramledger.cli import main

sys.exit(main())
