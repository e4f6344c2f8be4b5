"""Where Hugging Face code branches on fake tensors differently from a real run.

transformers treats a ``FakeTensor`` like a graph being compiled (``is_tracing``) and then
skips checks that need tensor values, taking the safe, general path. Those checks change
memory: whether a padding mask is all ones decides between ``is_causal`` and a full 4-D mask
(which on CUDA also rules out flash attention), and ``masking_utils.find_packed_sequence_indices``
decides whether the batch packs several sequences per row.

Values computed from the batch alone are known during a trace (``values.py``), so
:func:`hf_known_values` tells transformers that a fake tensor with known values is not being
traced: its checks read the real values and take the branch the real run takes. Where the values
are not known, :func:`ordinary_batches` runs the packed-sequence check (its tensors are allocated
as in a real run) and answers its final question as an ordinary batch does — no packed
sequences — and says so in the notes.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import Any

from vramledger.inputs.notes import Note, Topic
from vramledger.trace.core.values import KnownValues


@contextlib.contextmanager
def hf_known_values(values: KnownValues) -> Iterator[None]:
    """transformers' ``is_tracing(tensor)`` is False for fake tensors whose values are known."""
    with hf_known_values_once_imported(values) as install:
        install()
        yield


@contextlib.contextmanager
def hf_known_values_once_imported(values: KnownValues) -> Iterator[Callable[[], None]]:
    """:func:`hf_known_values` for a program that imports transformers after the trace
    begins: yields ``install``, which applies it if transformers is imported by then (and
    only once); called at each forward the program starts. Restored on exit.

    Seen with TRL's SFTTrainer (a Llama, no padding): without it, the trace built the 4-D
    causal mask (``sdpa_mask``: ``_ignore_causal_mask_sdpa`` returns False for a fake
    ``padding_mask``) and kept it for the backward, 4,802 bytes the real run never makes."""
    patched: list[tuple[Any, Callable[[Any], bool]]] = []

    def install() -> None:
        if patched:
            return
        utils = sys.modules.get("transformers.utils.import_utils")
        original = getattr(utils, "is_fake_tensor", None)
        if original is None:
            return

        def is_fake_tensor(x) -> bool:
            return original(x) and not values.known(x)

        utils.is_fake_tensor = is_fake_tensor
        patched.append((utils, original))

    try:
        yield install
    finally:
        for utils, original in patched:
            utils.is_fake_tensor = original


ASSUMPTION = Note(
    Topic.VALUES,
    "assumed batches do not pack several sequences per row (transformers' packed-sequence check "
    "needs values)",
)


@contextlib.contextmanager
def ordinary_batches(notes: list[str]) -> Iterator[None]:
    masking = sys.modules.get("transformers.masking_utils")
    original = getattr(masking, "find_packed_sequence_indices", None)
    if original is None:
        yield
        return

    from torch._subclasses.fake_tensor import DataDependentOutputException

    def eager_check(position_ids):
        if ASSUMPTION not in notes:
            notes.append(ASSUMPTION)
        saved = masking.is_tracing
        masking.is_tracing = lambda tensor=None: False
        try:
            return original(position_ids)
        except DataDependentOutputException:  # the `.all()` of the real check: not packed
            return None
        finally:
            masking.is_tracing = saved

    masking.find_packed_sequence_indices = eager_check
    try:
        yield
    finally:
        masking.find_packed_sequence_indices = original
