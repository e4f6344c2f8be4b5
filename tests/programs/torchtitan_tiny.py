"""What torchtitan's debug model reads, made in a folder, for `-m torchtitan.train` under
`vramledger run --nproc-per-node 2` (tests/test_run_torchtitan.py, benchmarks/programs.py):

    python tests/programs/torchtitan_tiny.py DIR

makes ``DIR/tests/assets/tokenizer`` (torchtitan's own test tokenizer, where its debug model's
config looks for it), ``DIR/tests/assets/c4_test/data.json`` (64 rows of text, where torchtitan's
``c4_test`` dataset is read from) and, for torchtitan 0.2, ``DIR/debug_model.toml`` (its
``torchtitan/models/llama3/train_configs/debug_model.toml``). The tokenizer and the config are
not in torchtitan's wheel: they are read from a source install's checkout, else from
``TORCHTITAN_SOURCE`` (a checkout, or its bare git directory read at the installed version's
tag, ``v0.2.2``, or at HEAD where the tag is absent). Nothing is downloaded. Run it there with

    torchrun --nproc-per-node 2 -m torchtitan.train --job.config_file debug_model.toml   # 0.2
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

TOKENIZER_DIR = "tests/assets/tokenizer"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
DATA_DIR = "tests/assets/c4_test"
DATA_ROWS = 64
CONFIG = "torchtitan/models/llama3/train_configs/debug_model.toml"
"""torchtitan 0.2's debug model config (0.3 names its configs in Python: ``--config``)."""
WORDS = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "was",
    "for",
    "on",
    "that",
    "with",
    "as",
    "by",
    "at",
    "from",
    "his",
    "he",
    "it",
    "an",
    "are",
]


def version() -> tuple[int, ...]:
    """The installed torchtitan's version, as numbers. Read without importing torchtitan: 0.2
    binds ``sys.argv[1:]`` as ``ConfigManager.parse_args``'s default when it is imported, so
    the program must be the first to import it."""
    return tuple(int(part) for part in importlib.metadata.version("torchtitan").split(".")[:3])


def source_file(name: str) -> bytes | None:
    """``name`` (a path in torchtitan's repository) from a source install's checkout, else from
    ``TORCHTITAN_SOURCE``; None where neither has it."""
    found = importlib.util.find_spec("torchtitan")
    if found is None or found.origin is None:
        return None
    roots = [Path(found.origin).resolve().parents[1]]
    if os.environ.get("TORCHTITAN_SOURCE"):
        roots.append(Path(os.environ["TORCHTITAN_SOURCE"]))
    for root in roots:
        if (root / name).is_file():
            return (root / name).read_bytes()
        if (root / "HEAD").is_file():  # a bare git directory
            for ref in (f"v{importlib.metadata.version('torchtitan')}", "HEAD"):
                shown = subprocess.run(
                    ["git", "--git-dir", str(root), "show", f"{ref}:{name}"],
                    capture_output=True,
                    check=False,
                )
                if shown.returncode == 0:
                    return shown.stdout
    return None


def make(folder: Path) -> str | None:
    """The tokenizer, data and (0.2) config in ``folder``; what is missing, else None."""
    names = [f"{TOKENIZER_DIR}/{n}" for n in TOKENIZER_FILES]
    if version() < (0, 3):
        names.append(CONFIG)
    for name in names:
        data = source_file(name)
        if data is None:
            return f"torchtitan's {name} is not at hand (set TORCHTITAN_SOURCE)"
        target = folder / (Path(name).name if name == CONFIG else name)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
    (folder / DATA_DIR).mkdir(parents=True, exist_ok=True)
    with open(folder / DATA_DIR / "data.json", "w") as f:
        for row in range(DATA_ROWS):
            text = " ".join(WORDS[(row * 7 + i) % len(WORDS)] for i in range(400))
            f.write(json.dumps({"text": text}) + "\n")
    return None


if __name__ == "__main__":
    missing = make(Path(sys.argv[1]))
    if missing:
        sys.exit(missing)
