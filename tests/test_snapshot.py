"""The predicted step as a PyTorch memory snapshot: PyTorch's own viewer helpers read it, and its
totals are the ledger's."""

import pickle

import pytest
import torch.cuda._memory_viz as viz

from vramledger import InputError, estimate
from vramledger.render.snapshot import memory_snapshot, write_memory_snapshot

from .conftest import fixture


@pytest.fixture(scope="module")
def ledger():
    return estimate(model=fixture("tiny-llama.json"), seq_len=64, precision="bf16-master")


def _active(snapshot):
    return [
        b for s in snapshot["segments"] for b in s["blocks"] if b["state"] == "active_allocated"
    ]


def test_snapshot_totals_are_the_ledgers(ledger):
    snap = memory_snapshot(ledger)
    blocks = _active(snap)
    assert sum(b["size"] for b in blocks) == ledger.allocated_peak_bytes
    # each block's frame names its category: the breakdown is the ledger's, category by category
    by_category = {}
    for b in blocks:
        category = b["frames"][0]["name"].split(":")[0]
        by_category[category] = by_category.get(category, 0) + b["size"]
    assert by_category == {c.value: n for c, n in ledger.allocated_at_peak.items() if n}
    assert sum(s["total_size"] for s in snap["segments"]) <= ledger.reserved_peak_bytes


def test_pytorchs_memory_viz_reads_it(ledger, tmp_path):
    path = write_memory_snapshot(ledger, tmp_path / "step.pickle")
    snap = pickle.loads(path.read_bytes())
    summary = viz.segsum(snap)  # raises if segments and blocks do not add up
    reserved = sum(s["total_size"] for s in snap["segments"])
    assert f"segments: {len(snap['segments'])}" in summary
    assert f"total_reserved: {viz.Bytes(reserved)}" in summary
    trace = viz.trace(snap)
    actions = [e["action"] for e in snap["device_traces"][0]]
    assert trace.splitlines()[1] == f"{len(actions)} entries"
    assert actions.count("alloc") == actions.count("free_completed") + len(_live_at_end(snap))


def _live_at_end(snap):
    live = {}
    for e in snap["device_traces"][0]:
        if e["action"] == "alloc":
            live[e["addr"]] = e
        elif e["action"] == "free_completed":
            live.pop(e["addr"])
    return live


def test_a_cpu_prediction_has_no_cuda_snapshot():
    ledger = estimate(model=fixture("tiny-llama.json"), seq_len=16, target="cpu")
    with pytest.raises(InputError, match="CUDA"):
        memory_snapshot(ledger)
