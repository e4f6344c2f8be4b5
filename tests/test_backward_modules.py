"""Backward allocations belong to the module whose backward runs (``trace/core/backward_modules.py``),
recomputation under activation checkpointing to the module recomputed, and the attribution
changes no allocation: the timeline's events are those of a trace that attributes nothing in
backward, and what is live at the peak by module sums to the peak."""

from __future__ import annotations

import pytest
import torch
from rich.console import Console
from torch import nn

from vramledger import TrainingSpec, estimate
from vramledger.inputs.categories import Category, Phase
from vramledger.ledger.peak_modules import OTHER_MODULES, OUTSIDE
from vramledger.measure import measure
from vramledger.predict.step import policy_for
from vramledger.record.timeline import Timeline
from vramledger.render.html import ledger_html
from vramledger.render.terminal import ledger_table
from vramledger.trace.core.backward_modules import BackwardModules
from vramledger.trace.core.fake import trace
from vramledger.trace.core.tracker import StorageTracker

from .conftest import MODELS_PY

MLP = dict(
    model=f"{MODELS_PY}:mlp",  # inp (32 -> 64), 3 blocks (norm, fc1 64 -> 256, act, fc2), head
    inputs=f"{MODELS_PY}:mlp_inputs",
    loss=f"{MODELS_PY}:mlp_loss",
    batch_size=8,
    target="cpu",
)
FP32 = 4
BATCH, WIDTH, HIDDEN = 8, 64, 256


def _made_in_backward(tl: Timeline, step: int = 2) -> list[int]:
    return [s for s in range(tl.num_storages) if tl.origin[s] == (step, Phase.BACKWARD)]


def _trace(**fields):
    spec = TrainingSpec(**{**MLP, **fields})
    return trace(spec, policy_for(spec)).timeline


@pytest.fixture(scope="module")
def plain() -> Timeline:
    return _trace()


@pytest.fixture(scope="module")
def checkpointed() -> Timeline:
    return _trace(checkpoint_modules=("Block",))


def test_a_linear_weight_gradient_belongs_to_that_linear(plain):
    tl = plain
    for k in range(3):
        grads = [
            tl.nbytes[s]
            for s in _made_in_backward(tl)
            if tl.module[s] == f"blocks.{k}.fc1" and tl.category(s) is Category.GRADIENTS
        ]
        assert sorted(grads) == [HIDDEN * FP32, HIDDEN * WIDTH * FP32]  # bias, weight
    # the first layer's input needs no gradient: its backward makes its weight's only
    inp = [s for s in _made_in_backward(tl) if tl.module[s] == "inp"]
    assert {tl.category(s) for s in inp} == {Category.GRADIENTS}


def test_an_activation_gradient_belongs_to_the_module_that_made_the_activation(plain):
    tl = plain
    gelu = [s for s in _made_in_backward(tl) if tl.op[s] == "aten.gelu_backward.default"]
    assert [tl.module[s] for s in gelu] == ["blocks.2.act", "blocks.1.act", "blocks.0.act"]
    assert all(tl.nbytes[s] == BATCH * HIDDEN * FP32 for s in gelu)
    assert not any(tl.recomputed[s] for s in gelu)
    # the loss is computed outside every module: so is its backward
    loss = [s for s in _made_in_backward(tl) if "softmax" in (tl.op[s] or "")]
    assert loss and all(tl.module[s] is None for s in loss)


def test_recomputation_belongs_to_the_module_recomputed(checkpointed):
    tl = checkpointed
    again = [s for s in _made_in_backward(tl) if tl.recomputed[s]]
    assert again
    assert all(tl.module[s].startswith("blocks.") for s in again)
    recomputed_gelu = [s for s in again if tl.op[s] == "aten.gelu.default"]
    assert [tl.module[s] for s in recomputed_gelu] == [f"blocks.{k}.act" for k in (2, 1, 0)]
    # the recomputed forward's backward is the backward's, not a recomputation
    gelu_grads = [s for s in _made_in_backward(tl) if tl.op[s] == "aten.gelu_backward.default"]
    assert [tl.module[s] for s in gelu_grads] == [f"blocks.{k}.act" for k in (2, 1, 0)]
    assert not any(tl.recomputed[s] for s in gelu_grads)
    assert not any(
        tl.recomputed[s] for s in range(tl.num_storages) if tl.origin[s][1] is not Phase.BACKWARD
    )


@pytest.mark.parametrize("fields", [{}, {"checkpoint_modules": ("Block",)}], ids=["plain", "ckpt"])
def test_attribution_changes_no_allocation(fields, monkeypatch, plain, checkpointed):
    """The same trace with no module attribution in backward (the tracker before it) has the
    same events, sizes, categories and phases: only the labels of backward storages differ."""
    attributed = checkpointed if fields else plain
    monkeypatch.setattr(BackwardModules, "running", lambda self: (False, None))
    unattributed = _trace(**fields)
    for column in ("events", "nbytes", "tags", "origin", "on_host", "op", "marks", "recomputed"):
        assert getattr(attributed, column) == getattr(unattributed, column), column
    backward = set(_made_in_backward(attributed, 1)) | set(_made_in_backward(attributed))
    for s in range(attributed.num_storages):
        if s not in backward or attributed.recomputed[s]:
            assert attributed.module[s] == unattributed.module[s]
    assert all(unattributed.module[s] is None for s in backward if not attributed.recomputed[s])


def test_modules_at_the_peak_sum_to_the_peak():
    ledger = estimate(**MLP)
    rows = ledger.peak_modules
    assert sum(r.total for r in rows) == ledger.peak_bytes == sum(ledger.at_peak.values())
    gradients = ledger.at_peak[Category.GRADIENTS]
    made_in_backward = sum(r.backward for r in rows if r.module != OUTSIDE)
    assert gradients and made_in_backward >= gradients  # every gradient is a module's
    fc1 = next(r for r in rows if r.module == "blocks.0.fc1")
    assert fc1.backward >= (HIDDEN + HIDDEN * WIDTH) * FP32
    outside = next(r for r in rows if r.module == OUTSIDE)
    assert outside.other >= ledger.at_peak[Category.PARAMETERS]
    listed = ledger.to_dict()["peak_modules"]
    assert sum(r["bytes"] for r in listed) == ledger.peak_bytes
    assert listed[-1]["module"] == OTHER_MODULES and len(listed) == 11
    for r in listed:
        parts = ("forward_bytes", "recomputed_bytes", "backward_bytes", "other_bytes")
        assert r["bytes"] == sum(r[p] for p in parts)


def test_the_reports_show_backward_attribution():
    ledger = estimate(**MLP)
    console = Console(record=True, width=160)
    console.print(ledger_table(ledger))
    text = console.export_text()
    assert "live at the peak, by the module that allocated it" in text
    assert "blocks.0.fc1" in text and "backward" in text
    page = ledger_html(ledger)
    assert "Live at the peak, by the module that allocated it" in page
    assert "<th class='n'>backward</th>" in page


def test_a_real_run_attributes_backward_too():
    tl = measure(**MLP).ledger.timeline
    grads = [
        s
        for s in _made_in_backward(tl)
        if tl.module[s] == "blocks.1.fc2" and tl.category(s) is Category.GRADIENTS
    ]
    assert sorted(tl.nbytes[s] for s in grads) == [WIDTH * FP32, WIDTH * HIDDEN * FP32]


class _Bad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return grad @ torch.ones(3, 5)  # (4, 4) @ (3, 5): the operator refuses


class _Two(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.bad = _BadModule()

    def forward(self, x):
        return self.bad(self.lin(x))


class _BadModule(nn.Module):
    def forward(self, x):
        return _Bad.apply(x)


def _tracked(model: nn.Module) -> StorageTracker:
    return StorageTracker(module_names={id(m): n for n, m in model.named_modules()})


def test_accumulate_grad_work_belongs_to_the_parameter_module():
    """What runs in ``AccumulateGrad`` (a post-accumulate hook, as DDP's and FSDP's buckets)
    belongs to the module holding the parameter."""
    model = _Two()
    kept = []
    model.lin.weight.register_post_accumulate_grad_hook(lambda p: kept.append(p.grad.clone()))
    model.bad = nn.Identity()
    tracker = _tracked(model)
    with tracker:
        tracker.set_phase(1, Phase.FORWARD)
        loss = model(torch.randn(8, 4)).sum()
        tracker.set_phase(1, Phase.BACKWARD)
        loss.backward()
    tl = tracker.close()
    (clone,) = [s for s in range(tl.num_storages) if tl.op[s] == "aten.clone.default"]
    assert tl.module[clone] == "lin" and tl.origin[clone][1] is Phase.BACKWARD


def test_an_operator_failing_in_backward_names_the_module():
    model = _Two()
    tracker = _tracked(model)
    with pytest.raises(RuntimeError) as failure, tracker:
        tracker.set_phase(1, Phase.FORWARD)
        loss = model(torch.randn(4, 4)).sum()
        tracker.set_phase(1, Phase.BACKWARD)
        loss.backward()
    assert tracker.module_of(failure.value) == "bad"
