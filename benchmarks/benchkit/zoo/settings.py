"""The step each zoo case measures, the sweep's settings and targets, and where results go."""

from __future__ import annotations

from pathlib import Path

HERE = Path(__file__).resolve().parents[2]
"""``benchmarks/``."""
RESULTS = HERE / "results"
ZOO_SCRIPT = HERE / "zoo.py"
"""The script the workers run (``zoo.py --_worker ...``)."""

BATCH_SIZE = 2
SEQ_LEN = 32
OPTIMIZER = "adamw"
TARGET = "cpu"
PRECISIONS = ("fp32", "bf16-mixed")
DTYPE_VARIANTS = ("none", "bfloat16")
"""``none``: the config.json declares no dtype; ``bfloat16``: it declares ``"dtype": "bfloat16"``."""
WITHIN = 0.005
"""A run is accurate when |error| <= 0.5 %."""
TARGET_ESTIMATED = 0.95
TARGET_WITHIN = 0.90

WORKERS = 2
THREADS_PER_WORKER = 1
RUN_TIMEOUT_S = 600
"""Longest a worker may go without reporting (building, or one estimate + measure)."""
SAMPLE_SEED = 0
MAX_PARAMETERS = 60_000_000
"""A shrunk model larger than this is not run (its real run would take too long here)."""
STDERR_TAIL = 2000
