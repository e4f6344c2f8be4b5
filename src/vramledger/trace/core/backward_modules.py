"""Which module a backward allocation belongs to: the module whose forward made the autograd
node that is running.

PyTorch's ``torch/distributed/_tools/mod_tracker.py`` (``ModTracker``) follows modules into
backward with ``register_multi_grad_hook``: a hook on each module's outputs says its backward
began, one on its inputs that it ended. Used here that would change what is measured, which a
tracker must not do: in its ``"all"`` mode the hook keeps each input's gradient (in its
``buffer``) until the gradients of every input have been computed, so a module with several
inputs that need gradients holds the first ones longer than a plain run (a toy step of Linear
layers, a module of two inputs whose gradients arrive far apart, under this tracker on real CPU
tensors: its peak 512 KiB higher with ``ModTracker`` active, the size of one such gradient); and
its ``parents`` is a set, with no innermost module to name (and a module whose inputs need no
gradient, under LoRA or a frozen embedding, never says its backward ended).

Here nothing is registered on the autograd graph. Autograd numbers its nodes in the order the
forward makes them (``Node._sequence_nr()``, a per-thread counter whose next value is
``torch.autograd._get_sequence_nr()``). The tracker's module hooks, already there for forward
attribution, note at each module boundary where the numbers of the module now running begin;
in backward the node running (``torch._C._current_autograd_node()``) names its module by its
number. The counter is read, never moved, and no tensor is held: forward and backward run as
they would without the tracker.

- A node made outside every module (the loss computed after the model) names no module.
- ``AccumulateGrad`` nodes have no number (``_UNNUMBERED``): the parameter they accumulate into
  names the module that owns it, so what runs in them (the gradient's first copy, the
  post-accumulate hooks of DDP's and FSDP's buckets) belongs to that module.
- Activation checkpointing's recomputation runs the module hooks again inside backward: the
  tracker attributes what it allocates to the module recomputed (``Timeline.recomputed``), and
  the nodes it makes are numbered as a forward's (reentrant checkpointing runs them).
- Numbers are per thread: only module boundaries on the thread that made the tracker are noted.
  A backward that autograd runs on a device thread (real CUDA runs) executes nodes the forward
  numbered on the tracker's thread, and finds them; nodes that reentrant checkpointing
  recomputes on that device thread are numbered there and name no module. Fake traces run
  backward on the tracker's thread.
"""

from __future__ import annotations

import bisect
import threading
import weakref

import torch
from torch.utils.weak import WeakIdKeyDictionary

_UNNUMBERED = 2**64 - 1
"""``Node::sequence_nr()`` of nodes autograd makes outside the forward's count (``UINT64_MAX``:
``AccumulateGrad``, ``torch/csrc/autograd/functions/accumulate_grad.cpp``)."""


class BackwardModules:
    """Module spans by autograd sequence number, and the module of the node running."""

    def __init__(self) -> None:
        self._thread = threading.get_ident()
        self._starts: list[int] = []
        """Sequence number where each span begins (non-decreasing)."""
        self._modules: list[str | None] = []
        """Module whose forward makes the nodes of each span."""
        self._owners: WeakIdKeyDictionary = WeakIdKeyDictionary()
        """Parameter -> name of the module that holds it."""
        self._seen: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()
        """The modules whose parameters are in ``_owners``."""

    def bind(self) -> None:
        """Note module boundaries on the calling thread (the one that runs the forwards)."""
        self._thread = threading.get_ident()

    def enter(self, module: str | None) -> None:
        """``module`` runs from now on (a module's forward began, or ended and its caller's
        resumes)."""
        if torch.compiler.is_compiling() or threading.get_ident() != self._thread:
            return
        seq = torch.autograd._get_sequence_nr()
        if self._starts and self._starts[-1] == seq:
            self._modules[-1] = module  # no node was made in the span just ended
        else:
            self._starts.append(seq)
            self._modules.append(module)

    def own(self, module: torch.nn.Module, name: str | None) -> None:
        """Note ``module``'s own parameters as ``name``'s (once per module)."""
        if torch.compiler.is_compiling() or module in self._seen:
            return
        self._seen.add(module)
        for p in module.parameters(recurse=False):
            if p not in self._owners:
                self._owners[p] = name

    def running(self) -> tuple[bool, str | None]:
        """(whether an autograd node is running, the module it belongs to)."""
        node = torch._C._current_autograd_node()
        if node is None:
            return False, None
        seq = node._sequence_nr()
        if seq == _UNNUMBERED:
            variable = getattr(node, "variable", None)
            return True, self._owners.get(variable) if variable is not None else None
        i = bisect.bisect_right(self._starts, seq) - 1
        return True, self._modules[i] if i >= 0 else None
