"""fit: the largest micro-batch or sequence length that fits, derived from a few traces and
re-estimated; checked against brute force and against real CPU runs of the answer and the next
size up."""

import pytest

from vramledger import estimate
from vramledger.inputs.gpus import resolve_gpu
from vramledger.inputs.spec import TrainingSpec
from vramledger.measure import measure
from vramledger.plan.fit import fit, interpolate

from .conftest import FIXTURES, MODELS_PY

TINY = str(FIXTURES / "hub" / "tiny-llama-bf16")


def test_interpolated_timeline_is_the_traced_one():
    """Storage sizes are polynomials in the batch size: traces at 2 and 3 give the trace at 5."""
    spec = dict(model=TINY, seq_len=64, precision="bf16-master")
    traced = {b: estimate(batch_size=b, **spec).timeline for b in (2, 3, 5)}
    derived = interpolate({2: traced[2], 3: traced[3]}, 5)
    assert derived is not None and derived.nbytes == traced[5].nbytes


def test_fit_answer_fits_and_the_next_size_does_not():
    spec = TrainingSpec(model=TINY, seq_len=128, precision="bf16-master")
    gpu = resolve_gpu(memory="120MiB")
    result = fit(spec, gpu, maximize="batch-size", checkpointing=(False,), margin=0)
    (answer,) = result.answers
    assert not answer.fits_next and answer.headroom_bytes >= 0

    # brute force with estimate around the answer
    def reserved(b):
        return estimate(spec, batch_size=b, gpu=gpu, margin=0).reserved_peak_bytes

    assert reserved(answer.batch_size) == answer.reserved_peak_bytes <= gpu.memory_bytes
    assert reserved(answer.batch_size + 1) > gpu.memory_bytes
    data = result.to_dict()
    assert {"optimizer", "checkpointing", "batch_size", "seq_len", "reserved_peak_bytes"} <= set(
        data["answers"][0]
    )
    assert data["answers"][0]["fits_next"] is False


def test_fit_sequence_length_with_checkpointing_on_and_off():
    spec = TrainingSpec(model=TINY, batch_size=2, precision="bf16-master")
    result = fit(spec, resolve_gpu(memory="100MiB"), maximize="seq-len", margin=0, seq_step=64)
    by_ckpt = {a.checkpointing: a for a in result.answers}
    assert set(by_ckpt) == {False, True}
    assert by_ckpt[True].seq_len >= by_ckpt[False].seq_len  # checkpointing never fits less
    assert all(a.seq_len % 64 == 0 and not a.fits_next for a in result.answers)


@pytest.mark.slow
def test_fit_on_cpu_against_real_runs():
    """A CPU budget: the real run of the answer fits it, the next size up does not (the CPU
    allocator's own count, within the estimate's measured error)."""
    spec = TrainingSpec(model=TINY, seq_len=64, target="cpu")
    budget = resolve_gpu(memory="24MiB")
    (answer,) = fit(spec, budget, maximize="batch-size", checkpointing=(False,), margin=0).answers
    slack = 1e-4 * budget.memory_bytes
    real = measure(spec, batch_size=answer.batch_size).measured_peak_bytes
    nxt = measure(spec, batch_size=answer.batch_size + 1).measured_peak_bytes
    assert real <= budget.memory_bytes + slack
    assert nxt > budget.memory_bytes - slack


def test_fit_shows_the_configuration_that_does_not_fit():
    """A budget that checkpointing fits and plain training does not: both rows are answered,
    the one that does not fit with what its smallest size needs (not hidden in a note)."""
    spec = TrainingSpec(model=TINY, seq_len=512, precision="bf16-master")
    result = fit(spec, resolve_gpu(memory="90.6MiB"), maximize="batch-size", margin=0)
    (off,) = result.no_fit
    assert not off.checkpointing and (off.batch_size, off.seq_len) == (1, 512)
    assert off.headroom_bytes < 0
    assert off.reserved_peak_bytes == (
        estimate(spec, batch_size=1, gpu=result.gpu, margin=0).reserved_peak_bytes
    )
    assert [a.checkpointing for a in result.answers] == [True]
    assert [r.checkpointing for r in result.rows()] == [False, True]
    assert result.to_dict()["no_fit"][0]["headroom_bytes"] == off.headroom_bytes

    from rich.console import Console

    from vramledger.render.planning import fit_table

    console = Console(width=200, record=True)
    console.print(fit_table(result))
    text = console.export_text()
    assert "none fits" in text and "smallest, 1×512, needs" in text


EIGHT = str(FIXTURES / "hub" / "tiny-llama-8l-bf16")


def test_fit_checks_the_block_extension_once_and_each_answer_is_the_full_estimate(monkeypatch):
    """fit's first estimate verifies that the 8 identical blocks extend from 4 (tracing 4 and 5);
    its other sizes trace 4 only (``blocks_verified``). The answer and the next size up are what
    an estimate of that size alone gives, extension checked afresh."""
    import vramledger.plan.fit_estimates as fit_estimates

    told = []

    def recording(spec, *, blocks_verified):
        told.append((spec.batch_size, blocks_verified))
        return estimate(spec, blocks_verified=blocks_verified)

    monkeypatch.setattr(fit_estimates, "estimate", recording)
    spec = TrainingSpec(model=EIGHT, seq_len=64, precision="bf16-master")
    gpu = resolve_gpu(memory="100MiB")
    result = fit(spec, gpu, checkpointing=(False,), margin=0, workers=1)
    (answer,) = result.answers
    assert told[0] == (2, False) and all(verified for _, verified in told[1:]), told
    assert {b for b, _ in told} >= {2, 3, answer.batch_size, answer.batch_size + 1}
    for size, peak in (
        (answer.batch_size, answer.reserved_peak_bytes),
        (answer.batch_size + 1, answer.next_size["reserved_peak_bytes"]),
    ):
        alone = estimate(spec, batch_size=size, gpu=result.gpu, margin=0)
        assert alone.blocks_extended and alone.reserved_peak_bytes == peak
    assert answer.reserved_peak_bytes <= gpu.memory_bytes < answer.next_size["reserved_peak_bytes"]


ALTERNATING = dict(
    model=f"{MODELS_PY}:alternating_mlp",
    inputs=f"{MODELS_PY}:mlp_inputs",
    loss=f"{MODELS_PY}:mlp_loss",
    target="cpu",
)
"""Eight blocks alike in class and parameters whose odd ones do more work: they do not extend."""


@pytest.mark.slow
def test_fit_with_a_worker_process_gives_the_same_answers():
    """With a worker process estimating the second of each pair of sizes alongside (the traced
    pair, then the answer and the next size up), every field but the timings is the same."""
    spec = TrainingSpec(model=EIGHT, seq_len=64, precision="bf16-master")
    gpu = resolve_gpu(memory="100MiB")
    alone, pooled = (
        fit(spec, gpu, checkpointing=(False,), margin=0, workers=w).to_dict() for w in (1, 2)
    )
    assert (alone.pop("workers"), pooled.pop("workers")) == (1, 2)
    del alone["seconds"], pooled["seconds"]
    assert pooled == alone
    assert alone["answers"][0]["batch_size"] > 3


@pytest.mark.slow
def test_a_worker_estimate_made_before_the_check_is_made_again_when_it_fails():
    """The worker's estimate of the second size traces the 4-block model only, before the first
    size's estimate here has checked the extension. Blocks alike in class and parameters whose
    odd ones do more work fail the check: the worker's answer is dropped and made again here,
    every block traced."""
    from vramledger.plan.fit_estimates import FitEstimates

    spec = TrainingSpec(**ALTERNATING, batch_size=2)
    second = TrainingSpec(**ALTERNATING, batch_size=3)
    with FitEstimates(1) as runs:
        runs.ahead([second])
        first = runs.ledger(spec)
        made = runs.ledger(second)
    assert not first.blocks_extended and not made.blocks_extended
    assert made.allocated_peak_bytes == estimate(second).allocated_peak_bytes
