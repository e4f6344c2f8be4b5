"""Every option that changes the model reaches every trace of it: the full model, the shallow
models the block extension traces, a mesh's one-block shape check and a pipeline's parts are all
built by ``Recipe.build_model`` (at a depth: ``Recipe.at_depth``).

The guard: every ``TrainingSpec`` field is either a model option (it changes the model that is
built) or not; a new field fails :func:`test_every_spec_field_is_classified` until it is
classified, and a new model option fails :func:`test_every_model_option_has_a_case` until it has a
case below, which then has to build the same blocks at every depth and trace the same with and
without the extension.
"""

from dataclasses import fields

import pytest
import torch

from vramledger import TrainingSpec
from vramledger.inputs.recipe import resolve
from vramledger.inputs.sources import load_hf_config
from vramledger.measure import measure
from vramledger.predict.step import estimate, policy_for
from vramledger.trace.core.blocks import (
    MIN_BLOCKS,
    SMALL,
    find_block_stack,
    same_timeline,
    truncate,
)
from vramledger.trace.core.fake import trace

from .conftest import fixture

MODEL_OPTIONS = {
    "model",
    "task",
    "attn_implementation",
    "lora",
    "quantize",
    "freeze",
    "precision",
    "grad_checkpointing",
    "checkpoint_modules",
}
"""Spec fields that change the model that is built (``Recipe.build_model``)."""
OTHER_FIELDS = {
    # the batch and the step
    "batch_size", "seq_len", "image_size", "inputs", "loss", "optimizer", "optimizer_kwargs",
    "grad_accum", "steps", "target", "seed", "moe_routing",
    # how ranks share the work (engines wrap the built model; they do not build another)
    "world_size", "strategy", "offload", "nodes", "gpus_per_node", "deepspeed", "shard_modules",
    "shard_min_params", "reshard_after_forward", "accelerate_config", "dp_shard", "tp", "pp",
    "pp_schedule", "microbatches", "cp", "ep", "tp_plan",
    # the GPU the answer is for
    "gpu", "gpu_memory", "margin",
    # bookkeeping: --deepspeed / --accelerate-config were read into the fields (launch_configs.py)
    "configs_applied",
}  # fmt: skip
"""Spec fields that do not change the model that is built."""

DEPTH = MIN_BLOCKS
"""Layers of the test model: just deep enough for the block extension."""


def deep_llama() -> dict:
    """The Hub-saved tiny Llama (bf16 ``torch_dtype``) with :data:`DEPTH` layers."""
    config = load_hf_config(fixture("hub/tiny-llama-bf16")).to_dict()
    config["num_hidden_layers"] = DEPTH
    return config


BASE = dict(seq_len=64, batch_size=2)
CASES = {
    "model": {},
    "task": dict(task="sequence-classification"),
    "attn_implementation": dict(attn_implementation="eager", precision="bf16-mixed"),
    "lora": dict(lora="r=4,alpha=8,targets=q_proj,v_proj"),
    "quantize": dict(lora="r=4,alpha=8,targets=q_proj,v_proj", quantize="nf4", precision="bf16-mixed"),
    "freeze": dict(freeze=("*.mlp.*",)),
    "precision": dict(precision="bf16-master"),
    "grad_checkpointing": dict(grad_checkpointing=True),
    "checkpoint_modules": dict(checkpoint_modules=("LlamaMLP",)),
}  # fmt: skip
"""One case per model option, on :func:`deep_llama`."""


def spec_of(name: str, **extra) -> TrainingSpec:
    return TrainingSpec(model=deep_llama(), **{**BASE, **CASES[name], **extra})


def test_every_spec_field_is_classified():
    names = {f.name for f in fields(TrainingSpec)}
    assert not MODEL_OPTIONS & OTHER_FIELDS
    assert names == MODEL_OPTIONS | OTHER_FIELDS, (
        f"classify {sorted(names - MODEL_OPTIONS - OTHER_FIELDS)} as a model option or not; "
        f"gone: {sorted((MODEL_OPTIONS | OTHER_FIELDS) - names)}"
    )


def test_every_model_option_has_a_case():
    assert set(CASES) == MODEL_OPTIONS


def signature(model: torch.nn.Module) -> list[tuple]:
    """What a model is made of: every module's class, every parameter's and buffer's shape,
    dtype and trainability, the attention path its config dispatches on."""
    config = getattr(model, "config", None)
    return [
        ("attention", getattr(config, "_attn_implementation", None)),
        *((n, type(m).__qualname__, getattr(m, "gradient_checkpointing", None))
          for n, m in model.named_modules()),
        *((n, tuple(p.shape), p.dtype, p.requires_grad, type(p).__name__)
          for n, p in model.named_parameters()),
        *((n, tuple(b.shape), b.dtype) for n, b in model.named_buffers()),
    ]  # fmt: skip


@pytest.mark.parametrize("name", list(CASES))
def test_shallow_build_is_the_full_build_cut_short(name):
    """The model the extension traces at SMALL blocks is the full model with its later blocks
    cut off: the same classes, dtypes, adapters, quantized layers, frozen parameters,
    checkpointing and attention path."""
    recipe = resolve(spec_of(name))
    full = recipe.build_model("meta")
    stack = find_block_stack(full)
    assert stack is not None and stack.length == DEPTH
    truncate(full, stack, SMALL)
    shallow = recipe.at_depth(SMALL).build_model("meta")
    assert signature(shallow) == signature(full)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_extended_trace_equals_full_trace(name):
    spec = spec_of(name)
    extended = trace(spec, policy_for(spec))
    # every option extends, LoRA and quantized layers included (issue 22)
    assert extended.extended, extended.notes
    full = trace(spec, policy_for(spec), extend_blocks=False)
    assert same_timeline(extended.timeline, full.timeline)
    assert (extended.parameters, extended.trainable_parameters) == (
        full.parameters,
        full.trainable_parameters,
    )
    assert [n for n in extended.notes if n.startswith(("attention", "adapters", "quantized"))] == [
        n for n in full.notes if n.startswith(("attention", "adapters", "quantized"))
    ]


def test_eager_and_sdpa_differ_on_an_extended_trace():
    """The issue's failure: on a model deep enough for the extension, eager and sdpa gave
    byte-identical answers. Under bf16 autocast on an H100 SDPA runs cuDNN attention (no S×S
    matrix kept); eager keeps the softmax probabilities of every layer."""
    sdpa = estimate(spec_of("attn_implementation", attn_implementation="sdpa"))
    eager = estimate(spec_of("attn_implementation"))
    assert sdpa.blocks_extended and eager.blocks_extended
    assert eager.peak_bytes > sdpa.peak_bytes
    assert any("scaled_dot_product_attention" in n for n in sdpa.notes), sdpa.notes
    assert not any("scaled_dot_product_attention" in n for n in eager.notes), eager.notes
    assert any("eager implementation" in n for n in eager.notes), eager.notes


def test_notes_name_what_the_trace_ran():
    """Adapters and quantized layers are named from the classes found on the model."""
    ledger = estimate(spec_of("quantize"))
    found = [n for n in ledger.notes if n.startswith(("adapters found", "quantized layers found"))]
    assert any("peft.tuners.lora" in n and "q_proj, v_proj" in n for n in found), ledger.notes
    assert any("Linear4bit" in n for n in found), ledger.notes


PLAIN_RUN_BOUND = 0.001
"""The issue's bound for an estimate against a plain run (no dispatch mode active while it
runs), counted by the allocator."""


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_attention_paths_match_real_cpu_runs(attention):
    """Both paths, estimated for the CPU, against a plain real run of the same step counted by
    the allocator, and category by category against the tracked run's ledger."""
    m = measure(
        target="cpu",
        compare=True,
        model=fixture("hub/tiny-llama-bf16"),
        attn_implementation=attention,
        seq_len=64,
        batch_size=2,
    )
    assert abs(m.error()) <= PLAIN_RUN_BOUND, (m.estimate.peak_bytes, m.measured_peak_bytes)
    assert m.estimate.at_peak == m.ledger.at_peak


def test_qlora_under_bf16_master_says_why_attention_runs_the_math_path():
    """peft's k-bit preparation leaves the norms in fp32, so q/k/v are fp32 and, with grouped-query
    attention, no fused kernel takes them: the notes say so, from what the trace ran."""
    ledger = estimate(
        model=fixture("hub/tiny-llama-bf16"),
        lora="r=4,alpha=8,targets=q_proj,v_proj",
        quantize="nf4",
        precision="bf16-master",
        seq_len=64,
        gpu="h100-80gb",
    )
    why = [n for n in ledger.notes if n.startswith("attention: the math path ran because")]
    assert why and "q/k/v are float32" in why[0], ledger.notes
    assert any("LlamaRMSNorm" in n and "prepare_model_for_kbit_training" in n for n in ledger.notes)
