"""`compare`: same start, same batches, each optimizer; gaps, verdicts, memory, plot."""

import json

import pytest

from vramledger import InputError, TrainingSpec
from vramledger.cli import main
from vramledger.measure.compare import compare, gaps, parse_entry, verdict

from .conftest import fixture

SPEC = TrainingSpec(model=fixture("tiny-gpt2.json"), batch_size=2, seq_len=16)


def test_compare_runs_end_to_end_and_reports_memory_and_gaps():
    optimizers = ["adamw", "sgd-momentum@0.05"]
    pytest.importorskip("torchao")
    optimizers.insert(1, "adamw8bit")
    result = compare(SPEC, optimizers, steps=6)
    ref, *others = result.runs
    assert ref.verdict == "reference" and ref.final_gap is None
    assert [len(r.losses) for r in result.runs] == [6, 6, 6]
    assert ref.losses[0] == others[0].losses[0]  # same initial weights, same first batch
    for run in others:
        assert run.final_gap is not None and run.max_gap is not None
        assert run.verdict in ("matches", "worse", "better")
    by_name = {r.optimizer: r for r in result.runs}
    assert by_name["adamw8bit"].optimizer_state_bytes < by_name["adamw"].optimizer_state_bytes
    assert by_name["sgd-momentum"].optimizer_state_bytes_per_param == pytest.approx(4.0)


def test_gap_and_verdict_follow_the_tolerance():
    flat = [1.0] * 20
    assert gaps(flat, flat) == (0.0, 0.0)
    final, largest = gaps([1.2] * 20, flat)
    assert final == pytest.approx(0.2) and largest == pytest.approx(0.2)
    assert (
        verdict(0.2, 0.05) == "worse"
        and verdict(-0.2, 0.05) == "better"
        and verdict(0.01, 0.05) == "matches"
    )


def test_bad_arguments():
    assert parse_entry("sgd@0.1") == ("sgd", {"lr": 0.1})
    with pytest.raises(InputError, match="learning rate"):
        parse_entry("sgd@fast")
    with pytest.raises(InputError, match="at least two"):
        compare(SPEC, ["adamw"], steps=3)


def test_cli_json_and_plot(tmp_path, capsys):
    plot = tmp_path / "curves.png"
    code = main(
        [
            "compare",
            fixture("tiny-gpt2.json"),
            "--optimizers",
            "adamw,sgd",
            "--steps",
            "3",
            "--seq-len",
            "16",
            "--json",
            "--plot",
            str(plot),
        ]
    )
    data = json.loads(capsys.readouterr().out)
    assert code == 0 and plot.stat().st_size > 10_000
    assert data["reference"] == "adamw" and len(data["runs"]) == 2
    assert {
        "peak_bytes",
        "optimizer_state_bytes",
        "final_gap",
        "max_gap",
        "verdict",
        "losses",
    } <= set(data["runs"][1])
