"""The tracker's twin folds: where autograd, given tensor subclasses or a dispatch mode, takes an
out-of-place branch whose plain twin writes in place (``plain_autograd.py``), the output's
storage is folded into its operand's, so the timeline holds the plain run's buffers. A part of
``StorageTracker`` (``tracker.py``), kept apart: it records each operator's output
(:meth:`TwinFolding._see_output`); it reads and sets the tracker's ``_twin``, ``_confirm``,
``_live``, ``_refs``, ``_shared``, ``_alive``, ``_region``, ``_plain_autograd``,
``twins_merged``, ``plain_branches`` and ``timeline``, and calls its ``_see``, ``_see_all``,
``_free``, ``_on_free`` and ``add_synthetic``.
"""

from __future__ import annotations

import weakref
from functools import partial
from typing import Any

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from vramledger.inputs.categories import Category
from vramledger.trace.core.plain_autograd import (
    CONFIRMED_TWINS,
    IN_PLACE_TWINS,
    INPUT_BUFFER_SUM,
    confirming_operator,
    plain_writes_in_place,
)
from vramledger.trace.core.plain_branches import Action

_TWIN_OPS = frozenset({INPUT_BUFFER_SUM}.union(*IN_PLACE_TWINS.values()))
"""The operators whose output may be written in place into an operand by the plain run."""


class TwinFolding:
    """Folding out-of-place autograd buffers into the plain run's in-place writes, mixed into
    ``StorageTracker``."""

    def _see_output(
        self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any
    ) -> None:
        """Register the storages of an operator's output (``StorageTracker.__torch_dispatch__``)
        as the plain run holds them: a plain branch hidden or aliased to its operand's buffer
        (``plain_branches.py``), a ``prod`` output, or a new storage whose fold into its
        operand may follow (:meth:`_note_twin`)."""
        plain = None
        if self._plain_autograd and isinstance(out, torch.Tensor):
            plain = self.plain_branches.action(func, args, out)
        if plain is Action.HIDE and out.untyped_storage()._cdata not in self._live:
            self.plain_branches.hide(out.untyped_storage())
        elif plain is Action.ALIAS and self._alias(args[0], out):
            pass
        elif isinstance(out, torch.Tensor):
            if plain is Action.PROD_OUTPUT:
                self._prod_output(out)
            else:
                twin = (
                    self._plain_autograd
                    and func in _TWIN_OPS
                    and plain_writes_in_place(func, args, out)
                )
                confirm = (
                    confirming_operator(func, args, kwargs, out)
                    if self._plain_autograd and not twin and func in CONFIRMED_TWINS
                    else None
                )
                first_event = len(self.timeline.events)
                self._see(out)
                if twin or confirm is not None:
                    self._note_twin(args[0], out, first_event, confirm)
        elif isinstance(out, (tuple, list)):
            self._see_all(out)

    def _note_twin(
        self, operand: torch.Tensor, out: torch.Tensor, event: int, confirm: Any = None
    ) -> None:
        """Remember a call whose plain twin writes ``out`` into ``operand``
        (``plain_autograd.plain_writes_in_place``), if ``out`` was a new storage. ``confirm``:
        the operator that must run next, on ``out``, for the fold to hold
        (``plain_autograd.CONFIRMED_TWINS``)."""
        tl = self.timeline
        if is_traceable_wrapper_subclass(operand) or is_traceable_wrapper_subclass(out):
            return
        operand_key = operand.untyped_storage()._cdata
        out_key = out.untyped_storage()._cdata
        out_sid = tl.num_storages - 1
        if (
            operand_key in self._live
            and self._live.get(out_key) == out_sid
            and event < len(tl.events)
            and tl.events[event] == out_sid
        ):
            self._twin = (operand_key, out_key, out_sid, event, confirm)

    def _alias(self, operand: torch.Tensor, out: torch.Tensor) -> bool:
        """``out`` is written into ``operand``'s buffer in a plain run (a chain link,
        ``plain_autograd.CHAINS``): both storages stand for one buffer, freed with the last."""
        if is_traceable_wrapper_subclass(operand) or is_traceable_wrapper_subclass(out):
            return False
        sid = self._live.get(operand.untyped_storage()._cdata)
        st = out.untyped_storage()
        key = st._cdata
        if sid is None or key in self._live:
            return False
        self._live[key] = sid
        self._refs[key] = weakref.ref(st, partial(self._on_free, key))
        self._shared[sid] = self._shared.get(sid, 1) + 1
        return True

    def _prod_output(self, out: torch.Tensor) -> None:
        """``prod_backward``'s result, recorded between the buffers of the plain no-zero
        branch (``plain_branches.ProdPlainBranch``): the mask and the per-slice zero counts
        (locals), the scalar total (a temporary), the quotient ``result / input``."""
        branch = self.plain_branches.prod
        assert branch is not None
        label = "prod backward, no-zero branch: "
        temporaries = Category.TEMPORARIES
        mask = self.add_synthetic(branch.mask_bytes, label + "input == 0", temporaries)
        if not branch.mask_lives_to_return:  # (input == 0).nonzero(): the mask is a temporary
            self._free(mask)
        counts = None
        if branch.count_bytes:
            counts = self.add_synthetic(branch.count_bytes, label + "zero counts", temporaries)
            total = self.add_synthetic(branch.total_bytes, label + "total zeros", temporaries)
            self._free(total)
        quotient = self.add_synthetic(branch.quotient_bytes, label + "result / input", temporaries)
        self._see(out)
        self._free(quotient)
        if counts is not None:
            self._free(counts)
        if branch.mask_lives_to_return:
            self._free(mask)

    def _merge_twin(self) -> None:
        """The operand of the last call died at once: the plain run wrote the output into it.
        The output's storage becomes the operand's (one sid, never freed here) and the output's
        own allocation is taken back out of the timeline."""
        operand_key, out_key, out_sid, event, _ = self._twin  # type: ignore[misc]
        self._twin = None
        operand_sid = self._live.pop(operand_key)
        self._refs.pop(operand_key, None)
        self._fold(out_key, out_sid, event, operand_sid)

    def _confirm_twin(self, func: Any, args: tuple[Any, ...]) -> None:
        """The operator after a twin that waits for confirmation: when it is the confirming
        operator, run on the twin's output, and nothing but the operand's free was recorded
        since, the plain run wrote the output into the operand: the operand's free is taken
        back out and the output folded into it as ``_merge_twin`` does."""
        _, out_key, out_sid, event, confirm, operand_sid, free_event = self._confirm  # type: ignore[misc]
        self._confirm = None
        tl = self.timeline
        if (
            func is not confirm
            or not args
            or not isinstance(args[0], torch.Tensor)
            or args[0].untyped_storage()._cdata != out_key
            or self._live.get(out_key) != out_sid
            or tl.num_storages - 1 != out_sid
            or free_event != len(tl.events) - 1
            or tl.events[free_event] != ~operand_sid
            or (tl.marks and tl.marks[-1][0] > event)
        ):
            return
        del tl.events[free_event]
        del tl.event_block[free_event]
        self._alive.add(operand_sid)
        self._fold(out_key, out_sid, event, operand_sid)

    def _fold(self, out_key: int, out_sid: int, event: int, operand_sid: int) -> None:
        """``out``'s storage becomes ``operand_sid`` and its allocation leaves the timeline."""
        tl = self.timeline
        del tl.events[event]
        del tl.event_block[event]
        for column in (
            tl.nbytes,
            tl.tags,
            tl.on_host,
            tl.module,
            tl.recomputed,
            tl.op,
            tl.origin,
            tl.block,
        ):
            column.pop()
        tl.labels.pop(out_sid, None)
        self._alive.discard(out_sid)
        if self._region and self._region[-1] == out_sid:
            self._region.pop()
        self._live[out_key] = operand_sid
        self.twins_merged += 1
