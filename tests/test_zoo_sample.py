"""A fixed sample of the model-zoo sweep (benchmarks/zoo.py), through the script's own functions:
each architecture shrunk from its config class's defaults, saved as config.json, estimated and
run for real on CPU (fp32 AdamW, batch 2 x 32), in worker subprocesses as the sweep runs them."""

import importlib.util
import sys
from pathlib import Path

import pytest

ZOO_PY = Path(__file__).resolve().parents[1] / "benchmarks" / "zoo.py"
SAMPLE = (
    ("llama", "causal-lm", "bfloat16"),  # a config declaring its checkpoint dtype
    ("bert", "masked-lm", "none"),
    ("t5", "seq2seq-lm", "none"),
    ("vit", "image-classification", "none"),
    ("gpt2", "sequence-classification", "none"),
    ("parakeet_ctc", "ctc", "none"),  # frame features with their mask (tasks._ctc)
    ("t5gemma2", "seq2seq-lm", "none"),  # mask functions under vmap (trace.cpu_scratch)
)


def _load_zoo():
    spec = importlib.util.spec_from_file_location("zoo_benchmark", ZOO_PY)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_zoo_sample_estimates_match_real_runs():
    zoo = _load_zoo()
    cases = {(c.arch, c.task): c for c in zoo.enumerate_cases()}
    records = []
    for variant in sorted({v for _, _, v in SAMPLE}):
        picked = [cases[(arch, task)] for arch, task, v in SAMPLE if v == variant]
        options = zoo.Options(precisions=("fp32",), variants=(variant,))
        records += zoo.sweep(picked, options, workers=2, progress=False)
    assert len(records) == len(SAMPLE)
    for r in records:
        name = f"{r['arch']}:{r['task']} ({r['variant']})"
        assert "estimate_error" not in r and "measure_error" not in r, (name, r)
        assert r["shrink"] == "full", (name, r["shrink"])
        assert abs(r["error"]) < zoo.WITHIN, (name, r["estimate_bytes"], r["measured_bytes"])
    totals = zoo.totals(records)
    assert totals["estimated"] == totals["within"] == len(SAMPLE)
