"""A compiled region that could not be modelled as Inductor runs it (``compiled.py``) runs
eagerly: what the trace's notes say of it, from its first call's figures (:func:`call_figures`:
the eager temporaries' peak, and its outputs only), which bound what the region holds at its end.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vramledger.inputs.sources import tensor_leaves
from vramledger.inputs.units import format_bytes
from vramledger.record.event_totals import EventTotals
from vramledger.record.timeline import Timeline
from vramledger.trace.compile.inductor_stub import Active
from vramledger.trace.core.tracker import storages_of


def run_eagerly(
    name: str,
    reason: str,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    start: tuple[int, int, int],
) -> Any:
    """Run a region that could not be modelled eagerly; its first call's figures go into the
    notes (:func:`eager_figures`)."""
    tracker, log = Active.context[-1]
    out = fn(*args, **kwargs)
    if name not in log.eager:
        log.eager[name] = eager_figures(reason, tracker.timeline, start, (args, kwargs), out)
    return out


def eager_figures(
    reason: str, timeline: Timeline, start: tuple[int, int, int], inputs: Any, out: Any
) -> str:
    """What the notes say of a region that ran eagerly (:func:`call_figures`)."""
    eager, outputs = call_figures(timeline, start, inputs, out)
    return (
        f"{reason}; its first call allocated at most {format_bytes(eager)} at once eagerly, "
        f"{format_bytes(outputs)} counting its outputs only"
    )


def call_figures(
    timeline: Timeline, start: tuple[int, int, int], inputs: Any, out: Any
) -> tuple[int, int]:
    """The two figures of a region's call that ran eagerly, from ``start``
    (``StorageTracker.position``), its ``inputs`` and what it returned (``out``):

    - eager: the most bytes that storages made since ``start`` held at once (the eager
      temporaries' peak, outputs and tensors saved for backward included);
    - outputs only: the bytes of the storages behind the tensors it returned, those of its
      inputs (a returned view of an argument) left out. Tensors that autograd saves for the
      region's backward are not counted: compiled, the region would keep the ones its
      partitioner picks, which only compiling tells. The two figures bound what the region
      holds at its end."""
    first_event, first_sid, _ = start
    made_since = {e for e in timeline.events[first_event:] if e >= first_sid}
    peak = EventTotals(timeline, first_event).peak(
        [n if sid in made_since else 0 for sid, n in enumerate(timeline.nbytes)]
    )
    given = {st._cdata for t in tensor_leaves(inputs) for st in storages_of(t)}
    made = {st._cdata: st.nbytes() for t in tensor_leaves(out) for st in storages_of(t)}
    return peak, sum(n for key, n in made.items() if key not in given)
