"""The tracker's storage resizes: ``UntypedStorage.resize_`` frees or allocates memory without an
operator (FSDP2 frees and remakes its unsharded parameters so), so the tracker patches it while
it is active and records the old size's free and the new size's allocation. A part of
``StorageTracker`` (``tracker.py``), kept apart: it reads and sets the tracker's
``_original_resize``, ``_live``, ``_refs``, ``_twin``, ``_closed``, ``_blocks``, ``_block``,
``_resize_category`` and ``timeline``, and calls its ``_new``, ``_free`` and ``_on_free``.
"""

from __future__ import annotations

import weakref
from functools import partial
from typing import Any

import torch


class StorageResizes:
    """Recording ``UntypedStorage.resize_``, mixed into ``StorageTracker``."""

    def _patch_resize(self) -> None:
        """Send ``UntypedStorage.resize_`` to :meth:`_resize` (once, until
        :meth:`_restore_resize`)."""
        if self._original_resize is None:
            self._original_resize = torch.UntypedStorage.resize_
            tracker = self

            def resize_(storage: torch.UntypedStorage, size: int) -> Any:
                return tracker._resize(storage, size)

            torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign]

    def _restore_resize(self) -> None:
        if self._original_resize is not None:
            torch.UntypedStorage.resize_ = self._original_resize  # type: ignore[method-assign]
            self._original_resize = None

    def _resize(self, storage: torch.UntypedStorage, size: int) -> Any:
        """``UntypedStorage.resize_`` frees or allocates memory without an operator (FSDP2)."""
        self._twin = None
        result = self._original_resize(storage, size)
        if self._closed:
            return result
        key = storage._cdata
        old = self._live.get(key)
        if old is not None:
            if self.timeline.nbytes[old] == storage.nbytes():
                return result
            self._free(old)
            del self._live[key]
        if storage.nbytes() > 0:
            sid = self._new(storage.nbytes(), self._block if self._blocks else None)
            if old is not None:
                self.timeline.tags[sid] = self.timeline.tags[old]
                self.timeline.on_host[sid] = self.timeline.on_host[old]
            elif self._resize_category is not None:
                self.timeline.tag(sid, self._resize_category)
            self._live[key] = sid
            if key not in self._refs:
                self._refs[key] = weakref.ref(storage, partial(self._on_free, key))
        return result
