"""Notes as records (``inputs/notes.py``): every note an answer carries says what it is about,
in the JSON (``note_records``), through the caches, across processes; readers ask by topic
(``fit`` keeps the kernels each answer assumed), never by a note's words."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest

from vramledger import estimate
from vramledger.inputs.notes import Note, Topic, from_records, records, tagged, topic_of
from vramledger.inputs.program import ProgramSpec
from vramledger.ledger.ledger_record import ledger_from_record, ledger_record

from .conftest import fixture
from .mesh_real import PIPELINE

TINY = dict(model=fixture("tiny-llama.json"), seq_len=32)
PROGRAMS = Path(__file__).parent / "programs"

ANSWERS = {
    "gpu": dict(gpu="h100-80gb", **TINY),
    "cpu": dict(target="cpu", precision="bf16-master", **TINY),
    "fsdp-offload": dict(strategy="fsdp", world_size=2, offload="optimizer", **TINY),
    "zero2": dict(strategy="zero2", world_size=2, **TINY),
    "gpipe": PIPELINE[2]["gpipe"],
}


def test_a_note_is_its_text_and_keeps_its_topic():
    note = Note(Topic.KERNELS, "attention: flash")
    assert note == "attention: flash" and "flash" in note and str(note) == "attention: flash"
    assert list(dict.fromkeys([note, "attention: flash"])) == [note]
    assert topic_of(note) is Topic.KERNELS and topic_of("plain text") is Topic.OTHER
    again = pickle.loads(pickle.dumps(note))  # plan's worker processes
    assert again == note and topic_of(again) is Topic.KERNELS
    assert json.dumps([note]) == '["attention: flash"]'
    [kept, given] = tagged([note, "a DDP note"], Topic.ENGINE)
    assert topic_of(kept) is Topic.KERNELS and topic_of(given) is Topic.ENGINE
    read = from_records(records([note, given]))
    assert read == [note, given] and [topic_of(n) for n in read] == [Topic.KERNELS, Topic.ENGINE]


@pytest.mark.parametrize("name", sorted(ANSWERS))
def test_every_note_of_an_estimate_has_a_topic_and_the_json_says_it(name):
    ledger = estimate(**ANSWERS[name])
    for one in [ledger, *(r for _, r in ledger.ranks)]:
        untopical = [n for n in one.notes if topic_of(n) is Topic.OTHER]
        assert not untopical, untopical
        data = one.to_dict()
        assert [r["text"] for r in data["note_records"]] == data["notes"]
        assert [r["topic"] for r in data["note_records"]] == [topic_of(n).value for n in one.notes]
        # the answer cache's record keeps them
        assert [topic_of(n) for n in ledger_from_record(ledger_record(one)).notes] == [
            topic_of(n) for n in one.notes
        ]
    topics = {topic_of(n) for n in ledger.notes}
    assert Topic.KERNELS in topics and Topic.INPUTS in topics
    assert (Topic.ENGINE in topics) == (ledger.world_size > 1)


def test_every_note_of_a_program_run_has_a_topic():
    from vramledger.predict.program import run_program

    spec = ProgramSpec(program=str(PROGRAMS / "fsdp2_torchrun.py"), nproc_per_node=2)
    report = run_program(spec, gpu="h100-80gb")
    notes = [*report.notes, *report.ledger.notes]
    assert not [n for n in notes if topic_of(n) is Topic.OTHER]
    assert {Topic.ENGINE, Topic.KERNELS, Topic.PROGRAM, Topic.TARGET} <= {
        topic_of(n) for n in notes
    }


def test_fit_keeps_the_kernel_notes_by_topic(capsys):
    from vramledger.cli import main

    assert main(["fit", fixture("tiny-llama.json"), "--gpu", "h100-80gb", "--seq-len", "32",
                 "--optimizers", "adamw", "--json"]) == 0  # fmt: skip
    data = json.loads(capsys.readouterr().out)
    assert data["notes"] and {r["topic"] for r in data["note_records"]} == {"kernels"}
    assert any(n.startswith("attention:") for n in data["notes"])
    assert any(n.startswith("eager:") for n in data["notes"])


def test_the_html_report_groups_the_notes_by_topic():
    from vramledger.render.html import ledger_html

    page = ledger_html(estimate(**ANSWERS["gpu"]))
    kernels, inputs = page.index(">kernels</h3>"), page.index(">inputs</h3>")
    assert inputs < kernels  # the topics' order
    assert page.index("attention:", kernels) > kernels


def test_the_terminal_lists_the_notes_by_topic(capsys):
    """``estimate``'s text answer gives every note of its JSON answer, by topic in the topics'
    order (``render/notes.py``), each topic's in the order they were made."""
    from vramledger.cli import main

    args = ["estimate", TINY["model"], "--seq-len", "32", "--gpu", "h100-80gb", "--no-cache"]
    assert main([*args, "--json"]) == 0
    made = json.loads(capsys.readouterr().out)["note_records"]
    assert main(args) == 0
    shown = [line[len("note: ") :] for line in capsys.readouterr().out.splitlines()
             if line.startswith("note: ")]  # fmt: skip
    order = list(Topic)
    expected = sorted(made, key=lambda r: order.index(Topic(r["topic"])))  # stable
    assert shown == [r["text"] for r in expected]
    assert [r["text"] for r in made] != shown  # the answer's own order differs here
