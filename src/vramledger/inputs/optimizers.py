"""The optimizer registry: short names and import paths to real optimizer classes.

- every ``torch.optim`` optimizer by its lower-case name (``adamw``, ``sgd``, ``rmsprop``,
  ``adafactor`` ...), and aliases for common settings (``sgd-momentum``);
- low-bit optimizers from their libraries: torchao's ``adamw8bit``, ``adamw4bit``,
  ``adamwfp8`` (and ``adam8bit`` ...), ``cpu-offload-adamw`` (torchao's CPUOffloadOptimizer);
  bitsandbytes' ``lion`` and ``lion8bit``; any class of ``torchao.optim`` as ``ao-NAME`` and of
  ``bitsandbytes.optim`` as ``bnb-NAME`` (``bnb-adamw8bit``, ``bnb-paged-adamw8bit`` ...);
  transformers' Adafactor as ``adafactor-hf``;
- any other class by import path (``package.module.Class`` or ``package.module:Class``).

Libraries are imported only when one of their optimizers is asked for.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from vramledger.inputs.compat import EXTRAS, import_tested
from vramledger.inputs.errors import InputError
from vramledger.inputs.sources import load_callable

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
# name -> (import path, default keyword arguments)
LIBRARY_OPTIMIZERS: dict[str, tuple[str, dict[str, Any]]] = {
    "adamw8bit": ("torchao.optim.AdamW8bit", {}),
    "adamw4bit": ("torchao.optim.AdamW4bit", {}),
    "adamwfp8": ("torchao.optim.AdamWFp8", {}),
    "adam8bit": ("torchao.optim.Adam8bit", {}),
    "adam4bit": ("torchao.optim.Adam4bit", {}),
    "adamfp8": ("torchao.optim.AdamFp8", {}),
    "cpu-offload-adamw": ("torchao.optim.CPUOffloadOptimizer", {}),
    "lion": ("bitsandbytes.optim.Lion", {}),
    "lion8bit": ("bitsandbytes.optim.Lion8bit", {}),
    # transformers' Adafactor takes an explicit lr only without its relative step size.
    "adafactor-hf": (
        "transformers.optimization.Adafactor",
        {"lr": 1e-3, "relative_step": False, "scale_parameter": False, "warmup_init": False},
    ),
}
PREFIXES = {"ao-": "torchao.optim", "bnb-": "bitsandbytes.optim"}


@dataclass(frozen=True, kw_only=True)
class OptimizerChoice:
    """A resolved optimizer: its class and the keyword arguments it will be built with."""

    name: str
    cls: type
    kwargs: dict[str, Any] = field(default_factory=dict)
    library: str = "torch.optim"
    builder: Any = None
    """Builds a stand-in instead of ``cls`` (a trace of an optimizer that cannot run on fake
    tensors; see trace/core/optimizer_stand_ins.py)."""
    method: str = "traced"
    """How its memory is known: 'traced', or the stand-in's description."""

    @property
    def package(self) -> str:
        """Top-level package of the optimizer class (torch, torchao, bitsandbytes ...)."""
        return self.cls.__module__.split(".")[0]

    def accepts(self, key: str) -> bool:
        params = inspect.signature(self.cls.__init__).parameters
        return key in params

    def with_defaults(self, **defaults: Any) -> OptimizerChoice:
        """These keyword arguments unless the user set them."""
        return replace(self, kwargs={**defaults, **self.kwargs})

    def with_builder(self, builder: Any, method: str) -> OptimizerChoice:
        return replace(self, builder=builder, method=method)

    def build(self, params: Iterable[torch.Tensor]) -> torch.optim.Optimizer:
        if self.builder is not None:
            return self.builder(list(params), self)
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
    return sorted(
        set(torch_optimizers()) - set(_UNSUPPORTED) | set(ALIASES) | set(LIBRARY_OPTIMIZERS)
    )


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
    if key in LIBRARY_OPTIMIZERS:
        path, defaults = LIBRARY_OPTIMIZERS[key]
        choice = _import_class(path, text)
        return OptimizerChoice(
            name=key, cls=choice.cls, kwargs=dict(defaults), library=choice.library
        )
    for prefix, module_name in PREFIXES.items():
        if key.startswith(prefix):
            return _from_module(module_name, key[len(prefix) :], text)
    if ":" in text:
        cls = load_callable(text, "optimizer")
        return OptimizerChoice(name=text, cls=cls, library=getattr(cls, "__module__", ""))
    if "." in text:
        module_name, _, attr = text.rpartition(".")
        try:
            module = import_tested(module_name)
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


def _import_module(module_name: str, asked: str) -> Any:
    try:
        return import_tested(module_name)
    except ImportError as exc:
        top = module_name.split(".")[0]
        extra = EXTRAS.get(top)
        hint = f"pip install 'vramledger[{extra}]'" if extra else f"install {top}"
        raise InputError(
            f"optimizer {asked!r} needs {top}, which is not installed", hint=hint
        ) from exc


def _import_class(path: str, asked: str) -> OptimizerChoice:
    module_name, _, attr = path.rpartition(".")
    module = _import_module(module_name, asked)
    cls = getattr(module, attr, None)
    if not inspect.isclass(cls):
        raise InputError(f"{module_name} has no optimizer class {attr!r}")
    return OptimizerChoice(name=asked, cls=cls, library=module_name)


def _from_module(module_name: str, wanted: str, asked: str) -> OptimizerChoice:
    """A class of ``module_name`` whose name matches ``wanted`` ignoring case, '-' and '_'."""
    module = _import_module(module_name, asked)
    norm = wanted.replace("-", "").replace("_", "").lower()
    classes = {
        n.lower(): getattr(module, n) for n in dir(module) if inspect.isclass(getattr(module, n))
    }
    if norm not in classes:
        raise InputError(
            f"{module_name} has no optimizer {wanted!r}",
            hint=f"it has: {', '.join(sorted(classes))}",
        )
    return OptimizerChoice(name=asked, cls=classes[norm], library=module_name)


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
