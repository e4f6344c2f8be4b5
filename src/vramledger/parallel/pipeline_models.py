"""The stage models of a pipeline rank: each stage a copy of the Hugging Face decoder with the
other stages' layers removed (torchtitan's ``pipeline_module_split``), its forward one
micro-batch through the stage (``pipeline.py`` says how they run)."""

from __future__ import annotations

import types
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from vramledger.inputs.errors import InputError
from vramledger.inputs.precision import PrecisionPolicy, autocast
from vramledger.inputs.sources import ModelSource
from vramledger.parallel.pipeline_stages import StagePlan
from vramledger.parallel.tp_plans import SEQUENCE_DIM
from vramledger.trace.core.blocks import find_block_stack

FINAL_NORM_NAMES = ("norm", "final_layernorm", "final_layer_norm", "ln_f", "norm_f")
"""Attribute names of a Hugging Face base model's final norm."""


class PipelineChunks(nn.Module):
    """The stage model(s) one pipeline rank holds, each a child named ``stage{index}``: a copy
    of the model with the other stages' layers removed."""

    supports_gradient_checkpointing = True

    def __init__(self, stages: dict[str, nn.Module]) -> None:
        super().__init__()
        for name, module in stages.items():
            self.add_module(name, module)

    def gradient_checkpointing_enable(self, **kwargs: Any) -> None:
        """The Hugging Face switch of each stage model."""
        for module in self.children():
            module.gradient_checkpointing_enable(**kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("a pipeline rank's stages run under the schedule, one at a time")


@dataclass(frozen=True)
class DecoderParts:
    """Where the parts of a Hugging Face decoder are (attribute paths)."""

    blocks: str
    """The ModuleList of decoder layers, e.g. ``model.layers``."""
    norm: str
    """The base model's final norm attribute."""


def decoder_parts(model: nn.Module) -> DecoderParts:
    """The block stack and final norm of a Hugging Face causal LM whose base model holds
    nothing else with parameters than the input embedding (the stage's forward gives the base
    model the hidden states as ``inputs_embeds``; a learned position table, as GPT-2's, would be
    added again on every stage)."""
    name = type(model).__name__
    base = getattr(model, "base_model", None)
    if base is None or base is model or not hasattr(model, "get_output_embeddings"):
        raise InputError(
            f"pipeline stages are built for Hugging Face causal LMs, not {name}",
            hint="use a decoder config (Llama, Mistral, Qwen, ...)",
        )
    stack = find_block_stack(base, min_blocks=1)
    if stack is None:
        raise InputError(f"{name} has no single stack of identical decoder layers to split")
    prefix = next(n for n, m in model.named_modules() if m is base)
    norm = next(
        (n for n in FINAL_NORM_NAMES if isinstance(getattr(base, n, None), nn.Module)), None
    )
    embedding = model.get_input_embeddings()
    kept = {id(embedding), id(base.get_submodule(stack.fqn))}
    if norm is not None:
        kept.add(id(getattr(base, norm)))
    others = [
        n
        for n, m in base.named_children()
        if id(m) not in kept and any(True for _ in m.parameters())
    ]
    if norm is None or others:
        raise InputError(
            f"{name}'s base model has parts a pipeline stage cannot leave out or repeat "
            f"({', '.join(others) or 'no final norm found'})",
            hint="pipeline stages are modelled for Llama-like decoders (embedding, layers, norm)",
        )
    return DecoderParts(blocks=f"{prefix}.{stack.fqn}", norm=f"{prefix}.{norm}")


def cut_stage(model: nn.Module, plan: StagePlan, parts: DecoderParts) -> nn.Module:
    """``model`` as stage ``plan``: the other stages' layers removed (torchtitan's
    ``pipeline_module_split``), the embedding only on the first stage, the final norm (an
    identity elsewhere: the base model's forward calls it) and the output head only on the
    last; its forward runs one micro-batch through the stage."""
    parent_name, _, attr = parts.blocks.rpartition(".")
    parent = model.get_submodule(parent_name)
    layers = getattr(parent, attr)
    setattr(parent, attr, nn.ModuleList([layers[i] for i in plan.layers]))
    if not plan.first:
        model.set_input_embeddings(None)
    if not plan.last:
        norm_parent, _, norm_attr = parts.norm.rpartition(".")
        setattr(model.get_submodule(norm_parent), norm_attr, nn.Identity())
        model.set_output_embeddings(None)
    model.forward = types.MethodType(_stage_forward(plan, type(model).forward), model)
    return model


def _stage_forward(plan: StagePlan, model_forward: Any) -> Any:
    """A stage's forward. Under tensor parallelism (``_pipeline_sequence_mesh`` set by
    ``pipeline_rank.PipelineRank.wrap``) the hidden states a stage receives are its rank's part
    of the sequence, ``[micro, seq / tp, hidden]``, made a DTensor sharded along the sequence
    before the decoder layers (so the model's own code sees the whole sequence: its positions,
    rotary tables and mask), and those it sends are the local part of its output DTensor. The
    last stage returns the logits as the plan leaves them (split over the vocabulary under loss
    parallel)."""

    def forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
        mesh = getattr(self, "_pipeline_sequence_mesh", None)
        if mesh is not None and not plan.first:
            from torch.distributed.tensor import DTensor, Shard

            x = DTensor.from_local(x, mesh, [Shard(SEQUENCE_DIM)], run_check=False)
        fed = {"input_ids": x} if plan.first else {"inputs_embeds": x}
        with autocast(self._pipeline_precision, x.device.type):
            if plan.last:  # the model's own forward: its head and whatever follows it
                return model_forward(self, **fed, use_cache=False).logits
            hidden = self.base_model(**fed, use_cache=False).last_hidden_state
        return hidden.to_local() if mesh is not None else hidden

    return forward


def stage_source(
    source: ModelSource, plans: Sequence[StagePlan], parts: DecoderParts, precision: PrecisionPolicy
) -> ModelSource:
    """A source that builds this rank's stage models (``PipelineChunks``). It has no config, so
    the tracer finds the block stack in the built model and traces a few of its blocks."""

    def build() -> nn.Module:
        stages = {}
        for plan in plans:
            model = cut_stage(source.build(), plan, parts)
            model._pipeline_precision = precision
            stages[plan.name] = model
        return PipelineChunks(stages)

    return replace(source, build=build, config=None, builder=None)
