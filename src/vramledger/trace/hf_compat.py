"""Where Hugging Face code branches on fake tensors differently from a real run.

transformers treats a ``FakeTensor`` like a graph being compiled (``is_tracing``) and then
skips checks that need tensor values, taking the safe, general path. One of those changes
memory: ``masking_utils.find_packed_sequence_indices`` cannot tell whether the batch packs
several sequences per row, so it returns a packed-sequence map, and the model then builds a
full attention mask (and on CUDA the mask rules out flash attention). A real run on an ordinary
batch finds no packing and uses ``is_causal`` with no mask. During a trace this module runs the
real check (its tensors are allocated as in a real run) and answers its final, value-dependent
question as an ordinary batch does — no packed sequences — and says so in the notes.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

ASSUMPTION = "assumed batches do not pack several sequences per row (transformers' packed-sequence check needs values)"


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
