"""--attn-implementation: transformers' sdpa and eager paths, and FlashAttention-2 modelled from
flash-attn's code (``attention.py``)."""

import pytest
import torch

from vramledger import InputError, estimate
from vramledger.inputs.attention import _FlashAttn2
from vramledger.ledger.replay import replay
from vramledger.measure import measure

from .conftest import MODELS_PY, fixture

LLAMA = fixture("hub/tiny-llama-bf16")  # 4 query heads, 2 kv heads, head dim 16, 2 layers
SPEC = dict(model=LLAMA, seq_len=256, batch_size=2, precision="bf16-master", gpu="a100-80gb")


def saved(ledger) -> int:
    return sum(replay(ledger.timeline).activations_by_module.values())


def test_flash_attention_2_saves_what_flash_attn_saves():
    """flash-attn 2's FlashAttnFunc saves q, k, v, the output, an fp32 logsumexp [b, h, s] and
    a 2-element int64 rng state; a head dimension that is not a multiple of 8 is padded."""
    b, s, h, h_k, d = 2, 40, 4, 2, 12
    q = torch.randn(b, s, h, d, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(b, s, h_k, d, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(b, s, h_k, d, dtype=torch.bfloat16, requires_grad=True)
    out = _FlashAttn2.apply(q, k, v)
    assert out.shape == (b, s, h, d)
    kept = out.grad_fn.saved_tensors
    assert [tuple(t.shape) for t in kept] == [
        (b, s, h, 16), (b, s, h_k, 16), (b, s, h_k, 16), (b, s, h, 16), (b, h, s), (2,),
    ]  # fmt: skip
    assert [t.dtype for t in kept[4:]] == [torch.float32, torch.int64]
    out.sum().backward()
    assert q.grad.shape == q.shape and k.grad.shape == k.shape and v.grad.shape == v.shape


def test_flash_attention_2_keeps_as_much_as_pytorchs_flash_kernel():
    """Both save q, k, v, the output and a logsumexp (PyTorch's flash kernel: its own philox
    seed and offset, flash-attn one rng_state): the same to 16 bytes; eager attention keeps the
    attention probabilities too."""
    sdpa = estimate(attn_implementation="sdpa", **SPEC)
    assert any("ran as flash attention" in n for n in sdpa.notes)
    fa2 = estimate(attn_implementation="flash_attention_2", **SPEC)
    assert any("FlashAttention-2 (flash-attn 2.x) modelled" in n for n in fa2.notes)
    assert abs(saved(fa2) - saved(sdpa)) <= 16
    eager = estimate(attn_implementation="eager", **SPEC)
    probs = 2 * 4 * 256 * 256 * 2  # batch x heads x s x s, bf16, per layer
    assert saved(eager) - saved(sdpa) >= 2 * probs  # two layers


def test_flash_attention_2_backward_allocates_its_fp32_accumulator():
    """flash-attn's mha_bwd (flash_api.cpp): dq_accum [b, round128(s), h, round32(d)] and
    softmax_d [b, h, round128(s)], both fp32 — at s = 200, d = 16: [2, 256, 4, 32] and
    [2, 4, 256]."""
    from vramledger.trace.core.tracker import StorageTracker

    b, s, h, d = 2, 200, 4, 16
    q = torch.randn(b, s, h, d, dtype=torch.bfloat16, requires_grad=True)
    kv = [torch.randn(b, s, h, d, dtype=torch.bfloat16, requires_grad=True) for _ in range(2)]
    out = _FlashAttn2.apply(q, *kv)
    grad = torch.ones_like(out)
    with StorageTracker(module_names={}, device_type="cpu") as tracker:
        out.backward(grad)
    timeline = tracker.close()
    sizes = sorted({timeline.nbytes[i] for i in range(len(timeline.nbytes))})
    assert b * 256 * h * 32 * 4 in sizes  # dq_accum
    assert b * h * 256 * 4 in sizes  # softmax_d


def test_what_flash_attention_2_cannot_be_is_refused():
    with pytest.raises(InputError, match="computes in fp16 or bf16"):
        estimate(**{**SPEC, "precision": "fp32"}, attn_implementation="flash_attention_2")
    with pytest.raises(InputError, match="a real run cannot use it"):
        measure(model=LLAMA, seq_len=32, target="cpu", attn_implementation="flash_attention_2")
    with pytest.raises(InputError, match="this model is Python code"):
        estimate(model=f"{MODELS_PY}:mlp", attn_implementation="eager", target="cpu")
    with pytest.raises(InputError, match="unknown attention implementation"):
        estimate(model=LLAMA, attn_implementation="flash")


def test_eager_attention_against_a_real_cpu_run():
    m = measure(
        model=LLAMA, seq_len=64, batch_size=2, target="cpu", attn_implementation="eager",
        compare=True,
    )  # fmt: skip
    assert abs(m.estimate.peak_bytes - m.measured_peak_bytes) <= 0.001 * m.measured_peak_bytes
