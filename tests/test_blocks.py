"""Tracing a few identical blocks and extending is exactly a full trace, or is not used."""

import pytest

from vramledger import TrainingSpec
from vramledger.predict import policy_for
from vramledger.sources import load_hf_config
from vramledger.trace.blocks import same_timeline
from vramledger.trace.fake import trace

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
    "llama-zero3-3-ranks-offload-optimizer": llama_run(
        world_size=3, strategy="zero3", offload="optimizer"
    ),
}


@pytest.mark.parametrize("name", list(VERIFIED_CASES))
def test_verified_extension_from_the_smaller_trace_equals_full_trace(name):
    """A plan's re-estimates that differ only in data-parallel or tensor-parallel degree or in
    offload skip the check once one of them passed it (``blocks_verified``) and extend the
    smaller trace: still the full trace."""
    from vramledger.predict import _engine

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
    (``trace/step_memo.py``): the timeline is the one running every step makes."""
    from vramledger.predict import _engine
    from vramledger.trace import step_memo

    spec = TrainingSpec(**STEP_MEMO_CASES[name])
    policy = policy_for(spec.target)
    replayed = trace(spec, policy, engine=_engine(spec), extend_blocks=False)
    monkeypatch.setattr(step_memo, "STEP_FUNCTIONS", ())
    every = trace(spec, policy, engine=_engine(spec), extend_blocks=False)
    assert same_timeline(replayed.timeline, every.timeline)
    assert replayed.optimizer_state_bytes == every.optimizer_state_bytes
