from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

try:
    __version__ = version("vramledger")
except PackageNotFoundError:  # running from a source tree without installing
    __version__ = "0.0.0+unknown"

PACKAGE_DIR = Path(__file__).resolve().parent.parent
"""vramledger's own source folder (``src/vramledger``): its frames, its files and its data tables
are found from here."""
