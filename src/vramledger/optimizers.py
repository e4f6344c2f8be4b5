"""The optimizer registry: short names and import paths to real optimizer classes.

Every ``torch.optim`` optimizer is available by its lower-case name (``adamw``, ``sgd``,
``rmsprop`` ...); a few aliases name common settings (``sgd-momentum``); any other class is
given as an import path (``package.module.Class`` or ``package.module:Class``).
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from .errors import InputError
from .sources import load_callable

# torch.optim classes whose ``step()`` cannot run in a plain training loop.
_UNSUPPORTED = {
    "lbfgs": "LBFGS needs a closure that re-evaluates the loss in step()",
    "sparseadam": "SparseAdam needs sparse gradients",
}

# name -> (registry name it builds on, default keyword arguments)
ALIASES: dict[str, tuple[str, dict[str, Any]]] = {
    "sgd-momentum": ("sgd", {"momentum": 0.9}),
    "sgd-nesterov": ("sgd", {"momentum": 0.9, "nesterov": True}),
}


@dataclass(frozen=True, kw_only=True)
class OptimizerChoice:
    """A resolved optimizer: its class and the keyword arguments it will be built with."""

    name: str
    cls: type
    kwargs: dict[str, Any] = field(default_factory=dict)
    library: str = "torch.optim"

    def accepts(self, key: str) -> bool:
        params = inspect.signature(self.cls.__init__).parameters
        return key in params

    def with_defaults(self, **defaults: Any) -> OptimizerChoice:
        """These keyword arguments unless the user set them."""
        merged = {**defaults, **self.kwargs}
        return OptimizerChoice(name=self.name, cls=self.cls, kwargs=merged, library=self.library)

    def build(self, params: Iterable[torch.Tensor]) -> torch.optim.Optimizer:
        try:
            return self.cls(list(params), **self.kwargs)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise InputError(
                f"{self.cls.__name__}({_kwargs_text(self.kwargs)}) failed: {exc}",
                hint="check --optimizer-kwargs",
            ) from exc


def _kwargs_text(kwargs: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in kwargs.items())


def torch_optimizers() -> dict[str, type]:
    found = {}
    for name, obj in vars(torch.optim).items():
        if (
            inspect.isclass(obj)
            and issubclass(obj, torch.optim.Optimizer)
            and obj is not torch.optim.Optimizer
        ):
            found[name.lower()] = obj
    return found


def known_names() -> list[str]:
    return sorted(set(torch_optimizers()) - set(_UNSUPPORTED) | set(ALIASES))


def resolve_optimizer(
    optimizer: str | type, kwargs: dict[str, Any] | None = None
) -> OptimizerChoice:
    """Find the optimizer class and check ``kwargs`` against its signature."""
    kwargs = dict(kwargs or {})
    if inspect.isclass(optimizer):
        choice = OptimizerChoice(
            name=optimizer.__name__, cls=optimizer, library=optimizer.__module__
        )
    else:
        choice = _resolve_name(str(optimizer))
    merged = {**choice.kwargs, **kwargs}
    _check_kwargs(choice.cls, merged)
    return OptimizerChoice(name=choice.name, cls=choice.cls, kwargs=merged, library=choice.library)


def _resolve_name(text: str) -> OptimizerChoice:
    key = text.strip().lower()
    if key in ALIASES:
        base, defaults = ALIASES[key]
        return OptimizerChoice(name=key, cls=torch_optimizers()[base], kwargs=dict(defaults))
    if key in _UNSUPPORTED:
        raise InputError(f"optimizer {text!r} is not supported: {_UNSUPPORTED[key]}")
    builtin = torch_optimizers()
    if key in builtin:
        return OptimizerChoice(name=key, cls=builtin[key])
    if ":" in text:
        cls = load_callable(text, "optimizer")
        return OptimizerChoice(name=text, cls=cls, library=getattr(cls, "__module__", ""))
    if "." in text:
        module_name, _, attr = text.rpartition(".")
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            raise InputError(
                f"cannot import {module_name!r} for optimizer {text!r}: {exc}"
            ) from exc
        cls = getattr(module, attr, None)
        if cls is None:
            raise InputError(f"{module_name} has no optimizer class {attr!r}")
        return OptimizerChoice(name=text, cls=cls, library=module_name)
    raise InputError(
        f"unknown optimizer {text!r}",
        hint=f"use one of {', '.join(known_names())}, or an import path like torch.optim.AdamW",
    )


def _check_kwargs(cls: type, kwargs: dict[str, Any]) -> None:
    try:
        params = inspect.signature(cls.__init__).parameters
    except (TypeError, ValueError):
        return
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    accepted = [n for n in params if n not in ("self", "params")]
    for key in kwargs:
        if key not in params:
            raise InputError(
                f"{cls.__name__} has no argument {key!r}",
                hint=f"it takes: {', '.join(accepted)}",
            )
