"""A fixed sample of the model-zoo sweep, run as a user runs it (``python benchmarks/zoo.py``,
nothing of the script imported): each architecture shrunk from its config class's defaults,
saved as config.json, estimated and run for real on CPU (fp32 AdamW, batch 2 x 32), in worker
subprocesses as the sweep runs them; the test reads the JSON the script writes."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ZOO_PY = Path(__file__).resolve().parents[1] / "benchmarks" / "zoo.py"
SAMPLE = {
    # config.json declaring its checkpoint dtype
    "bfloat16": ("llama:causal-lm",),
    "none": (
        "bert:masked-lm",
        "t5:seq2seq-lm",
        "vit:image-classification",
        "gpt2:sequence-classification",
        "parakeet_ctc:ctc",  # frame features with their mask (tasks._ctc)
        "t5gemma2:seq2seq-lm",  # mask functions under vmap (trace.cpu_scratch)
    ),
}
WITHIN_PLAIN = 0.001
"""Issue 19's bound for the zoo against plain runs: 0.1 %."""


@pytest.mark.slow
@pytest.mark.parametrize("variant", sorted(SAMPLE))
def test_zoo_sample_estimates_match_real_runs(variant, tmp_path):
    out = tmp_path / "zoo.json"
    command = [
        sys.executable,
        str(ZOO_PY),
        "--cases",
        ",".join(SAMPLE[variant]),
        "--precisions",
        "fp32",
        "--dtype-variants",
        variant,
        "--no-distributed",
        "--out",
        str(out),
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    records = result["records"]
    assert sorted(f"{r['arch']}:{r['task']}" for r in records) == sorted(SAMPLE[variant])
    for r in records:
        name = f"{r['arch']}:{r['task']} ({r['variant']})"
        assert "estimate_error" not in r and "measure_error" not in r, (name, r)
        assert r["shrink"] == "full", (name, r["shrink"])
        assert abs(r["error"]) < WITHIN_PLAIN, (name, r["estimate_bytes"], r["measured_bytes"])
    assert result["totals"]["estimated"] == result["totals"]["within"] == len(records)
