"""benchmarks/gpu_check.py, the CUDA check, on a machine without a GPU (issue 32: it compared
with estimates stored on 2026-11-29 and skipped, without a word, the 11 of its 19 cases whose
names had changed since).

The real CUDA half cannot run here. What can: every case is in the list both modes run, with
its files; the estimate half runs as a user runs it; and the measure half's loop, its real run
replaced by a stand-in (a fixed count, or a failure), estimates every case at run time and
names each case that fails, in its table, its result file and its exit status."""

import importlib
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
SCRIPT = BENCHMARKS / "gpu_check.py"
QUICK_CASE = "cnn sgd-mom"
"""The panel's quickest case to estimate (a few seconds)."""


@pytest.fixture
def gpu_check(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    return importlib.import_module("gpu_check")


def test_every_case_is_checked_by_both_halves(gpu_check):
    """Every case has its files, and the estimates on record are of exactly the cases both
    halves run (the file of 2026-11-29 held 14 under names that had changed)."""
    names = [name for name, _ in gpu_check.ALL_CASES]
    assert len(set(names)) == len(names)
    for name, kwargs in gpu_check.ALL_CASES:
        assert gpu_check.missing_files(kwargs) == [], name
    recorded = json.loads(gpu_check.ESTIMATES.read_text())["cases"]
    assert sorted(recorded) == sorted(names)


@pytest.mark.slow
def test_estimate_half_runs_here_as_a_user_runs_it(tmp_path):
    out = tmp_path / "estimates.json"
    command = [sys.executable, str(SCRIPT), "estimate", "--case", QUICK_CASE, "--out", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert QUICK_CASE in done.stdout
    result = json.loads(out.read_text())
    assert list(result["cases"]) == [QUICK_CASE]
    ledger = result["cases"][QUICK_CASE]
    assert ledger["target"] == "cuda" and ledger["allocated_peak_bytes"] > 0
    assert result["commit"] and "failures" not in result

    unknown = [sys.executable, str(SCRIPT), "estimate", "--case", "no such case"]
    done = subprocess.run(unknown, capture_output=True, text=True, timeout=300)
    assert done.returncode == 4, done.stdout + done.stderr
    assert "no case named 'no such case'" in done.stdout


class _StandInGpu:
    """What measure_all asks of ``torch.cuda``, answered without a GPU."""

    @staticmethod
    def is_available() -> bool:
        return True

    @staticmethod
    def get_device_name() -> str:
        return "stand-in GPU"

    @staticmethod
    def get_device_capability() -> tuple[int, int]:
        return (9, 0)

    @staticmethod
    def max_memory_reserved() -> int:
        return 96 * 2**20

    @staticmethod
    def empty_cache() -> None:
        pass


MEASURED = 80_000_000
"""The stand-in real run's count: not a truth, only what the loop must carry into its row."""


@pytest.mark.slow
def test_measure_estimates_every_case_and_names_each_failure(
    gpu_check, monkeypatch, tmp_path, capsys
):
    import vramledger.measure
    from vramledger.inputs.categories import Category

    def real_run(**fields):
        if fields.get("seed") == 1:
            raise RuntimeError("CUDA error: out of memory")
        assert fields["device"] == "cuda" and fields["target"] == "cuda"
        ledger = SimpleNamespace(allocated_at_peak={Category.PARAMETERS: MEASURED})
        return SimpleNamespace(measured_peak_bytes=MEASURED, ledger=ledger)

    monkeypatch.setattr(gpu_check, "torch", SimpleNamespace(cuda=_StandInGpu, __version__="x"))
    monkeypatch.setattr(vramledger.measure, "measure", real_run)
    stale = tmp_path / "stale-estimates.json"  # what the script once read instead of estimating
    stale.write_text(json.dumps({"torch": "x", "cases": {QUICK_CASE: {"allocated_peak_bytes": 1}}}))
    monkeypatch.setattr(gpu_check, "ESTIMATES", stale)
    quick = dict(gpu_check.ALL_CASES)[QUICK_CASE]
    cases = [
        (QUICK_CASE, quick),
        ("files gone", {**quick, "model": str(tmp_path / "absent.py") + ":cnn"}),
        ("real run fails", {**quick, "seed": 1}),
    ]
    out = tmp_path / "gpu_check.json"
    status, path = gpu_check.measure_all(out, cases)
    printed = capsys.readouterr().out

    assert status == gpu_check.CASE_FAILED and path == out
    rows = json.loads(out.read_text())
    assert [row["case"] for row in rows] == [name for name, _ in cases]
    done, gone, failed = rows
    assert done["measured"] == MEASURED and done["estimate"] > 1  # estimated now, not read
    assert done["error"] == (done["estimate"] - MEASURED) / MEASURED
    assert sum(done["estimate_at_peak"].values()) == done["estimate"]
    assert done["gpu_name"] == "stand-in GPU" and "failure" not in done
    assert gone["failed_at"] == "files" and "absent.py" in gone["failure"]
    assert failed["failed_at"] == "real run" and "out of memory" in failed["failure"]
    assert "FAILED: case 'files gone' failed at its files" in printed
    assert "FAILED: case 'real run fails' failed at its real run" in printed
    assert "2 case(s) failed" in printed
