"""Code run when a package is imported: a library the program may import late (bitsandbytes,
Lightning's lazy loader, DeepSpeed) is patched as soon as its module has executed, before the
program's own code can bind its names, and not imported at all when the program never does.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.util
import sys
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any


class _OnImport(importlib.abc.MetaPathFinder):
    """Calls ``then(module)`` once ``name`` has been executed, when the program imports it."""

    def __init__(self, name: str, then: Callable[[ModuleType], None]) -> None:
        self.name = name
        self.then = then

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)  # the other finders find it; this one only waits for it
        spec = importlib.util.find_spec(fullname)
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        exec_module, then = loader.exec_module, self.then

        def exec_then(module: ModuleType) -> None:
            exec_module(module)
            then(module)

        loader.exec_module = exec_then
        return spec


@contextlib.contextmanager
def when_imported(name: str, then: Callable[[ModuleType], None]) -> Iterator[None]:
    """``then(module)`` now if ``name`` is imported, else when the program imports it."""
    finder = None
    if name in sys.modules:
        then(sys.modules[name])
    else:
        finder = _OnImport(name, then)
        sys.meta_path.insert(0, finder)
    try:
        yield
    finally:
        if finder is not None and finder in sys.meta_path:
            sys.meta_path.remove(finder)
