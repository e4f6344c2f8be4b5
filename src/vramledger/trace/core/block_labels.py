"""The tracker's block labels (``trace/core/blocks.py``): every event says which of the model's
repeated blocks it belongs to, so a trace at a few blocks can be extended to many.

In forward and backward an event belongs to the block running (module hooks, and in backward a
gradient hook on each block's inputs and outputs); in other phases to the block of the tensor it
concerns (a parameter's, or an operator's corresponding input). A part of ``StorageTracker``
(``tracker.py``), kept apart: it reads and sets the tracker's ``_blocks``, ``_tensor_blocks``,
``_block``, ``_block_stack``, ``_inherit``, ``_backward_end_pending``, ``_live``,
``_hook_handles``, ``phase`` and ``timeline``.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import partial
from typing import Any

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from vramledger.inputs.categories import Phase

TIMED_PHASES = (Phase.FORWARD, Phase.BACKWARD)
"""The phases whose events belong to the block running, not to the block of their tensors."""


def _grad_tensors(obj: Any) -> Iterable[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        if obj.requires_grad:
            yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _grad_tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _grad_tensors(v)


class BlockLabels:
    """Block labelling, mixed into ``StorageTracker``."""

    def _block_for(self, t: torch.Tensor, index: int) -> int | None:
        """Forward and backward: the block running now. Other phases: the block of the tensor
        (a parameter's), or of the operator's corresponding input."""
        if not self._blocks:
            return None
        if self.phase in TIMED_PHASES:
            return self._block
        known = self._tensor_blocks.get(id(t))
        if known is not None:
            return known
        inherit = self._inherit
        if isinstance(inherit, list):
            return inherit[index] if index < len(inherit) else None
        return inherit

    def _storage_block(self, t: Any) -> int | None:
        if not isinstance(t, torch.Tensor):
            return None
        sid = (
            self._live.get(t.untyped_storage()._cdata)
            if not is_traceable_wrapper_subclass(t)
            else None
        )
        return self.timeline.block[sid] if sid is not None else self._tensor_blocks.get(id(t))

    def _inherited_blocks(self, args: tuple[Any, ...], out: Any) -> Any:
        first = args[0] if args else None
        if (
            isinstance(out, (list, tuple))
            and isinstance(first, (list, tuple))
            and len(first) == len(out)
        ):
            return [self._storage_block(t) for t in first]  # foreach: output i from input i
        for a in args:
            for t in a if isinstance(a, (list, tuple)) else (a,):
                block = self._storage_block(t)
                if block is not None:
                    return block
        return None

    def _block_pre_forward(self, module: torch.nn.Module, args: Any, kwargs: Any) -> None:
        k = self._blocks[id(module)]
        self._block_stack.append(self._block)
        self._block = k
        if self.phase is Phase.FORWARD:
            for t in _grad_tensors((args, kwargs)):
                t.register_hook(partial(self._block_backward, k - 1 if k > 0 else None))

    def _block_post_forward(self, module: torch.nn.Module, _args: Any, out: Any) -> None:
        k = self._blocks[id(module)]
        self._block = self._block_stack.pop() if self._block_stack else None
        if self.phase is Phase.FORWARD:
            for t in _grad_tensors(out):
                t.register_hook(partial(self._block_backward, k))

    def _block_backward(self, k: int | None, _grad: torch.Tensor) -> None:
        self._block = k
        if self._backward_end_pending:
            # The first block hook of a backward runs in its outermost graph task: when that
            # task ends, no block runs. Block 0's input hook says so only when the input needs a
            # gradient; under LoRA, QLoRA or a frozen embedding it does not, and the release of
            # the graph after backward (saved tensors of every block) would be labelled block 0.
            self._backward_end_pending = False
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_done)

    def _backward_done(self) -> None:
        self._block = None

    def block_of(self, t: Any) -> int | None:
        """The block label of the storage behind ``t`` (inside a wrapper subclass, its first
        plain tensor's)."""
        while isinstance(t, torch.Tensor) and is_traceable_wrapper_subclass(t):
            attrs, _ = t.__tensor_flatten__()
            if not attrs:
                return None
            t = getattr(t, attrs[0])
        return self._storage_block(t)

    def set_blocks(self, blocks: list[torch.nn.Module]) -> None:
        """Label events with ``blocks``' indices from now on (a program's model, whose blocks
        are known once it is built: ``trace/program/program_blocks.py``), as the ``blocks`` and
        ``tensor_blocks`` arguments do from the start."""
        self._blocks = {id(b): k for k, b in enumerate(blocks)}
        self._tensor_blocks = {id(p): k for k, b in enumerate(blocks) for p in b.parameters()}
        self.label_blocks(blocks)

    def label_blocks(self, modules: Iterable[torch.nn.Module]) -> None:
        """Hook the repeated blocks so every event is labelled with its block index."""
        for module in modules:
            self._hook_handles.append(  # before any other hook (FSDP's all-gather is the block's)
                module.register_forward_pre_hook(
                    self._block_pre_forward, with_kwargs=True, prepend=True
                )
            )
            self._hook_handles.append(
                module.register_forward_hook(self._block_post_forward, always_call=True)
            )
