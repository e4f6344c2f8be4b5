"""Module-level functions replaced while a context is active: how the trace intercepts the
functions libraries call by name (torchao's per-parameter optimizer step, which it compiles at
each call), by replacing the module attribute they look up."""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any


@contextlib.contextmanager
def patched_functions(
    targets: Iterable[tuple[str, str]], wrap: Callable[[str, str, Any], Any]
) -> Iterator[None]:
    """While active, each ``module.name`` of ``targets`` (``(module path, name)``) is
    ``wrap(module path, name, original)``; restored on exit. A module that is not installed, or
    a name it does not define (another version of the library), is left alone."""
    patched: list[tuple[Any, str, Any]] = []
    for module_name, name in targets:
        try:
            module = importlib.import_module(module_name)
        except ImportError:  # pragma: no cover - the library is not installed
            continue
        original = getattr(module, name, None)
        if original is None:  # pragma: no cover - other versions of the library
            continue
        patched.append((module, name, original))
        setattr(module, name, wrap(module_name, name, original))
    try:
        yield
    finally:
        for module, name, original in patched:
            setattr(module, name, original)
