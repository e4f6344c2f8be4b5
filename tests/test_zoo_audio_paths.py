"""The causes behind the zoo's audio stragglers (docs/plain-run-paths.md, "Zoo audio cases")
against plain runs.

Each case is a small training step (tests/fixtures/zoo_audio_paths.py) whose peak one cause
decides. The truth is a plain loop written here, nothing of vramledger's active while it runs,
counted by the CPU allocator (``cpu_allocator_count``); the estimate must match it.
"""

import contextlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from vramledger import estimate
from vramledger.measure import cpu_allocator_count

from .conftest import fixture

ZOO_AUDIO_PY = fixture("zoo_audio_paths.py")
STEPS = 2
"""As the estimate's default: the steady-state peak is the second step's."""
BOUND = 0.001
"""The issue's bound: the estimate within 0.1 % of the plain run (all cases here are exact but
"scaled-view", see its test)."""

CASES = {
    # name: (model, inputs, loss, precision, batch size)
    "ctc-transposed": ("ctc_head", "ctc_inputs", "transposed_ctc_loss", "fp32", 8),
    "sdpa-math-mask": ("biased_attention", "attention_inputs", "attention_loss", "bf16-mixed", 2),
    "layernorm-mixed": ("narrow_norm", "norm_inputs", "norm_loss", "bf16-mixed", 8),
    "groupnorm-mixed": ("narrow_group_norm", "norm_inputs", "norm_loss", "bf16-mixed", 8),
    "saved-python-numbers": ("damped", "damped_inputs", "damped_loss", "fp32", 1),
    # an in-place division of a view by a Python number: no deadlock, 8 bytes missed
    "scaled-view": ("scaled_query", "query_inputs", "query_loss", "fp32", 4),
}


class _DoNothing(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _plain_peak(name: str, under_mode: bool = False) -> int:
    """Steady-state step peak of a plain SGD loop (forward and loss under bf16 autocast for
    bf16-mixed, as Lightning), counted from before the model is built."""
    from tests.fixtures import zoo_audio_paths

    model_name, inputs_name, loss_name, precision, batch_size = CASES[name]
    model_fn, inputs_fn, loss_fn = (
        getattr(zoo_audio_paths, n) for n in (model_name, inputs_name, loss_name)
    )
    cpu_allocator_count.install()
    torch.manual_seed(0)
    base = cpu_allocator_count.live()
    model = model_fn()
    batch = inputs_fn("cpu", batch_size=batch_size)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    mixed = precision == "bf16-mixed"
    peak = 0
    for _ in range(STEPS):
        cpu_allocator_count.reset_peak()
        optimizer.zero_grad(set_to_none=True)
        with _DoNothing() if under_mode else contextlib.nullcontext():
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mixed):
                loss = loss_fn(model, batch)
            loss.backward()
        del loss
        optimizer.step()
        peak = cpu_allocator_count.peak() - base
    return peak


def _estimate(name: str):
    model, inputs, loss, precision, batch_size = CASES[name]
    return estimate(
        model=f"{ZOO_AUDIO_PY}:{model}",
        inputs=f"{ZOO_AUDIO_PY}:{inputs}",
        loss=f"{ZOO_AUDIO_PY}:{loss}",
        optimizer="sgd",
        precision=precision,
        batch_size=batch_size,
        steps=STEPS,
        target="cpu",
    )


@pytest.mark.parametrize("name", list(CASES))
def test_estimate_matches_plain_run(name):
    plain = _plain_peak(name)
    predicted = _estimate(name).peak_bytes
    assert abs(predicted - plain) <= BOUND * plain, f"{name}: estimate {predicted} vs plain {plain}"


def test_sdpa_math_mask_add_is_in_place_in_a_plain_run():
    """The case reaches SDPA's ``areAnyTensorSubclassLike`` branch: under a do-nothing mode the
    mask is added out of place, and the count rises."""
    assert _plain_peak("sdpa-math-mask", under_mode=True) > _plain_peak("sdpa-math-mask")


def test_without_the_sdpa_rule_the_estimate_is_above(monkeypatch):
    """Traced as the mode runs it (the ``add`` kept), the estimate is above the plain run."""
    from vramledger.trace.core.plain_autograd import CONFIRMED_TWINS

    plain = _plain_peak("sdpa-math-mask")
    monkeypatch.setattr("vramledger.trace.core.twin_folding.CONFIRMED_TWINS", {})
    monkeypatch.setattr("vramledger.trace.core.plain_autograd.CONFIRMED_TWINS", {})
    assert CONFIRMED_TWINS  # the rule exists; switched off only here
    assert _estimate("sdpa-math-mask").peak_bytes > plain * (1 + BOUND)


@pytest.mark.parametrize(
    "name, op",
    [
        ("layernorm-mixed", torch.ops.aten.native_layer_norm.default),
        ("groupnorm-mixed", torch.ops.aten.native_group_norm.default),
    ],
)
def test_without_the_norm_correction_the_estimate_is_below(monkeypatch, name, op):
    """With the meta kernel's half-precision mean/rstd, the estimate is below the plain run."""
    from vramledger.trace.core.fake_corrections import CORRECTIONS

    plain = _plain_peak(name)
    monkeypatch.delitem(CORRECTIONS, op)
    assert _estimate(name).peak_bytes < plain * (1 - BOUND)


def test_ctc_gradient_is_contiguous_as_the_kernel_makes_it():
    """The CPU kernel's gradient of a transposed log-probability tensor is contiguous in
    (time, batch, labels); the trace's (trace/core/value_operators.py) has the same strides."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from vramledger.trace.core.value_operators import _ctc_loss
    from vramledger.trace.core.values import KnownValues

    aten = torch.ops.aten
    lp = torch.randn(2, 6, 5).log_softmax(-1).transpose(0, 1)
    targets = torch.randint(1, 5, (2, 3))
    lengths = (torch.full((2,), 6), torch.full((2,), 3))
    nll, alpha = aten._ctc_loss.Tensor(lp, targets, *lengths, 0, False)
    real = aten._ctc_loss_backward.Tensor(
        torch.ones(2), lp, targets, *lengths, nll, alpha, 0, False
    )
    with FakeTensorMode() as mode:
        fake_lp = mode.from_tensor(lp)
        args = (torch.ones(2), fake_lp, targets, lengths[0], list(lengths[1].tolist()))
        traced = _ctc_loss(KnownValues(mode), aten._ctc_loss_backward.default, args, {})
    assert traced.stride() == real.stride() != lp.stride()


def test_without_the_saved_numbers_the_estimate_is_below(monkeypatch):
    """Without registering the Python numbers autograd saves, the estimate is below."""
    plain = _plain_peak("saved-python-numbers")
    monkeypatch.setattr("vramledger.trace.core.tracker.saved_wrapped_numbers", lambda *_: [])
    assert _estimate("saved-python-numbers").peak_bytes < plain * (1 - BOUND)


def test_a_number_saved_for_an_in_place_call_on_a_view_is_missed_by_its_8_bytes():
    """``q /= 8.0`` on a view: the trace runs (it deadlocked reading the view's ``grad_fn``)
    and misses only the saved float64, which sits in the base's ``CopySlices``."""
    assert _estimate("scaled-view").peak_bytes == _plain_peak("scaled-view") - 8
