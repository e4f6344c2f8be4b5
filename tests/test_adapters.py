"""LoRA (peft), quantized base weights (bitsandbytes) and freezing, against real CPU runs of the
same step with the same libraries."""

import pytest

from vramledger import Category, InputError, estimate
from vramledger.measure import measure

from .conftest import FIXTURES, MODELS_PY, fixture

TINY = str(FIXTURES / "hub" / "tiny-llama-bf16")
BATCHES = fixture("user_batches.py")
LORA = "r=8,alpha=16,targets=q_proj,v_proj"
# tiny-llama: hidden 64, 2 layers; q_proj 64 -> 64, v_proj 64 -> 32 (2 key/value heads of 16)
ADAPTER_PARAMETERS = 2 * (8 * (64 + 64) + 8 * (64 + 32))
PLAIN_RUN_BOUND = 1e-4
"""LoRA, LLM.int8 and QLoRA against the plain run's allocator count: the README's "within
0.01 %" (measured on 2026-12-02: fp32 LoRA -0.0081 %, bf16-mixed LoRA -0.0014 %, int8
-0.0016 %: a few scalars the trace does not see; on 2026-12-03, with measure's tracked run
first, `vramledger measure` of LoRA, int8 and nf4 at batch 2 were exact)."""


def _real(**spec):
    m = measure(target="cpu", compare=True, seq_len=64, **spec)
    return m, m.estimate


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
def test_lora_matches_a_real_peft_run(precision):
    m, est = _real(model=TINY, lora=LORA, precision=precision)
    assert abs(m.error()) <= PLAIN_RUN_BOUND, (m.measured_peak_bytes, est.peak_bytes)
    assert est.trainable_parameters == m.ledger.trainable_parameters == ADAPTER_PARAMETERS
    # the frozen base has no gradients and no optimizer state; AdamW keeps m and v of the adapters
    assert est.optimizer_state_bytes == m.ledger.optimizer_state_bytes
    assert est.at_peak.get(Category.GRADIENTS, 0) <= 4 * ADAPTER_PARAMETERS


@pytest.mark.parametrize("kind", ["nf4", "int8"])
def test_quantized_base_is_bitsandbytes_own_layout(kind):
    m, est = _real(model=TINY, lora=LORA, quantize=kind, precision="bf16-mixed")
    # the tracker sees the same tensors in the trace as in the real bitsandbytes run
    assert est.peak_bytes == m.ledger.peak_bytes
    assert est.at_peak == m.ledger.at_peak
    # parameters are counted as the weights they stand for, trainable ones are the adapters
    assert (
        est.parameters
        == estimate(model=TINY, target="cpu", seq_len=64).parameters + ADAPTER_PARAMETERS
    )
    assert est.trainable_parameters == ADAPTER_PARAMETERS
    # the allocator's own count; measure's tracked run goes first, so bitsandbytes' import-time
    # tables and the bounds its CPU quantization caches on first use (144 + 252 B, counted
    # only when this was the process's first such run: -0.020 % here, -1.05 % on the MLP
    # below) are the process's, not the step's
    assert abs(m.error()) <= PLAIN_RUN_BOUND


def test_quantized_weights_take_their_packed_bytes():
    full = estimate(model=TINY, seq_len=64, lora=LORA, precision="bf16-mixed")
    nf4 = estimate(model=TINY, seq_len=64, lora=LORA, quantize="nf4", precision="bf16-mixed")
    int8 = estimate(model=TINY, seq_len=64, lora=LORA, quantize="int8", precision="bf16-mixed")
    params = {
        k: e.at_peak[Category.PARAMETERS] for k, e in (("fp", full), ("nf4", nf4), ("int8", int8))
    }
    assert params["nf4"] < params["int8"] < params["fp"]


def test_checkpointing_a_users_peft_model():
    spec = dict(model=f"{BATCHES}:peft_llama", inputs=f"{BATCHES}:llama_batch", target="cpu")
    plain = estimate(**spec)
    ckpt = estimate(grad_checkpointing=True, **spec)
    assert ckpt.trainable_parameters == plain.trainable_parameters == ADAPTER_PARAMETERS
    assert ckpt.at_peak.get(Category.ACTIVATIONS, 0) < plain.at_peak.get(Category.ACTIVATIONS, 0)


def test_freeze_patterns():
    ledger = estimate(model=TINY, seq_len=32, target="cpu", freeze=("model.embed_tokens.*",))
    assert ledger.trainable_parameters == ledger.parameters - 1000 * 64
    with pytest.raises(InputError, match="matches no parameter"):
        estimate(model=TINY, seq_len=32, target="cpu", freeze=("encoder.*",))


@pytest.mark.parametrize(
    ("lora", "message"),
    [
        ("alpha=16,targets=q_proj", "needs r= and targets="),
        ("r=8,targets=q_proj,rank=4", "unknown key"),
        ("r=x,targets=q_proj", "invalid literal for int"),
        (
            "r=8,targets=query_key",
            "layers that peft's LoRA adapts: down_proj, embed_tokens, gate_proj",
        ),
    ],
)
def test_bad_lora_is_one_line(lora, message):
    with pytest.raises(InputError) as exc:
        estimate(model=TINY, seq_len=16, lora=lora, target="cpu")
    assert message in exc.value.one_line()


def test_nothing_to_train_is_refused_in_one_line():
    """--quantize without --lora leaves no parameter trainable (prepare_model_for_kbit_training
    freezes the base): a one-line error that says to add --lora, not the optimizer's own."""
    with pytest.raises(InputError, match="nothing to train") as refused:
        estimate(model=str(FIXTURES / "tiny-llama.json"), seq_len=64, quantize="nf4")
    assert "--lora" in refused.value.hint


def test_quantize_a_model_that_is_not_a_transformers_model():
    """--quantize on plain PyTorch with its own adapters (issue 20: peft's k-bit preparation
    froze them, "optimizer got an empty parameter list", and the last-registered Linear was kept
    in full precision instead of the head): every nn.Linear is quantized, as Lightning's
    BitsandbytesPrecision does, the model's own adapters keep training, and the prediction
    matches the real bitsandbytes run."""
    m, est = _real(
        model=f"{MODELS_PY}:own_lora",
        inputs=f"{MODELS_PY}:mlp_inputs",
        loss=f"{MODELS_PY}:mlp_loss",
        quantize="nf4",
    )
    assert (
        est.trainable_parameters == m.ledger.trainable_parameters == 4 * (32 + 64) + 4 * (64 + 64)
    )
    assert est.at_peak == m.ledger.at_peak
    assert abs(m.error()) <= PLAIN_RUN_BOUND
    assert any(
        n.startswith("not a transformers model: --quantize replaced every") for n in est.notes
    )
    assert "quantized layers found on the model: bitsandbytes.Linear4bit" in est.notes
