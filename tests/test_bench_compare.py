"""The benchmarks' ``--compare OLD.json --against NEW.json`` (``benchmarks/benchkit/compare.py``),
run as a user runs it: a benchmark script in a subprocess on two small result files, nothing of
the benchmarks imported. Answers that differ are reported and fail the command; times,
provenance and the order of named rows do not."""

import json
import re
import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
SCRIPT = BENCHMARKS / "activations.py"
"""A benchmark whose command line imports nothing heavy before it compares."""
ANSWERS_DIFFER = 3

BEFORE = {
    "s": 512,
    "rows": [
        {"case": "none", "t": 1, "traced_bytes": 1000, "traced_sbh": 0.5, "seconds": 1.5},
        {"case": "tp", "t": 2, "traced_bytes": 600, "traced_sbh": 0.25, "seconds": 2.0},
    ],
    "spec": {"model": "/one/checkout/tests/fixtures/hub/tiny-llama-bf16"},
    "commit": "aaaaaaa",
    "machine": {"host": "one", "load_average": [1.0, 1.0, 1.0]},
}


def _compare(tmp_path: Path, after: dict) -> subprocess.CompletedProcess:
    old, new = tmp_path / "old.json", tmp_path / "new.json"
    old.write_text(json.dumps(BEFORE))
    new.write_text(json.dumps(after))
    command = [sys.executable, str(SCRIPT), "--compare", str(old), "--against", str(new)]
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


def test_times_provenance_row_order_and_checkout_are_not_answers(tmp_path):
    after = json.loads(json.dumps(BEFORE))
    after["spec"]["model"] = "/another/tests/fixtures/hub/tiny-llama-bf16"  # another checkout
    after["rows"].reverse()  # rows named by case and t: paired by name
    after["rows"][0]["seconds"] = 9.9
    after["commit"] = "bbbbbbb"
    after["machine"] = {"host": "two"}
    done = _compare(tmp_path, after)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "every answer the same" in done.stdout


def test_every_answer_that_differs_is_a_row_and_fails(tmp_path):
    after = json.loads(json.dumps(BEFORE))
    after["rows"][1]["traced_bytes"] = 601  # bytes
    after["rows"][0]["traced_sbh"] = 0.5000000001  # a float, to the last bit
    after["rows"][0]["note"] = "new"  # a field only one result has
    after["spec"]["model"] = "/one/checkout/tests/fixtures/hub/tiny-llama-8l"  # another file
    del after["s"]
    after["rows"].append({"case": "tp+sp", "t": 2, "traced_bytes": 5})  # a new row
    done = _compare(tmp_path, after)
    assert done.returncode == ANSWERS_DIFFER, done.stdout + done.stderr
    out = " ".join(done.stdout.split())
    for where in (
        "rows[case=tp, t=2].traced_bytes",
        "rows[case=none, t=1].traced_sbh",
        "rows[case=none, t=1].note",
        "rows[case=tp+sp, t=2]",
        "spec.model",
    ):
        assert where in out, (where, done.stdout)
    assert re.search(r"\bs\b.*\b512\b.*\(absent\)", out), done.stdout
    assert "6 answer(s) DIFFER" in out, done.stdout


def test_against_needs_compare(tmp_path):
    new = tmp_path / "new.json"
    new.write_text("{}")
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--against", str(new)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0 and "--compare" in done.stderr


def test_every_benchmark_that_writes_a_result_takes_compare():
    """Read, not imported: each script that writes a JSON result has the shared options."""
    writers = [
        p for p in sorted(BENCHMARKS.glob("*.py")) if re.search(r"json\.dumps\(", p.read_text())
    ]
    assert len(writers) >= 14, [p.name for p in writers]
    missing = [p.name for p in writers if "compare.add_arguments(" not in p.read_text()]
    assert not missing, f"no --compare in {missing} (benchkit/compare.py: add_arguments)"
