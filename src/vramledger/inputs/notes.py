"""Notes as records: each note an answer carries says what it is about (its :class:`Topic`),
beside its text.

A :class:`Note` is a ``str`` (its text), so every list of notes, every ``in`` and every
dedupe works on it as on the text; its ``topic`` says what the note is about, so a reader that
wants one kind of note (``fit`` keeps the kernels each answer assumed) asks by topic, never by
the note's words. JSON gives both: ``notes`` (the texts, as always) and ``note_records``
(``{"topic", "text"}`` each, :func:`records`). A note made by joining or formatting strings is
a plain ``str`` again: :func:`topic_of` says ``other`` for it, and the producer that wants a
topic makes the :class:`Note` last.
"""

from __future__ import annotations

from collections.abc import Iterable
from enum import Enum
from typing import Any


class Topic(str, Enum):
    """What a note is about (its ``topic`` in ``note_records``), in the order a report shows
    them: the device and the inputs, then what the trace ran, then what it answered."""

    TARGET = "target"
    """The device modelled: the GPU and compute capability whose behaviour the trace took, or
    the CPU."""
    INPUTS = "inputs"
    """What was read from the files and options given, and made from them: configs (DeepSpeed,
    accelerate), the precision's dtypes, the batch."""
    MODEL = "model"
    """What the model was found to be: adapters, quantized layers, parameters left in fp32."""
    KERNELS = "kernels"
    """The kernels and code paths the trace ran and rests on: the attention path and kernel,
    fused or foreach optimizer implementations, compiled regions or eager, Python CPU kernels,
    the CPU kernels' measured scratch and its thread count, library workspaces."""
    ENGINE = "engine"
    """The parallel engine, its layout and buffers: DDP's buckets, FSDP2's units, DeepSpeed's
    engine, pipeline stages and schedule, tensor-parallel plans, offload, this rank's place."""
    EXTENT = "extent"
    """How much was traced: blocks extended from a few, every block traced, steps."""
    VALUES = "values"
    """Values fake tensors lack, answered: ``.item()`` scalars, random draws, MoE routing."""
    PROGRAM = "program"
    """What a user's program did under the trace: autocast, default devices, saves skipped,
    tensors kept on the host, how it ended."""
    LIMITS = "limits"
    """What is not modelled, or not probed, and what that leaves out."""
    MEASUREMENT = "measurement"
    """How a real run was counted."""
    PLAN = "plan"
    """What a planner decided and why: configurations not estimated, re-estimates."""
    OTHER = "other"
    """A note no producer gave a topic."""


class Note(str):
    """A note's text, with what it is about (``topic``)."""

    topic: Topic

    def __new__(cls, topic: Topic, text: str) -> Note:
        note = super().__new__(cls, text)
        note.topic = topic
        return note

    def __reduce__(self) -> tuple[Any, ...]:  # pickled across processes (plan's workers)
        return (Note, (self.topic, str(self)))


def topic_of(note: str) -> Topic:
    """The note's topic; ``other`` for a plain string."""
    return getattr(note, "topic", Topic.OTHER)


def tagged(notes: Iterable[str], topic: Topic) -> list[str]:
    """``notes`` with ``topic`` given to those that have none (a collector that knows what its
    producers' notes are about: an engine's are about the engine)."""
    return [n if isinstance(n, Note) else Note(topic, n) for n in notes]


NOTE_FIELDS = ("notes", "note_records")
"""A JSON answer's fields that hold its notes (texts, records): what a comparison of two answers'
figures leaves out."""


def records(notes: Iterable[str]) -> list[dict[str, str]]:
    """``note_records`` of a JSON answer: each note's topic and text, in order."""
    return [{"topic": topic_of(n).value, "text": str(n)} for n in notes]


def from_records(stored: Iterable[dict[str, str]]) -> list[str]:
    """The notes :func:`records` wrote, topics and all (a cached answer read back)."""
    return [Note(Topic(r["topic"]), r["text"]) for r in stored]


def retitled(note: str, text: str) -> str:
    """``text`` in place of ``note``'s, its topic kept (a note rewritten for another GPU)."""
    return Note(topic_of(note), text) if isinstance(note, Note) else text
