"""Low-bit optimizers: their state in the ledger against the real libraries' state tensors."""

import pytest
import torch

from vramledger import Category, estimate
from vramledger.inputs.optimizers import resolve_optimizer
from vramledger.trace.core.tracker import storages_of

from .conftest import MODELS_PY
from .fixtures import compiled
from .fixtures.models import mlp_inputs, mlp_loss, wide_mlp

torchao = pytest.importorskip(
    "torchao", reason="torchao is not installed (pip install 'vramledger[lowbit]')"
)
SPEC = dict(
    model=f"{MODELS_PY}:wide_mlp", inputs=f"{MODELS_PY}:mlp_inputs", loss=f"{MODELS_PY}:mlp_loss"
)
COMPILED_PY = compiled.__file__
TORCHAO_SPEC = dict(
    model=f"{COMPILED_PY}:square_mlp",
    inputs=f"{COMPILED_PY}:square_inputs",
    loss=f"{COMPILED_PY}:square_loss",
)
"""For torchao's optimizers: three bias-free 256 x 256 linears, every state quantized and one
parameter layout, so their compiled step is one graph for Inductor to compile in the trace
(``trace/compile/compiled.py``; seconds each on a cold Inductor cache) instead of wide_mlp's seven."""
TORCHAO = {"adamw8bit", "adamw4bit", "adamwfp8", "adam8bit"}


def real_state(name: str, kwargs: dict | None = None) -> tuple[int, int]:
    """One real CPU step with the real library; bytes of every storage in optimizer.state."""
    torch.manual_seed(0)
    if name in TORCHAO:
        model = compiled.square_mlp()
        compiled.square_loss(model, compiled.square_inputs("cpu")).backward()
    else:
        model = wide_mlp()
        mlp_loss(model, mlp_inputs("cpu")).backward()
    choice = resolve_optimizer(name, kwargs or {})
    opt = choice.cls(model.parameters(), **choice.kwargs)
    with torch.compiler.set_stance("force_eager"):  # torchao compiles its step; same state bytes
        opt.step()
    seen = {}
    for state in opt.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                for st in storages_of(value):
                    seen[st.data_ptr()] = st.nbytes()
    params = sum(p.numel() for p in model.parameters())
    return sum(seen.values()), params


@pytest.mark.parametrize(
    "name", ["adamw8bit", "adamw4bit", "adamwfp8", "adam8bit", "adafactor", "adafactor-hf"]
)
def test_traced_state_equals_real_state(name):
    real, _ = real_state(name)
    ledger = estimate(target="cpu", optimizer=name, **(TORCHAO_SPEC if name in TORCHAO else SPEC))
    assert ledger.optimizer_state_bytes == real
    assert ledger.optimizer_state_method == "traced"


BNB = [
    "bnb-adamw8bit",
    "bnb-adam8bit",
    "bnb-paged-adamw8bit",
    "lion8bit",
    "lion",
    "bnb-adamw",
    ("bnb-sgd8bit", {"lr": 0.01, "momentum": 0.9}),
    "bnb-rmsprop8bit",
    "bnb-adagrad8bit",
    "bnb-lamb8bit",
    "bnb-ademamix8bit",
]


@pytest.mark.parametrize("entry", BNB, ids=lambda e: e if isinstance(e, str) else e[0])
def test_bitsandbytes_layout_equals_the_real_librarys_state(entry):
    pytest.importorskip("bitsandbytes", reason="bitsandbytes is not installed")
    name, kwargs = (entry, {}) if isinstance(entry, str) else entry
    try:
        real, _ = real_state(name, kwargs)
    except (RuntimeError, NotImplementedError, AttributeError) as exc:
        pytest.skip(f"{name} does not run on this CPU: {exc}")
    ledger = estimate(target="cpu", optimizer=name, optimizer_kwargs=kwargs, **SPEC)
    assert ledger.optimizer_state_bytes == real
    assert "init_state" in ledger.optimizer_state_method


def test_eight_bit_state_is_at_most_30_percent_of_fp32_adamw():
    fp32 = estimate(target="cuda", optimizer="adamw", **TORCHAO_SPEC)
    for name in ("adamw8bit", "bnb-adamw8bit"):
        low = estimate(target="cuda", optimizer=name, **TORCHAO_SPEC)
        ratio = low.at_peak[Category.OPTIMIZER_STATE] / fp32.at_peak[Category.OPTIMIZER_STATE]
        assert ratio <= 0.30, (name, ratio)
    four = estimate(target="cuda", optimizer="adamw4bit", **TORCHAO_SPEC)
    assert four.optimizer_state_bytes_per_param < low.optimizer_state_bytes_per_param


def test_paged_states_of_large_tensors_are_host_memory_on_cuda():
    pytest.importorskip("bitsandbytes", reason="bitsandbytes is not installed")
    paged = estimate(target="cuda", optimizer="bnb-paged-adamw8bit", **SPEC)
    plain = estimate(target="cuda", optimizer="bnb-adamw8bit", **SPEC)
    assert paged.optimizer_state_bytes == plain.optimizer_state_bytes
    assert paged.host_bytes > 0 and plain.host_bytes == 0
    assert paged.at_peak[Category.OPTIMIZER_STATE] < plain.at_peak[Category.OPTIMIZER_STATE]


def test_cpu_offload_moves_large_tensors_state_to_the_host():
    offload = estimate(target="cuda", optimizer="cpu-offload-adamw", precision="bf16-true", **SPEC)
    device_only = estimate(
        target="cuda",
        optimizer="adamw",
        optimizer_kwargs={"fused": True},
        precision="bf16-true",
        **SPEC,
    )
    assert offload.host_bytes > offload.at_peak[Category.OPTIMIZER_STATE]
    assert (
        offload.at_peak[Category.OPTIMIZER_STATE]
        < device_only.at_peak[Category.OPTIMIZER_STATE] / 10
    )
    assert "CPUOffloadOptimizer" in offload.optimizer_state_method


def test_cpu_offload_rejects_master_weights_and_cpu_target():
    from vramledger import InputError

    with pytest.raises(InputError, match="master weights"):
        estimate(target="cuda", optimizer="cpu-offload-adamw", precision="bf16-master", **SPEC)
    with pytest.raises(InputError, match="CUDA target"):
        estimate(target="cpu", optimizer="cpu-offload-adamw", **SPEC)
