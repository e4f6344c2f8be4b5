"""Tracing a few identical blocks and extending is exactly a full trace, or is not used."""

import pytest

from vramledger import TrainingSpec
from vramledger.inputs.sources import load_hf_config
from vramledger.predict.step import policy_for
from vramledger.trace.core.blocks import same_timeline
from vramledger.trace.core.fake import trace

from .conftest import MODELS_PY, fixture

PLAIN = dict(inputs=f"{MODELS_PY}:mlp_inputs", loss=f"{MODELS_PY}:mlp_loss")


def deep(name: str, layers: int = 7) -> dict:
    config = load_hf_config(fixture(name)).to_dict()
    for key in ("num_hidden_layers", "n_layer"):
        if key in config:
            config[key] = layers
    return config


CASES = {
    "llama-bf16-master-ckpt-cuda": dict(
        model=deep("tiny-llama.json"), precision="bf16-master", grad_checkpointing=True, seq_len=32
    ),
    "llama-bf16-mixed-accum-cuda": dict(
        model=deep("tiny-llama.json"), precision="bf16-mixed", grad_accum=2, seq_len=32
    ),
    "llama-fp16-master-sgd-cpu": dict(
        model=deep("tiny-llama.json"),
        precision="fp16-master",
        optimizer="sgd-momentum",
        target="cpu",
        seq_len=32,
    ),
    "gpt2-adamw-forloop-cpu": dict(
        model=deep("tiny-gpt2.json"), optimizer_kwargs={"foreach": False}, target="cpu", seq_len=32
    ),
    "vit-adam-cuda": dict(model=deep("tiny-vit.json"), optimizer="adam", batch_size=2),
    "python-mlp-rmsprop-cuda": dict(model=f"{MODELS_PY}:deep_mlp", optimizer="rmsprop", **PLAIN),
}


@pytest.mark.parametrize("name", list(CASES))
def test_extended_trace_equals_full_trace(name):
    spec = TrainingSpec(**CASES[name])
    extended = trace(spec, policy_for(spec.target))
    full = trace(spec, policy_for(spec.target), extend_blocks=False)
    assert any("extended the timeline" in n for n in extended.notes), extended.notes
    assert same_timeline(extended.timeline, full.timeline)
    assert (extended.parameters, extended.trainable_parameters) == (
        full.parameters,
        full.trainable_parameters,
    )
    assert extended.optimizer_state_bytes == full.optimizer_state_bytes


def test_blocks_that_differ_are_traced_in_full():
    spec = TrainingSpec(model=f"{MODELS_PY}:alternating_mlp", **PLAIN)
    result = trace(spec, policy_for("cuda"))
    full = trace(spec, policy_for("cuda"), extend_blocks=False)
    assert any("traced every block" in n for n in result.notes), result.notes
    assert same_timeline(result.timeline, full.timeline)


def llama_run(optimizer: str = "adamw", **layout) -> dict:
    """A 7-block tiny Llama in bf16-master with ``optimizer`` on ``layout``'s GPUs."""
    return dict(
        model=deep("tiny-llama.json"),
        precision="bf16-master",
        optimizer=optimizer,
        seq_len=32,
        **layout,
    )


VERIFIED_CASES = {
    "llama-bf16-master-ckpt-cuda": CASES["llama-bf16-master-ckpt-cuda"],
    "vit-adam-cuda": CASES["vit-adam-cuda"],
    "llama-fsdp-3-ranks-adamw8bit": llama_run("adamw8bit", world_size=3, strategy="fsdp"),
    "llama-tp2-fsdp2": llama_run(dp_shard=2, tp=2),
    # a plan verifies once per family: tensor-parallel degrees and offload settings alike too
    "llama-tp4-fsdp2": {
        **llama_run(dp_shard=2, tp=4),
        "model": {**deep("tiny-llama.json"), "num_key_value_heads": 4},
    },
    "llama-fsdp-3-ranks-offload-optimizer": llama_run(
        world_size=3, strategy="fsdp", offload="optimizer"
    ),
}


@pytest.mark.parametrize("name", list(VERIFIED_CASES))
def test_verified_extension_from_the_smaller_trace_equals_full_trace(name):
    """A plan's re-estimates that differ only in data-parallel or tensor-parallel degree or in
    offload skip the check once one of them passed it (``blocks_verified``) and extend the
    smaller trace: still the full trace."""
    from vramledger.predict.step import _engine

    spec = TrainingSpec(**VERIFIED_CASES[name])
    policy = policy_for(spec.target)
    verified = trace(spec, policy, engine=_engine(spec), blocks_verified=True)
    full = trace(spec, policy, engine=_engine(spec), extend_blocks=False)
    assert verified.extended and not full.extended
    assert any("verified exact on this run at another" in n for n in verified.notes)
    assert same_timeline(verified.timeline, full.timeline)
    assert (verified.parameters, verified.trainable_parameters) == (
        full.parameters,
        full.trainable_parameters,
    )


STEP_MEMO_CASES = {
    "adamw8bit-cuda": llama_run("adamw8bit"),
    "adam4bit-fsdp-3-ranks": llama_run("adam4bit", world_size=3, strategy="fsdp"),
    "adamwfp8-tp2-fsdp2": llama_run("adamwfp8", dp_shard=2, tp=2),
}


@pytest.mark.parametrize("name", list(STEP_MEMO_CASES))
def test_replayed_optimizer_steps_equal_running_every_step(name, monkeypatch):
    """torchao's per-parameter steps are run once per argument layout and replayed after
    (``trace/core/step_memo.py``): the timeline is the one running every step makes."""
    from vramledger.predict.step import _engine
    from vramledger.trace.core import step_memo

    spec = TrainingSpec(**STEP_MEMO_CASES[name])
    policy = policy_for(spec.target)
    replayed = trace(spec, policy, engine=_engine(spec), extend_blocks=False)
    monkeypatch.setattr(step_memo, "STEP_FUNCTIONS", ())
    every = trace(spec, policy, engine=_engine(spec), extend_blocks=False)
    assert same_timeline(replayed.timeline, every.timeline)
    assert replayed.optimizer_state_bytes == every.optimizer_state_bytes


# -- adapters, quantized layers and frozen parameters (issue 22) -----------------------------------
LORA = "r=4,alpha=8,targets=q_proj,v_proj"
QLORA = dict(lora=LORA, quantize="nf4", precision="bf16-mixed")
ADAPTER_CASES = {
    # on the 24-layer Llama
    "lora-24": (24, dict(lora=LORA)),
    "qlora-nf4-24": (24, QLORA),
    "freeze-embedding-and-head-24": (24, dict(freeze=("model.embed_tokens.*", "lm_head.*"))),
    # on the 7-layer tiny Llama
    "lora-all-linear-ckpt": (7, dict(lora="r=4,alpha=8,targets=all-linear", grad_checkpointing=True)),
    "qlora-nf4-bf16-master-accum": (7, {**QLORA, "precision": "bf16-master", "grad_accum": 2}),
    "qlora-fp4": (7, {**QLORA, "quantize": "fp4"}),
    "lora-fp32-cpu": (7, dict(lora=LORA, target="cpu")),
    "lora-adamw8bit": (7, dict(lora=LORA, optimizer="adamw8bit")),
    "lora-fsdp-2-ranks": (7, dict(lora=LORA, world_size=2, strategy="fsdp")),
    "freeze-mlp": (7, dict(freeze=("*.mlp.*",))),
}  # fmt: skip
"""LoRA, QLoRA and ``--freeze``: every trainable parameter sits in a block, or block 0's input
needs no gradient (a frozen embedding), which the extension once refused."""


def llama_with(layers: int, **fields) -> TrainingSpec:
    """``narrow-llama-24l.json`` at 24 layers, else ``tiny-llama.json`` at ``layers``."""
    model = fixture("narrow-llama-24l.json") if layers == 24 else deep("tiny-llama.json", layers)
    return TrainingSpec(model=model, seq_len=32, batch_size=2, **fields)


def adapter_notes_of(result) -> list[str]:
    return [n for n in result.notes if n.startswith(("adapters found", "quantized layers", "fp32"))]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(ADAPTER_CASES))
def test_adapters_and_frozen_parameters_extend_exactly(name):
    from vramledger.predict.step import _engine

    spec = llama_with(*ADAPTER_CASES[name][:1], **ADAPTER_CASES[name][1])
    policy = policy_for(spec.target)
    extended = trace(spec, policy, engine=_engine(spec))
    assert extended.extended, extended.notes
    full = trace(spec, policy, engine=_engine(spec), extend_blocks=False)
    assert same_timeline(extended.timeline, full.timeline)
    assert (extended.parameters, extended.trainable_parameters) == (
        full.parameters,
        full.trainable_parameters,
    )
    assert extended.optimizer_state_bytes == full.optimizer_state_bytes
    # the notes still name the classes peft and bitsandbytes put on the model (issue 19)
    assert adapter_notes_of(extended) == adapter_notes_of(full)
    if spec.lora is not None:
        assert any("peft.tuners.lora" in n for n in adapter_notes_of(extended)), extended.notes
    if spec.quantize is not None:
        assert any("Linear4bit" in n for n in adapter_notes_of(extended)), extended.notes


REFUSED_CASES = {
    # named by index: a LoRA target or a frozen range deeper than the shallow builds reach
    "lora-target-in-block-20": (
        dict(lora="r=4,alpha=8,targets=q_proj,layers.20.self_attn.k_proj"),
        "--lora targets q_proj, layers.20.self_attn.k_proj adapt other modules in block 20",
    ),
    "freeze-blocks-10-to-19": (dict(freeze=("model.layers.1?.*",)), "matches no parameter"),
    "freeze-blocks-2-and-2x": (dict(freeze=("model.layers.2*",)), "alike in class"),
    "freeze-block-12-and-embedding": (
        dict(freeze=("model.embed_tokens.*", "model.layers.12.*")),
        "freezes other parameters in block 12",
    ),
    # LLM.int8 keeps its inputs on ctx: the graph released after backward frees them in an
    # order that changes past 16 layers (measured: the loss is freed after layer 0's tensors at
    # 8 and 12 layers, after layer 8's at 24)
    "lora-int8": (
        dict(lora=LORA, quantize="int8", precision="bf16-mixed"),
        "in an order that depends on the depth",
    ),
}
"""Runs whose blocks are not all alike, or whose order of events is not: never extended, and the
notes say why."""


@pytest.mark.parametrize("name", list(REFUSED_CASES))
def test_runs_the_extension_cannot_copy_trace_every_block(name):
    fields, why = REFUSED_CASES[name]
    spec = llama_with(24, **fields)
    result = trace(spec, policy_for(spec.target))
    assert not result.extended
    assert any(n.startswith("traced every block") and why in n for n in result.notes), result.notes


def test_a_python_model_with_one_frozen_block_is_traced_in_full():
    """A Python model is built in full and cut short: a block frozen alone makes the blocks
    unlike each other (``find_block_stack`` compares trainability)."""
    spec = TrainingSpec(model=f"{MODELS_PY}:deep_mlp", freeze=("blocks.5.*",), **PLAIN)
    result = trace(spec, policy_for("cuda"))
    full = trace(spec, policy_for("cuda"), extend_blocks=False)
    assert not result.extended
    assert same_timeline(result.timeline, full.timeline)
