"""The tracker's module attribution: each storage names the module that allocated it. In a
forward (or its recomputation under activation checkpointing) the innermost module running
(global module hooks, as ``torch.distributed._tools.mod_tracker`` does); in backward the module
whose forward made the autograd node running (``backward_modules.py``). It also remembers which
module an escaping exception came from. A part of ``StorageTracker`` (``tracker.py``), kept
apart: it reads and sets the tracker's ``_module_stack``, ``_module_names``,
``_recompute_depth``, ``_region``, ``_backward_modules``, ``failure``, ``_module_failure`` and
``phase``.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from vramledger.inputs.categories import Phase


def identity(exc: BaseException) -> tuple[int, str]:
    return id(exc), f"{type(exc).__name__}: {exc}"


class ModuleAttribution:
    """Module attribution, mixed into ``StorageTracker``."""

    def _allocating_module(self) -> tuple[str | None, bool]:
        """(module, recomputed) of an allocation now: in a forward (or its recomputation under
        activation checkpointing) the innermost module running; in backward the module whose
        forward made the autograd node running (``backward_modules.py``)."""
        stack = self._module_stack
        if self._recompute_depth is not None:
            return (stack[-1] if stack else None), True
        in_backward, module = self._backward_modules.running()
        if in_backward:
            return module, False
        return (stack[-1] if stack else None), False

    def _pre_forward(self, module: torch.nn.Module, _args: Any) -> None:
        name = self._module_names.get(id(module))
        if name is None and self._module_stack:
            name = self._module_stack[-1]
        if self.phase is Phase.BACKWARD and self._recompute_depth is None:
            # A module runs forward inside backward: activation checkpointing recomputes it.
            self._recompute_depth = len(self._module_stack)
            self._region = []
        self._module_stack.append(name)
        self._backward_modules.own(module, name)
        self._backward_modules.enter(name)

    @property
    def current_module(self) -> str | None:
        return self._module_stack[-1] if self._module_stack else None

    def _note_failure(self, exc: BaseException) -> None:
        """An operator raised ``exc``: remember the module running (forward or backward)."""
        module = self.current_module or self._backward_modules.running()[1]
        self.failure = (identity(exc), module or "")

    def module_of(self, exc: BaseException) -> str | None:
        """The module an escaping exception came from, if an operator or module raised it."""
        chain = {identity(e) for e in (exc, exc.__cause__, exc.__context__) if e is not None}
        for known in (self.failure, self._module_failure):
            if known is not None and known[0] in chain:
                return known[1]
        return None

    def _post_forward(self, _module: torch.nn.Module, _args: Any, _out: Any) -> None:
        if self._module_stack:
            name = self._module_stack.pop()
            exc = sys.exc_info()[1]
            if exc is not None:
                key = identity(exc)
                if self._module_failure is None or self._module_failure[0] != key:
                    self._module_failure = (key, name or "")
            del exc
            self._backward_modules.enter(self.current_module)

        if self._recompute_depth is not None and len(self._module_stack) == self._recompute_depth:
            self._recompute_depth = None
            self._end_region()
