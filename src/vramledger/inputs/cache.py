"""The on-disk cache: what vramledger computed once (traces, answers), kept for the next question.

Entries live in the user's cache directory (``platformdirs``; ``VRAMLEDGER_CACHE_DIR`` moves it,
as the tests do), one folder per kind (``traces``, ``answers``) and per :func:`fingerprint`, the
versions of everything that changes a trace. An entry is found by the hash of its key and
holds the key itself and the fingerprint in its header: a lookup whose key or fingerprint
differs from the stored one (another version, a hash collision) is a miss and the entry is
deleted, so an entry made by another version is never used. Entries are zlib-compressed JSON
(never pickle: loading one runs no code), written to a temporary file and renamed, so a reader
never sees half an entry and parallel writers (the planner's workers) do not clash. The total
is kept under :data:`MAX_CACHE_BYTES` by deleting the least recently used entries (a hit
refreshes its entry's modification time).

This module imports no heavy package: the command line's answer cache (``answer_cache.py``)
answers a repeated question from it before torch is imported.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
import tempfile
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from vramledger.inputs.version import PACKAGE_DIR, __version__

CACHE_DIR_VARIABLE = "VRAMLEDGER_CACHE_DIR"
"""Environment variable naming the cache's folder (default: the user's cache directory)."""
NO_CACHE_VARIABLE = "VRAMLEDGER_NO_CACHE"
"""Environment variable that turns the cache off when set to ``1`` (``--no-cache`` sets it, so
that the planner's worker processes, which inherit the environment, skip it too)."""
MAX_CACHE_BYTES = 2 * 1024**3
"""The cache's bound, 2 GiB: a Llama-3-70B trace (80 blocks, ~300k events) takes about 2 MiB
compressed and a plan makes a few dozen, so this keeps the traces of tens of 70B plans; small
beside the model caches of the Hugging Face hub that sit in the same directory."""
FORMAT = 1
"""Version of the entry layout; part of every fingerprint."""
VERSIONED_PACKAGES = (
    "torch",
    "transformers",
    "peft",
    "bitsandbytes",
    "torchao",
    "deepspeed",
    "accelerate",
)
"""Packages whose code runs in a trace: another version of any of them can change it."""
KINDS = ("traces", "answers")
SUFFIX = ".entry"


def cache_dir() -> Path:
    """The cache's folder: ``VRAMLEDGER_CACHE_DIR``, else the user's cache directory."""
    chosen = os.environ.get(CACHE_DIR_VARIABLE)
    if chosen:
        return Path(chosen)
    import platformdirs

    return Path(platformdirs.user_cache_dir("vramledger"))


def enabled() -> bool:
    """Whether the cache is used (not turned off with ``VRAMLEDGER_NO_CACHE=1``)."""
    return os.environ.get(NO_CACHE_VARIABLE, "") != "1"


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """The cache off inside the ``with`` block (library callers' ``--no-cache``)."""
    saved = os.environ.get(NO_CACHE_VARIABLE)
    os.environ[NO_CACHE_VARIABLE] = "1"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(NO_CACHE_VARIABLE, None)
        else:
            os.environ[NO_CACHE_VARIABLE] = saved


@cache
def fingerprint() -> str:
    """The versions a cached entry must have been made with: the entry layout, Python, each of
    :data:`VERSIONED_PACKAGES` (None where not installed), vramledger's version and a hash of its
    own files (a development checkout changes code without changing its version)."""
    from importlib import metadata

    versions: dict[str, str | None] = {}
    for name in VERSIONED_PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    parts = {
        "format": FORMAT,
        "python": list(sys.version_info[:3]),
        "packages": versions,
        "vramledger": __version__,
        "source": source_hash(),
    }
    return digest(parts)[:24]


def source_hash() -> str:
    """Hash of vramledger's own files (code and data tables), path by path."""
    package = PACKAGE_DIR
    h = hashlib.sha256()
    for path in sorted(package.rglob("*")):
        if path.is_file() and path.suffix in (".py", ".json"):
            h.update(str(path.relative_to(package)).encode())
            h.update(path.read_bytes())
    return h.hexdigest()


def canonical(value: Any) -> str:
    """``value`` (JSON-ready) as one canonical string."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def digest(value: Any) -> str:
    return hashlib.sha256(canonical(value).encode()).hexdigest()


SMALL_FILE_BYTES = 16 * 1024**2
"""Files up to this size are fingerprinted by their content; larger ones (checkpoint weights a
folder may hold) by size and modification time, which any rewrite changes."""


def path_fingerprint(path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """What a file or folder named in a question holds: its absolute path and the hash of its
    contents (a folder's: each file's, by relative path); None when it does not exist."""
    p = Path(path)
    if not p.exists():
        return None
    h = hashlib.sha256()
    files = [p] if p.is_file() else sorted(f for f in p.rglob("*") if f.is_file())
    for f in files:
        h.update(str(f.relative_to(p) if f != p else f.name).encode())
        stat = f.stat()
        if stat.st_size <= SMALL_FILE_BYTES:
            h.update(f.read_bytes())
        else:
            h.update(f"{stat.st_size}:{stat.st_mtime_ns}".encode())
    return {"path": str(p.resolve()), "hash": h.hexdigest()}


@dataclass(frozen=True)
class Store:
    """One kind of entry (``traces``, ``answers``) under the cache's folder."""

    kind: str

    def _path(self, key: Any) -> Path:
        return cache_dir() / self.kind / fingerprint() / (digest(key) + SUFFIX)

    def get(self, key: Any) -> Any | None:
        """The value stored under ``key`` by this version, or None."""
        if not enabled():
            return None
        path = self._path(key)
        try:
            raw = zlib.decompress(path.read_bytes())
            header, _, body = raw.partition(b"\n")
            meta = json.loads(header)
            if meta.get("fingerprint") != fingerprint() or meta.get("key") != canonical(key):
                path.unlink(missing_ok=True)  # never used: another version, or a collision
                return None
            value = json.loads(body)
            os.utime(path)  # most recently used
        except FileNotFoundError:
            return None
        except (OSError, ValueError, zlib.error):
            with contextlib.suppress(OSError):
                path.unlink(missing_ok=True)  # unreadable: made again
            return None
        return value

    def put(self, key: Any, value: Any) -> None:
        """Store ``value`` (JSON-ready) under ``key``, then keep the cache within its bound. A
        cache that cannot be written is skipped: the answer stands without it."""
        if not enabled():
            return
        path = self._path(key)
        header = canonical({"fingerprint": fingerprint(), "key": canonical(key)})
        body = json.dumps(value, separators=(",", ":"))
        data = zlib.compress((header + "\n" + body).encode(), level=1)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
            with os.fdopen(fd, "wb") as out:
                out.write(data)
            os.replace(tmp, path)
        except OSError:
            return
        evict()


def _entries() -> list[tuple[float, int, Path]]:
    """(last use, bytes, path) of every entry, every kind and version."""
    out = []
    root = cache_dir()
    for kind in KINDS:
        for path in (root / kind).glob(f"*/*{SUFFIX}"):
            with contextlib.suppress(OSError):
                stat = path.stat()
                out.append((stat.st_mtime, stat.st_size, path))
    return out


def evict(limit: int = MAX_CACHE_BYTES) -> int:
    """Delete the least recently used entries until the cache holds at most ``limit`` bytes;
    the number deleted."""
    entries = sorted(_entries())
    total = sum(size for _, size, _ in entries)
    deleted = 0
    for _, size, path in entries:
        if total <= limit:
            break
        with contextlib.suppress(OSError):
            path.unlink()
            deleted += 1
        total -= size
    return deleted


def info() -> dict[str, Any]:
    """Where the cache is, what it holds (per kind: entries and bytes; of those, made by this
    version), and its bound."""
    current = fingerprint()
    kinds: dict[str, dict[str, int]] = {}
    for kind in KINDS:
        paths = list((cache_dir() / kind).glob(f"*/*{SUFFIX}"))
        sizes = [(p.parent.name == current, p.stat().st_size) for p in paths if p.exists()]
        kinds[kind] = {
            "entries": len(sizes),
            "bytes": sum(s for _, s in sizes),
            "entries_this_version": sum(1 for now, _ in sizes if now),
        }
    return {
        "path": str(cache_dir()),
        "enabled": enabled(),
        "fingerprint": current,
        "max_bytes": MAX_CACHE_BYTES,
        "bytes": sum(k["bytes"] for k in kinds.values()),
        "kinds": kinds,
    }


def clear() -> int:
    """Delete every entry (every kind and version); the number deleted."""
    deleted = 0
    for _, _, path in _entries():
        with contextlib.suppress(OSError):
            path.unlink()
            deleted += 1
    root = cache_dir()
    for kind in KINDS:  # empty version folders
        for folder in (root / kind).glob("*"):
            with contextlib.suppress(OSError):
                folder.rmdir()
    return deleted
