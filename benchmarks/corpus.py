"""Byte-level batches of a real text corpus already on every machine: the Python standard
library's own source files (no downloads). Used by benchmarks/lowbit.py as a --data function."""

from __future__ import annotations

import functools
import sysconfig
from pathlib import Path

import torch

CORPUS_BYTES = 16 * 1024**2
"""Enough text that 500 steps of 16 x 128 tokens never repeat a window (33 MB would be all)."""


@functools.cache
def corpus() -> torch.Tensor:
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.rglob("*.py")):
        if "test" in path.parts or total >= CORPUS_BYTES:
            continue
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
    return torch.frombuffer(bytearray(b"".join(chunks)[:CORPUS_BYTES]), dtype=torch.uint8).long()


def batch(step: int, device, batch_size: int = 16, seq_len: int = 128) -> dict[str, torch.Tensor]:
    """Windows of ``seq_len`` bytes at positions drawn from a generator seeded by the step."""
    text = corpus()
    g = torch.Generator().manual_seed(step)
    starts = torch.randint(0, text.numel() - seq_len - 1, (batch_size,), generator=g)
    ids = torch.stack([text[s : s + seq_len] for s in starts.tolist()]).to(device)
    return {"input_ids": ids, "labels": ids}
