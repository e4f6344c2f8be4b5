"""Activation checkpointing: Hugging Face models through their own switch; any model by class name.

Both use non-reentrant ``torch.utils.checkpoint`` (PyTorch's recommended mode). For a class
name, each matching submodule's class is swapped for a subclass whose ``__call__`` runs the
original ``__call__`` under checkpoint, so module names, ``isinstance`` and hooks are unchanged
and the recomputation runs the module's own hooks again (the tracer uses that to tell
recomputed activations from temporaries).
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn
from torch.utils.checkpoint import checkpoint

from vramledger.inputs.errors import InputError


def enable_hf_checkpointing(model: nn.Module) -> None:
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise InputError(
            f"{type(model).__name__} does not support Hugging Face gradient checkpointing",
            hint="name the blocks to checkpoint with --checkpoint-modules CLASSNAME",
        )
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


_CHECKPOINTED: dict[type, type] = {}


def _checkpointed_class(cls: type[nn.Module]) -> type[nn.Module]:
    if cls not in _CHECKPOINTED:
        base_call = cls.__call__

        def __call__(self, *args, **kwargs):
            return checkpoint(base_call, self, *args, use_reentrant=False, **kwargs)

        _CHECKPOINTED[cls] = type(f"Checkpointed{cls.__name__}", (cls,), {"__call__": __call__})
    return _CHECKPOINTED[cls]


def checkpoint_modules(model: nn.Module, class_names: Iterable[str]) -> int:
    """Checkpoint every submodule whose class name is in ``class_names``; returns how many."""
    wanted = set(class_names)
    present = {type(m).__name__ for m in model.modules()}
    missing = wanted - present
    if missing:
        raise InputError(
            f"no submodule of class {', '.join(sorted(missing))} in {type(model).__name__}",
            hint=f"classes present: {', '.join(sorted(present)[:20])}",
        )
    count = 0
    for module in model.modules():
        if type(module).__name__ in wanted:
            module.__class__ = _checkpointed_class(type(module))
            count += 1
    return count
