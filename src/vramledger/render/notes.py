"""Notes as a reader sees them: by topic, in :class:`~vramledger.inputs.notes.Topic`'s order
(the device and the inputs, then what the trace ran, then what it answered), each topic's notes
in the order they were made. The terminal's ``note:`` lines and the HTML report's sections both
come from :func:`by_topic`; JSON keeps the answer's own order (``notes``, ``note_records``)."""

from __future__ import annotations

from collections.abc import Iterable

from vramledger.inputs.notes import Topic, topic_of


def by_topic(notes: Iterable[str]) -> list[tuple[Topic, list[str]]]:
    """Each topic that has notes, with them, in the topics' order."""
    groups: dict[Topic, list[str]] = {}
    for note in notes:
        groups.setdefault(topic_of(note), []).append(note)
    return [(topic, groups[topic]) for topic in Topic if topic in groups]


def note_lines(notes: Iterable[str]) -> list[str]:
    """The terminal's ``note: ...`` lines, by topic."""
    return [f"note: {n}" for _, group in by_topic(notes) for n in group]
