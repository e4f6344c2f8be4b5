"""`vramledger run` on programs whose model is large: built without data (host stand-ins,
trace/program/host_stand_ins.py) and, where it has a list of identical blocks, traced at 4 and 5 blocks
and extended (trace/program/program_blocks.py). The extended answer equals the full trace's, byte for
byte, on models small enough to trace in full, and what the program prints is printed once."""

from __future__ import annotations

import json
import re
import resource
from pathlib import Path

import pytest

import vramledger.predict.program as predict_program
from vramledger.inputs.notes import NOTE_FIELDS
from vramledger.inputs.program import ProgramSpec
from vramledger.measure.program import measure_program
from vramledger.predict.program import run_program
from vramledger.trace.core.blocks import same_timeline
from vramledger.trace.program.program_trace import trace_program

PROGRAMS = Path(__file__).parent / "programs"

TINY_LLAMA = {
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 8,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
}
PLAIN_8 = ("8", "256", "4", "512", "32")
"""Eight blocks of 256 x 768 and 256 x 1024 fp32 weights (768 KiB and 1 MiB: the larger are
host stand-ins)."""

DIFFERING = (*NOTE_FIELDS, "seconds", "blocks_extended", "host_tensors", "host_bytes")
"""What an extended report says differently from the full one: how it was made, and the host
tensors the program kept, which are listed from the shallow run's (its optimizer's host step
counters are one per parameter of 5 blocks, not 8: the notes say so)."""


def _printed(text: str) -> list[tuple[str, int]]:
    return [(m[1], int(m[2])) for m in re.finditer(r"^(.*) peak bytes: (\d+)$", text, re.M)]


def _answer(report) -> str:
    """The report's JSON without what says how it was made (at every level: ``ranks`` holds
    the ledger again)."""

    def strip(value):
        if isinstance(value, dict):
            return {k: strip(v) for k, v in value.items() if k not in DIFFERING}
        if isinstance(value, list):
            return [strip(v) for v in value]
        return value

    return json.dumps(strip(report.to_dict()), sort_keys=True)


def _llama_spec(tmp_path: Path) -> ProgramSpec:
    config = tmp_path / "llama-8.json"
    config.write_text(json.dumps({"model_type": "llama", **TINY_LLAMA}))
    return ProgramSpec(program=str(PROGRAMS / "llama_from_config.py"), args=(str(config), "32"))


def _plain_spec(*extra: str) -> ProgramSpec:
    return ProgramSpec(program=str(PROGRAMS / "plain_deep.py"), args=(*PLAIN_8, *extra))


def _full(spec: ProgramSpec, target: str, monkeypatch) -> tuple:
    """The report of a trace of every block, and its timeline."""
    traced = []

    def every_block(*args, **kwargs):
        traced.append(trace_program(*args, **kwargs))
        return traced[-1]

    with monkeypatch.context() as patch:
        patch.setattr(predict_program, "trace_program_blocks", every_block)
        return run_program(spec, target=target), traced[0].timeline


@pytest.mark.parametrize("target", ["cuda", "cpu"])
@pytest.mark.parametrize("program", ["llama", "plain"])
def test_extended_program_equals_its_full_trace(program, target, tmp_path, monkeypatch, capsys):
    """The report of the extended run (4 and 5 of 8 blocks) equals the full trace's, byte for
    byte but for the notes saying how it was made; its timeline is the full trace's, event for
    event; what the program printed from torch.cuda.max_memory_allocated() is the full
    model's, printed once."""
    spec = _llama_spec(tmp_path) if program == "llama" else _plain_spec()
    captured = []
    original = predict_program.trace_program_blocks

    def keep(*args, **kwargs):
        captured.append(original(*args, **kwargs))
        return captured[-1]

    monkeypatch.setattr(predict_program, "trace_program_blocks", keep)
    extended = run_program(spec, target=target)
    printed_extended = _printed(capsys.readouterr().out)
    full, full_timeline = _full(spec, target, monkeypatch)
    printed_full = _printed(capsys.readouterr().out)
    assert captured[0].extended, extended.notes
    assert extended.ledger is not None and extended.ledger.blocks_extended
    assert any("traced 4 and 5 of the 8 identical blocks" in n for n in extended.notes)
    assert same_timeline(captured[0].timeline, full_timeline)
    assert _answer(extended) == _answer(full)
    assert len(printed_extended) == 1
    assert printed_extended == printed_full


def test_target_cpu_equals_the_real_cpu_run_of_a_model_built_without_data(capsys):
    """A model whose larger weights are host stand-ins, extended from 4 and 5 of its 8 blocks,
    predicts what the real CPU run (built for real) counts, to the byte."""
    predicted = run_program(_plain_spec(), target="cpu")
    printed_predicted = _printed(capsys.readouterr().out)
    measured = measure_program(_plain_spec())
    printed_measured = _printed(capsys.readouterr().out)
    assert any("built without data" in n for n in predicted.notes)
    assert predicted.ledger is not None and predicted.ledger.blocks_extended
    assert printed_predicted == printed_measured
    assert [(w.optimizer, w.steps, w.peak_bytes) for w in predicted.windows] == [
        (w.optimizer, w.steps, w.peak_bytes) for w in measured.windows
    ]
    assert {k: v for k, v in predicted.step_peaks.items() if k >= 2} == {
        k: v for k, v in measured.step_peaks.items() if k >= 2
    }


def test_blocks_called_by_the_programs_own_count_are_traced_in_full(capsys):
    """A program that calls ``self.blocks[i]`` up to its own count fails on the shallow model:
    it runs again with every block, says so, and its output is printed once."""
    report = run_program(_plain_spec("indexed"), target="cpu")
    printed = _printed(capsys.readouterr().out)
    assert report.ledger is not None and not report.ledger.blocks_extended
    assert any(
        n.startswith("traced every one of the 8 blocks of the program's model (with 4 it raised")
        for n in report.notes
    ), report.notes
    assert len(printed) == 1
    plain = run_program(_plain_spec(), target="cpu")
    capsys.readouterr()
    assert report.peak_bytes == plain.peak_bytes


LARGE = ("1", "8192", "64", "1024", "16")
"""One block of 8192-wide weights: 3 GiB of fp32 parameters if built for real."""


def test_modules_are_built_without_memory(capsys):
    """A model of 3 GiB of parameters is built, moved and trained without the process taking
    them (the peak resident memory grows by far less)."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    report = run_program(
        ProgramSpec(program=str(PROGRAMS / "plain_deep.py"), args=LARGE), target="cuda"
    )
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    capsys.readouterr()
    note = next(n for n in report.notes if "built without data" in n)
    assert int(re.search(r"([\d,]+) bytes", note)[1].replace(",", "")) > 3 * 1024**3
    assert grown < 512 * 1024**2
    assert report.ledger is not None
