"""The zoo's vision stragglers (issue 19, section 3) as small steps against plain runs.

Two causes, each a fixture in ``tests/fixtures/vision_paths.py``, counted plain by the CPU
allocator (``cpu_allocator_count``, nothing of vramledger's active) and compared with the
estimate (docs/plain-run-paths.md, "The zoo's vision stragglers"):

- ``linear`` with a bias on a non-contiguous input adds the bias in place in a plain run and
  out of place under a dispatch mode (SigLIP2's pooling head, ``nn.MultiheadAttention``);
- layer norm over a bfloat16 input with fp32 weights (CPU autocast) keeps its statistics in
  float32, where the fake kernel keeps the input's dtype (Swin, Swin-v2, Donut-Swin,
  SegFormer, Fuyu, Persimmon under bf16-mixed).
"""

import contextlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from vramledger import estimate
from vramledger.measure import cpu_allocator_count, measure

from .conftest import fixture

VISION_PATHS_PY = fixture("vision_paths.py")
BATCH = 8
STEPS = 2
"""As the estimate's default: the steady-state peak is the second step's."""
BOUND = 0.001
"""The issue's bound: the estimate within 0.1 % of the plain run (both cases are exact)."""

CASES = {
    # name: (model, inputs, loss, precision)
    "linear-bias-on-transposed-input": ("projector", "token_inputs", "class_loss", "fp32"),
    "layer-norm-mixed-dtype": ("norm_stack", "token_inputs", "square_loss", "bf16-mixed"),
}


class _DoNothing(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _plain_peak(name: str, under_mode: bool = False) -> int:
    """Steady-state step peak of a plain SGD loop (forward under CPU autocast for
    bf16-mixed), counted from before the model is built."""
    from tests.fixtures import vision_paths

    model_name, inputs_name, loss_name, precision = CASES[name]
    model = getattr(vision_paths, model_name)
    inputs = getattr(vision_paths, inputs_name)
    loss_fn = getattr(vision_paths, loss_name)
    cpu_allocator_count.install()
    torch.manual_seed(0)
    base = cpu_allocator_count.live()
    model = model()
    batch = inputs("cpu", batch_size=BATCH)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    peak = 0
    for _ in range(STEPS):
        cpu_allocator_count.reset_peak()
        optimizer.zero_grad(set_to_none=True)
        with _DoNothing() if under_mode else contextlib.nullcontext():
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16-mixed"):
                loss = loss_fn(model, batch)
            loss.backward()
        optimizer.step()
        peak = cpu_allocator_count.peak() - base
    return peak


def _spec(name: str) -> dict:
    """The case as estimate's and measure's fields: the plain loop's model, batch and SGD."""
    model, inputs, loss, precision = CASES[name]
    return dict(
        model=f"{VISION_PATHS_PY}:{model}",
        inputs=f"{VISION_PATHS_PY}:{inputs}",
        loss=f"{VISION_PATHS_PY}:{loss}",
        optimizer="sgd",
        precision=precision,
        batch_size=BATCH,
        steps=STEPS,
        target="cpu",
    )


@pytest.mark.parametrize("name", list(CASES))
def test_estimate_matches_plain_run(name):
    plain = _plain_peak(name)
    predicted = estimate(**_spec(name)).peak_bytes
    assert abs(predicted - plain) <= BOUND * plain, f"{name}: estimate {predicted} vs plain {plain}"


def test_measure_counts_a_plain_run():
    """The tracked run's ledger, with the bias add folded as the plain run writes, agrees with
    the plain count to the byte. (The layer-norm case's tracked run is below its count: CPU
    kernel scratch, which no dispatch-level tracker sees; the estimate probes it.)"""
    name = "linear-bias-on-transposed-input"
    m = measure(**_spec(name))
    assert m.measured_peak_bytes == _plain_peak(name)
    assert m.to_dict()["tracked_peak_bytes"] == m.measured_peak_bytes


def test_linear_bias_add_is_in_place_only_in_a_plain_run(monkeypatch):
    """A do-nothing dispatch mode raises the count (``linear`` adds the bias out of place);
    traced without the rule (the bias add kept out of place) the estimate is that high."""
    import vramledger.trace.core.plain_branches as plain_branches

    name = "linear-bias-on-transposed-input"
    plain = _plain_peak(name)
    moded = _plain_peak(name, under_mode=True)
    assert moded > plain * (1 + BOUND), (moded, plain)
    monkeypatch.setattr(plain_branches, "LINEAR_BIAS_ADD", None)
    before = estimate(**_spec(name)).peak_bytes
    monkeypatch.undo()
    assert before > plain * (1 + BOUND), (before, plain)


def test_layer_norm_statistics_of_a_mixed_dtype_are_float32(monkeypatch):
    """The same step under a dispatch mode counts the same (a fake-kernel dtype, not an
    autograd branch); without the correction the estimate comes out below the plain run."""
    from vramledger.trace.core import fake_corrections

    name = "layer-norm-mixed-dtype"
    plain = _plain_peak(name)
    assert _plain_peak(name, under_mode=True) == plain
    corrections = dict(fake_corrections.CORRECTIONS)
    del corrections[torch.ops.aten.native_layer_norm.default]
    monkeypatch.setattr(fake_corrections, "CORRECTIONS", corrections)
    import vramledger.trace.session as session

    monkeypatch.setattr(session, "CORRECTIONS", corrections)
    before = estimate(**_spec(name)).peak_bytes
    monkeypatch.undo()
    assert before < plain * (1 - BOUND), (before, plain)
