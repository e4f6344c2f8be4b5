"""The estimate against real runs: the same step on real CPU tensors, measured two ways.

``measure`` counts a plain run (no dispatch mode, no tensor subclass active during the step:
the allocator's own count from ``torch.profiler`` memory events) and takes its categories from
a separate tracked run of the same step.
"""

import pytest
import torch

from vramledger import Category, estimate
from vramledger.measure import measure

from .conftest import MODELS_PY, fixture

TEXT = dict(batch_size=2, seq_len=32)
MLP = dict(model=f"{MODELS_PY}:mlp", inputs=f"{MODELS_PY}:mlp_inputs", loss=f"{MODELS_PY}:mlp_loss")
CNN = dict(
    model=f"{MODELS_PY}:cnn", inputs=f"{MODELS_PY}:image_inputs", loss=f"{MODELS_PY}:image_loss"
)

CASES = {
    "gpt2-adamw-fp32": dict(model=fixture("tiny-gpt2.json"), **TEXT),
    "llama-adamw-bf16-mixed": dict(
        model=fixture("tiny-llama.json"), precision="bf16-mixed", **TEXT
    ),
    "llama-adamw-bf16-master-ckpt": dict(
        model=fixture("tiny-llama.json"), precision="bf16-master", grad_checkpointing=True, **TEXT
    ),
    "llama-adamw-fp16-master": dict(
        model=fixture("tiny-llama.json"), precision="fp16-master", **TEXT
    ),
    "llama-adam-16-mixed-accum": dict(
        model=fixture("tiny-llama.json"),
        precision="16-mixed",
        optimizer="adam",
        grad_accum=2,
        **TEXT,
    ),
    "llama-fused-bf16-true": dict(
        model=fixture("tiny-llama.json"),
        precision="bf16-true",
        optimizer_kwargs={"fused": True},
        **TEXT,
    ),
    "bert-sgd-momentum": dict(model=fixture("tiny-bert.json"), optimizer="sgd-momentum", **TEXT),
    "t5-adam-foreach": dict(
        model=fixture("tiny-t5.json"), optimizer="adam", optimizer_kwargs={"foreach": True}, **TEXT
    ),
    "vit-sgd": dict(model=fixture("tiny-vit.json"), optimizer="sgd", batch_size=2),
    "mlp-rmsprop": dict(optimizer="rmsprop", **MLP),
    "cnn-adamw": dict(optimizer="adamw", batch_size=4, **CNN),
    "cnn-sgd-bf16-mixed": dict(optimizer="sgd", precision="bf16-mixed", batch_size=4, **CNN),
    # convolutions around a transposed LayerNorm (fake_corrections: its gradient's layout)
    "data2vec-audio-ctc-fp32": dict(model=fixture("hub/data2vec-audio-tiny"), **TEXT),
}


LLAMA_LAYERS = 2
"""``num_hidden_layers`` of tests/fixtures/tiny-llama.json."""
PLAIN_RUN_BOUND = 0.001
"""Relative, steady-state and first-step peak: the estimate within 0.1 % of the plain run
(issue 19's "done when"; the README's accuracy table is ``benchmarks/accuracy.py``'s)."""

MEASURED_RESIDUAL_BYTES: dict[str, tuple[int, int]] = {
    "gpt2-adamw-fp32": (-48, 0),
    "llama-fused-bf16-true": (0, -12),
    "t5-adam-foreach": (-8, -12),
}
"""case -> (steady-state, first step) estimate minus plain run, in bytes, as measured on
2026-12-02 (2-core x86_64 VM, torch 2.13.0+cpu, transformers 5.24, commit e2932ff;
``measure(..., compare=True)``); the other ten cases were exact to the byte, steady state and
first step. The residuals are scalars: a few bytes of loss values and step counters that the
trace frees at another moment. Every one is far inside ``PLAIN_RUN_BOUND``; they are named so
that a failure shows how far a case moved from what was measured."""


@pytest.mark.parametrize("name", list(CASES))
def test_estimate_matches_real_cpu_run(name):
    m = measure(target="cpu", compare=True, **CASES[name])
    est = m.estimate
    # The same dispatch-level tracker on real tensors sees what the fake trace predicted,
    # category by category (kernel scratch aside, which only the estimate probes).
    assert est.at_peak[Category.PARAMETERS] == m.ledger.at_peak[Category.PARAMETERS]
    assert est.optimizer_state_bytes == m.ledger.optimizer_state_bytes
    # The allocator's own count (profiler memory events) of the plain run, taken independently.
    diff = est.peak_bytes - m.measured_peak_bytes
    first_diff = est.first_step_peak_bytes - m.measured_first_step_peak_bytes
    residual = MEASURED_RESIDUAL_BYTES.get(name, (0, 0))
    assert abs(diff) <= PLAIN_RUN_BOUND * m.measured_peak_bytes, (
        f"{name}: estimate {est.peak_bytes} vs plain run {m.measured_peak_bytes} "
        f"({diff:+d} bytes; measured residual {residual[0]:+d})"
    )
    assert abs(first_diff) <= PLAIN_RUN_BOUND * m.measured_first_step_peak_bytes, (
        f"{name}: first step {est.first_step_peak_bytes} vs {m.measured_first_step_peak_bytes} "
        f"({first_diff:+d} bytes; measured residual {residual[1]:+d})"
    )


@pytest.mark.parametrize("name", ["llama-adamw-bf16-master-ckpt", "t5-adam-foreach", "cnn-adamw"])
def test_fake_trace_records_the_same_storages_as_the_real_run(name):
    """Tracker parity: without the CPU scratch probe, the fake trace and the same tracker on the
    real run see identical storages, in the same order, with the same categories."""
    from vramledger import TrainingSpec
    from vramledger.measure import _run
    from vramledger.trace.core.fake import trace
    from vramledger.trace.emulation.policy import DevicePolicy

    spec = TrainingSpec(target="cpu", **CASES[name])
    fake = trace(spec, DevicePolicy()).timeline
    real_ledger, _ = _run(spec, "cpu")
    real = real_ledger.timeline
    assert fake.nbytes == real.nbytes
    assert [fake.category(s) for s in range(fake.num_storages)] == [
        real.category(s) for s in range(real.num_storages)
    ]
    assert fake.op == real.op


def test_breakdowns_sum_to_totals():
    ledger = estimate(model=fixture("tiny-gpt2.json"), precision="bf16-mixed", **TEXT)
    assert sum(ledger.at_peak.values()) == ledger.peak_bytes
    assert sum(ledger.allocated_at_peak.values()) == ledger.allocated_peak_bytes
    assert sum(ledger.first_step_at_peak.values()) == ledger.first_step_peak_bytes
    assert ledger.allocated_peak_bytes >= ledger.peak_bytes
    assert max(ledger.phases.values()) == ledger.peak_bytes


def test_checkpointing_lowers_activations_and_matches_real_run():
    plain = measure(
        model=fixture("tiny-llama.json"), target="cpu", batch_size=2, seq_len=128, compare=True
    )
    ckpt = measure(
        model=fixture("tiny-llama.json"),
        target="cpu",
        batch_size=2,
        seq_len=128,
        grad_checkpointing=True,
        compare=True,
    )
    act = Category.ACTIVATIONS
    assert ckpt.ledger.at_peak[act] < plain.ledger.at_peak[act] / 2  # measured
    assert ckpt.estimate.at_peak[act] == ckpt.ledger.at_peak[act]
    assert abs(plain.error()) <= PLAIN_RUN_BOUND
    # Checkpointing stashes the CPU generator's state for each checkpointed layer
    # (torch.utils.checkpoint, preserve_rng_state=True: torch.get_rng_state()). It is made
    # outside any operator, so no dispatch-level tracker sees it: the estimate is that much
    # below the plain run (measured -10,112 bytes, both layers' states alive at the peak).
    untracked_rng_states = LLAMA_LAYERS * torch.get_rng_state().nbytes
    diff = ckpt.estimate.peak_bytes - ckpt.measured_peak_bytes
    assert diff == -untracked_rng_states or abs(ckpt.error()) <= PLAIN_RUN_BOUND, diff


def test_model_instance_is_traced_without_touching_its_weights():
    from tests.fixtures.models import MLP as MLPModule

    module = MLPModule()
    before = {k: v.clone() for k, v in module.state_dict().items()}
    ledger = estimate(
        model=module, inputs=f"{MODELS_PY}:mlp_inputs", loss=f"{MODELS_PY}:mlp_loss", target="cpu"
    )
    assert ledger.parameters == sum(p.numel() for p in module.parameters())
    for k, v in module.state_dict().items():
        assert torch.equal(v, before[k])
